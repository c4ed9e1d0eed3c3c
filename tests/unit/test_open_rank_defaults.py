"""`shardcache.open()` and `open_mixture()` without rank/world_size read as $RANK of
$WORLD_SIZE, as the torch and numpy adapters do (`shardcache.ranks`): under torchrun a
default of rank 0 of 1 had every rank read the whole epoch, silently. A trainer that
initialised torch.distributed itself, with no launcher variables, reads as its default
process group's rank (it wins over the variables), and torch is never imported for it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import shardcache
from shardcache import errors, ranks
from shardcache.inspect import session
from tests.support import datasets

pytestmark = pytest.mark.unit


@pytest.fixture
def uri(tmp_path: Path) -> str:
    found, _ = datasets.write_local(tmp_path / "ds", [10, 10])
    return found


def _torchrun(monkeypatch: pytest.MonkeyPatch, rank: str, world: str) -> None:
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setenv("LOCAL_RANK", "0")


def test_open_under_torchrun_reads_as_the_launchers_rank(
    uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _torchrun(monkeypatch, "2", "4")
    with shardcache.open(uri, cache_dir=tmp_path / "cache") as ds:
        assert (ds.params.rank, ds.params.world_size) == (2, 4)
        assert len(ds) == 5  # rank 2's quarter of 20 rows, not all of them


def test_open_reads_the_same_rank_as_the_numpy_adapter(
    uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("numpy")
    import shardcache.numpy

    _torchrun(monkeypatch, "1", "3")
    with shardcache.open(uri, cache_dir=tmp_path / "cache") as ds:
        opened = ds.params
    batches = shardcache.numpy.Batches(uri, batch_size=4, cache_dir=str(tmp_path / "cache"))
    try:
        adapter = batches.dataset.params
    finally:
        batches.close()
    assert (opened.rank, opened.world_size) == (adapter.rank, adapter.world_size) == (1, 3)


def test_explicit_rank_and_world_size_win_over_the_environment(
    uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _torchrun(monkeypatch, "2", "4")
    with shardcache.open(uri, cache_dir=tmp_path / "cache", rank=0, world_size=1) as ds:
        assert (ds.params.rank, ds.params.world_size) == (0, 1)
    with shardcache.open(uri, cache_dir=tmp_path / "cache", world_size=8) as ds:
        assert (ds.params.rank, ds.params.world_size) == (2, 8)


def test_without_launcher_variables_open_reads_as_rank_0_of_1(
    uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with shardcache.open(uri, cache_dir=tmp_path / "cache") as ds:
        assert (ds.params.rank, ds.params.world_size) == (0, 1)
        assert len(ds) == 20


def test_the_environment_is_not_read_when_both_are_given(
    uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _torchrun(monkeypatch, "not-a-number", "4")
    with shardcache.open(uri, cache_dir=tmp_path / "cache", rank=1, world_size=2) as ds:
        assert (ds.params.rank, ds.params.world_size) == (1, 2)
    with pytest.raises(errors.InputError, match=r"\$RANK: expected an integer, found 'not-a"):
        shardcache.open(uri, cache_dir=tmp_path / "cache")


def test_a_given_rank_outside_the_environments_world_size_names_both_sources(
    uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _torchrun(monkeypatch, "0", "4")
    with pytest.raises(
        errors.InputError, match=r"rank=5 and \$WORLD_SIZE=4: expected 0 <= rank < world_size"
    ):
        shardcache.open(uri, cache_dir=tmp_path / "cache", rank=5)


def test_a_bad_rank_type_is_still_refused_naming_the_option(uri: str, tmp_path: Path) -> None:
    with pytest.raises(errors.InputError, match="rank: expected an int, found str '1'"):
        shardcache.open(uri, cache_dir=tmp_path / "cache", rank="1")  # type: ignore[arg-type]


def test_open_mixture_reads_the_rank_from_its_environment() -> None:
    # Checked before the descriptor or any sidecar is looked for.
    with pytest.raises(errors.InputError, match=r"\$RANK: expected an integer, found 'x'"):
        shardcache.open_mixture(environ={"RANK": "x", "WORLD_SIZE": "2"})
    with pytest.raises(errors.InputError, match=r"rank=3 and \$WORLD_SIZE=2"):
        shardcache.open_mixture(rank=3, environ={"WORLD_SIZE": "2"})


def test_given_or_env_takes_what_is_left_out_from_the_environment() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "8"}
    assert ranks.given_or_env(None, None, env) == ranks.Ranks(3, 8)
    assert ranks.given_or_env(1, None, env) == ranks.Ranks(1, 8)
    assert ranks.given_or_env(None, 16, env) == ranks.Ranks(3, 16)
    assert ranks.given_or_env(1, 2, {"RANK": "junk"}) == ranks.Ranks(1, 2)
    assert ranks.given_or_env(None, None, {}) == ranks.Ranks(0, 1)


def test_the_inspector_reads_the_dataset_whatever_the_launchers_rank(
    uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The inspector takes the whole dataset's shards, not a rank's stream: a launcher's
    # variables (even malformed ones) play no part.
    _torchrun(monkeypatch, "junk", "4")
    inspector = session.open_uri(uri, cache_dir=str(tmp_path / "cache"))
    inspector.close()


@pytest.fixture
def gloo_group(tmp_path: Path) -> Iterator[None]:
    """This process as rank 0 of a torch.distributed group of one (gloo, no variables)."""
    import torch.distributed as dist

    store = (tmp_path / "group").as_uri()
    dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_open_follows_an_initialised_torch_process_group_over_the_environment(
    uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gloo_group: None
) -> None:
    # Variables left from another layout: the group the trainer's collectives use wins.
    _torchrun(monkeypatch, "2", "4")
    with shardcache.open(uri, cache_dir=tmp_path / "cache") as ds:
        assert (ds.params.rank, ds.params.world_size) == (0, 1)
        assert len(ds) == 20
    from shardcache import numpy as adapter

    batches = adapter.Batches(uri, batch_size=4, cache_dir=str(tmp_path / "cache"))
    try:
        assert (batches.rank, batches.world_size) == (0, 1)
    finally:
        batches.close()
    env = {"RANK": "2", "WORLD_SIZE": "4"}
    assert ranks.given_or_env(None, None, env) == ranks.Ranks(0, 1)
    # Given ones still win; what is left out comes from the group.
    assert ranks.given_or_env(3, 4, env) == ranks.Ranks(3, 4)
    assert ranks.given_or_env(None, 8, env) == ranks.Ranks(0, 8)
    # The variables the group overrides are not read at all.
    assert ranks.given_or_env(None, None, {"RANK": "junk"}) == ranks.Ranks(0, 1)
    with pytest.raises(
        errors.InputError,
        match=r"rank=3 and torch.distributed.get_world_size\(\)=1: expected 0 <= rank",
    ):
        ranks.given_or_env(3, None, env)


def test_without_an_initialised_process_group_the_environment_is_read_with_torch_imported() -> None:
    import torch.distributed as dist

    assert not dist.is_initialized()
    assert ranks.given_or_env(None, None, {"RANK": "3", "WORLD_SIZE": "8"}) == ranks.Ranks(3, 8)


#: One rank of a trainer that initialises torch.distributed itself (as under mpirun):
#: no RANK/WORLD_SIZE in its environment. argv: rank, group store, dataset, cache.
_SELF_INITIALISED_RANK = """
import json, sys
import torch.distributed as dist
import shardcache
dist.init_process_group("gloo", init_method=sys.argv[2], rank=int(sys.argv[1]), world_size=2)
with shardcache.open(sys.argv[3], cache_dir=sys.argv[4], shuffle=False) as ds:
    uids = [u for b in ds.batches(4) for u in b.column("uid").to_pylist()]
    print(json.dumps({"rank": ds.params.rank, "world_size": ds.params.world_size, "uids": uids}))
dist.destroy_process_group()
"""


def test_ranks_of_a_self_initialised_process_group_read_every_row_once(
    uri: str, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    store = (tmp_path / "group").as_uri()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _SELF_INITIALISED_RANK,
                str(r),
                store,
                uri,
                str(tmp_path / f"c{r}"),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    done = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)  # a guard against a hung rendezvous
        assert proc.returncode == 0, err
        done.append(json.loads(out.strip().splitlines()[-1]))
    assert [(d["rank"], d["world_size"]) for d in done] == [(0, 2), (1, 2)]
    first, second = (set(d["uids"]) for d in done)
    assert len(first) == len(second) == 10
    assert first | second == set(range(20))


def test_shardcache_does_not_import_torch_to_find_the_rank(uri: str, tmp_path: Path) -> None:
    code = (
        "import sys, shardcache\n"
        f"with shardcache.open({uri!r}, cache_dir={str(tmp_path / 'cache')!r}) as ds:\n"
        "    print(ds.params.rank, ds.params.world_size, 'torch' in sys.modules)\n"
    )
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "2", "False"]
