"""`shardcache.open()` and `open_mixture()` without rank/world_size read as $RANK of
$WORLD_SIZE, as the torch and numpy adapters do (`shardcache.ranks`): under torchrun a
default of rank 0 of 1 had every rank read the whole epoch, silently."""

from __future__ import annotations

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
