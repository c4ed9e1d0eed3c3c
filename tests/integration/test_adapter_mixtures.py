"""Mixtures through the framework adapters: `shardcache.mixture_batching.MixtureReader`
split over loader processes, `shardcache.numpy.Batches` and `shardcache.torch`'s
IterableDataset under real DataLoader workers and torchdata's StatefulDataLoader.

The reference is the mixture itself read in one process (`Mixture.batches`): every
adapter, any number of workers, and every resume must yield exactly its batches, in
its order. The sources are small, so the steps read run through several epochs of each.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest
import torch
import torch.utils.data
from torchdata.stateful_dataloader import StatefulDataLoader

import shardcache
import shardcache.numpy
import shardcache.torch
from shardcache import batching, errors, mixture_batching, mixtures
from tests.support import datasets

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    # torchdata 0.11 (its latest) still calls an API torch has since deprecated.
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]

#: 70 and 25 rows: 60 steps of 4 rows run through 2-3 epochs of web and 2-3 of code.
SHARDS = {"web": [23, 17, 30], "code": [11, 14]}
WEIGHTS = {"web": 3, "code": 1}
BATCH = 4
STEPS = 60
MIX_SEED = 3
BLOCK = 5
#: Plans of the sources: block mode, and sample mode with windows spanning shards.
PLANS: dict[str, dict[str, Any]] = {
    "block": {"shuffle": "block"},
    "sample": {"shuffle": "sample", "window": 16},
}


@pytest.fixture
def uris(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    out = {}
    for name, rows in SHARDS.items():
        datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / name), rows)
        out[name] = str(tmp_path / name)
    return out


def open_options(tmp_path: Path, plan: str) -> dict[str, Any]:
    return {"cache_dir": str(tmp_path / "cache"), "block_size": BLOCK, "seed": 1, **PLANS[plan]}


def open_mix(uris: dict[str, str], tmp_path: Path, plan: str) -> mixtures.Mixture:
    opened = {n: shardcache.open(u, **open_options(tmp_path, plan)) for n, u in uris.items()}
    return shardcache.mix(opened, weights=WEIGHTS, seed=MIX_SEED)


def expected(uris: dict[str, str], tmp_path: Path, plan: str) -> list[list[int]]:
    """The mixture's batches read in one process: the reference."""
    with open_mix(uris, tmp_path, plan) as mixed:
        return [b.column("uid").to_pylist() for b in mixed.batches(BATCH, steps=STEPS)]


def host_uids(batch: batching.HostBatch) -> list[int]:
    return [u for piece in batch.pieces for u in piece.column("uid").to_pylist()]


def round_robin(
    readers: list[Iterator[batching.HostBatch]], start: int, stop: int
) -> list[list[int]]:
    """Steps [start, stop) collected as a DataLoader does: step t from worker t mod n."""
    return [host_uids(next(readers[t % len(readers)])) for t in range(start, stop)]


@pytest.mark.parametrize("plan", sorted(PLANS))
@pytest.mark.parametrize("workers", [1, 3])
def test_workers_split_the_mixtures_steps_and_yield_its_batches_in_order(
    uris: dict[str, str], tmp_path: Path, plan: str, workers: int
) -> None:
    want = expected(uris, tmp_path, plan)
    mixes = [open_mix(uris, tmp_path, plan) for _ in range(workers)]
    readers = [
        mixture_batching.MixtureReader(m, batching.Options(BATCH), batching.Split(j, workers))
        for j, m in enumerate(mixes)
    ]
    got = round_robin([iter(r) for r in readers], 0, STEPS)
    assert got == want
    # Every worker read only its own steps: its per-source counts are its share.
    for j, m in enumerate(mixes):
        mine = [t for t in range(STEPS) if t % workers == j]
        assert sum(c.batches for c in m.counts.values()) == len(mine)
        assert m.counts["code"].batches == sum(m.drawn(t) == "code" for t in mine)
        m.close()


def test_within_an_epoch_no_source_row_is_read_twice_across_workers(
    uris: dict[str, str], tmp_path: Path
) -> None:
    mixes = [open_mix(uris, tmp_path, "sample") for _ in range(3)]
    readers = [
        mixture_batching.MixtureReader(m, batching.Options(BATCH), batching.Split(j, 3))
        for j, m in enumerate(mixes)
    ]
    got = round_robin([iter(r) for r in readers], 0, STEPS)
    per_source: dict[str, list[int]] = {"web": [], "code": []}
    for t, uids in enumerate(got):
        per_source[mixes[0].drawn(t)] += uids
    for name, rows in SHARDS.items():
        first_epoch = per_source[name][: sum(rows)]
        assert sorted(first_epoch) == list(range(sum(rows))), name
    for m in mixes:
        m.close()


@pytest.mark.parametrize("plan", sorted(PLANS))
@pytest.mark.parametrize("stop", [1, 7, 23])
def test_each_worker_resumes_at_its_own_next_step(
    uris: dict[str, str], tmp_path: Path, plan: str, stop: int
) -> None:
    want = expected(uris, tmp_path, plan)
    workers = 3
    first = [
        mixture_batching.MixtureReader(
            open_mix(uris, tmp_path, plan), batching.Options(BATCH), batching.Split(j, workers)
        )
        for j in range(workers)
    ]
    head = round_robin([iter(r) for r in first], 0, stop)
    # What a checkpoint stores: every worker's JSON state, taken after the same batch.
    saved = [json.loads(json.dumps(r.state_dict())) for r in first]
    for r in first:
        r.close()
        r.mixture.close()
    resumed = [
        mixture_batching.MixtureReader(
            open_mix(uris, tmp_path, plan), batching.Options(BATCH), batching.Split(j, workers)
        )
        for j in range(workers)
    ]
    for r, state in zip(resumed, saved, strict=True):
        r.load_state_dict(state)
    assert head + round_robin([iter(r) for r in resumed], stop, STEPS) == want
    for r in resumed:
        r.mixture.close()


def test_a_reader_state_of_other_batching_or_a_dataset_is_refused(
    uris: dict[str, str], tmp_path: Path
) -> None:
    with open_mix(uris, tmp_path, "block") as mixed:
        reader = mixture_batching.MixtureReader(mixed, batching.Options(BATCH))
        state = reader.state_dict()
        other = mixture_batching.MixtureReader(mixed, batching.Options(BATCH + 1))
        with pytest.raises(errors.StateMismatchError, match=r"batch_size: state has 4"):
            other.load_state_dict(state)
        with pytest.raises(errors.StateMismatchError, match="expected a mixture reader state"):
            reader.load_state_dict({"version": 1, "dataset": {}})
        with pytest.raises(errors.InputError, match="pack: expected None with a mixture"):
            mixture_batching.MixtureReader(mixed, batching.Options(BATCH, pack=8))


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_numpy_batches_of_a_mixture_resume_exactly(
    uris: dict[str, str], tmp_path: Path, plan: str
) -> None:
    want = expected(uris, tmp_path, plan)
    options = dict(mixture=uris, weights=WEIGHTS, mix_seed=MIX_SEED, **open_options(tmp_path, plan))
    with shardcache.numpy.Batches(batch_size=BATCH, columns=["uid"], **options) as first:
        got = [b["uid"].tolist() for _, b in zip(range(10), first, strict=False)]
        state = json.loads(json.dumps(first.state_dict()))
        # A new iter() goes on where the last one stopped: a mixture has no epoch.
        got += [b["uid"].tolist() for _, b in zip(range(5), first, strict=False)]
    assert got == want[:15]
    with shardcache.numpy.Batches(batch_size=BATCH, columns=["uid"], **options) as resumed:
        resumed.load_state_dict(state)
        assert [b["uid"].tolist() for _, b in zip(range(20), resumed, strict=False)] == want[10:30]


def test_numpy_batches_read_a_mixture_opened_by_the_caller(
    uris: dict[str, str], tmp_path: Path
) -> None:
    want = expected(uris, tmp_path, "block")
    with shardcache.numpy.Batches(
        open_mix(uris, tmp_path, "block"), batch_size=BATCH, columns=["uid"]
    ) as it:
        assert it.mixture is not None
        assert [b["uid"].tolist() for _, b in zip(range(STEPS), it, strict=False)] == want


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"weights": WEIGHTS}, "weights and mix_seed: expected only with mixture="),
        ({"mixture": {"web": "x"}}, r"mixture=\{...\}: expected weights="),
        (
            {"mixture": True, "cache_dir": "/tmp/c"},
            r"mixture=True reads the pod's .* \['cache_dir'\]",
        ),
        ({"mixture": {}, "weights": {}}, "mixture: expected True"),
        (
            {"mixture": {"web": "file:///w"}, "weights": {"code": 1}},
            r"weights at step 0: expected a weight for each source \['web'\]",
        ),
    ],
)
def test_mixture_options_are_checked_before_anything_opens(
    kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(errors.InputError, match=message):
        shardcache.numpy.Batches(batch_size=BATCH, **kwargs)


def loader(ds: object, workers: int, cls: type = torch.utils.data.DataLoader) -> Any:
    return cls(
        ds,
        batch_size=None,
        num_workers=workers,
        multiprocessing_context="fork" if workers else None,
    )


def torch_uids(batches: Any, steps: int) -> list[list[int]]:
    return [[int(u) for u in b["uid"]] for _, b in zip(range(steps), batches, strict=False)]


@pytest.mark.parametrize("workers", [0, 2])
def test_torch_dataloader_workers_yield_the_mixtures_batches_in_order(
    uris: dict[str, str], tmp_path: Path, workers: int
) -> None:
    want = expected(uris, tmp_path, "sample")
    ds = shardcache.torch.IterableDataset(
        batch_size=BATCH,
        columns=["uid"],
        mixture=uris,
        weights=WEIGHTS,
        mix_seed=MIX_SEED,
        **open_options(tmp_path, "sample"),
    )
    assert torch_uids(loader(ds, workers), STEPS) == want
    ds.close()


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("stop", [1, 6])
def test_stateful_dataloader_resumes_a_mixture_at_the_exact_next_batch(
    uris: dict[str, str], tmp_path: Path, workers: int, stop: int
) -> None:
    want = expected(uris, tmp_path, "block")

    def make() -> shardcache.torch.IterableDataset:
        return shardcache.torch.IterableDataset(
            batch_size=BATCH,
            columns=["uid"],
            mixture=uris,
            weights=WEIGHTS,
            mix_seed=MIX_SEED,
            **open_options(tmp_path, "block"),
        )

    first = loader(make(), workers, StatefulDataLoader)
    head = torch_uids(first, stop)
    state = first.state_dict()
    json.dumps(state)
    resumed = loader(make(), workers, StatefulDataLoader)
    resumed.load_state_dict(state)
    assert head + torch_uids(resumed, 20) == want[: stop + 20]


def torch_mixture(uris: dict[str, str], tmp_path: Path) -> shardcache.torch.IterableDataset:
    return shardcache.torch.IterableDataset(
        batch_size=BATCH,
        columns=["uid"],
        mixture=uris,
        weights=WEIGHTS,
        mix_seed=MIX_SEED,
        **open_options(tmp_path, "block"),
    )


def test_a_second_pass_of_persistent_workers_over_a_mixture_is_refused(
    uris: dict[str, str], tmp_path: Path
) -> None:
    """A persistent worker read batches ahead of what the loader yielded, so its next
    pass cannot go on at the loader's next batch: it used to go on after them (batches
    of the mixture skipped); now the pass says so and what to do instead."""
    want = expected(uris, tmp_path, "block")
    ds = torch_mixture(uris, tmp_path)
    persistent = torch.utils.data.DataLoader(
        ds, batch_size=None, num_workers=2, persistent_workers=True,
        multiprocessing_context="fork",
    )  # fmt: skip
    assert torch_uids(persistent, 5) == want[:5]
    with pytest.raises(errors.InputError, match="a new pass of a loader with persistent_workers"):
        torch_uids(persistent, 5)
    ds.close()


def test_stateful_dataloader_with_persistent_workers_goes_on_over_a_mixture_from_its_state(
    uris: dict[str, str], tmp_path: Path
) -> None:
    """What the refusal above advises: the loader's own state starts new workers at the
    exact next batch of the mixture."""
    want = expected(uris, tmp_path, "block")
    ds = torch_mixture(uris, tmp_path)
    stateful = StatefulDataLoader(
        ds, batch_size=None, num_workers=2, persistent_workers=True,
        multiprocessing_context="fork",
    )  # fmt: skip
    head = torch_uids(stateful, 5)
    stateful.load_state_dict(stateful.state_dict())
    assert head + torch_uids(stateful, 7) == want[:12]
    ds.close()


def test_a_mixture_opened_by_the_caller_is_refused_in_a_worker_process(
    uris: dict[str, str], tmp_path: Path
) -> None:
    mixed = open_mix(uris, tmp_path, "block")
    ds = shardcache.torch.IterableDataset(mixed, batch_size=BATCH, columns=["uid"])
    # In this process it reads the mixture as it is.
    assert torch_uids(loader(ds, 0), 3) == expected(uris, tmp_path, "block")[:3]
    with pytest.raises(Exception, match="copied into another process"):
        torch_uids(loader(ds, 1), 1)
    with pytest.raises(errors.InputError, match="pack: expected None with a mixture"):
        shardcache.torch.IterableDataset(mixed, batch_size=BATCH, pack=8)
    ds.close()


JAX_CHECK = """
import json, sys
import jax
import shardcache.jax

web, code, cache = sys.argv[1:4]
kw = {"cache_dir": cache, "block_size": 5, "seed": 1, "batch_size": 4, "columns": ["uid"]}
mix = {"mixture": {"web": web, "code": code}, "weights": {"web": 3, "code": 1}, "mix_seed": 3}
batches = shardcache.jax.Batches(**kw, **mix)
assert (batches.rank, batches.world_size) == (jax.process_index(), jax.process_count())
prefetcher = shardcache.jax.DevicePrefetcher(batches, depth=2)
it = iter(prefetcher)
head = [next(it)["uid"].tolist() for _ in range(5)]
again = shardcache.jax.Batches(**kw, **mix)
again.load_state_dict(prefetcher.state_dict())
rest = [b["uid"].tolist() for _, b in zip(range(10), again)]
print(json.dumps(head + rest))
"""


def test_jax_batches_of_a_mixture_resume_from_the_prefetchers_handed_state(
    uris: dict[str, str], tmp_path: Path
) -> None:
    want = expected(uris, tmp_path, "block")
    # In a process of its own: JAX starts threads, and the DataLoader tests here fork.
    out = subprocess.run(
        [sys.executable, "-c", JAX_CHECK, uris["web"], uris["code"], str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == want[:15]


def test_mapping_listeners_follow_every_source_of_a_mixture(
    uris: dict[str, str], tmp_path: Path
) -> None:
    """What the device prefetcher registers with the GPU: each source's mappings."""

    class Listener:
        def __init__(self) -> None:
            self.roots: list[object] = []

        def mapped(self, root: object) -> None:
            self.roots.append(root)

        def dropped(self, root: object) -> None:
            pass

    ds = shardcache.torch.IterableDataset(
        batch_size=BATCH,
        columns=["uid"],
        mixture=uris,
        weights=WEIGHTS,
        mix_seed=MIX_SEED,
        **open_options(tmp_path, "block"),
    )
    listener = Listener()
    ds.add_mapping_listener(listener)
    assert torch_uids(loader(ds, 0), STEPS) == expected(uris, tmp_path, "block")
    # Both sources' shards were mapped and told: 3 of web, 2 of code.
    assert len(listener.roots) == sum(len(rows) for rows in SHARDS.values())
    ds.remove_mapping_listener(listener)
    ds.close()


@pytest.mark.parametrize("plan", ["block", "sample"])
def test_the_device_prefetcher_yields_the_mixtures_batches_in_order(
    uris: dict[str, str], tmp_path: Path, plan: str
) -> None:
    """The prefetcher follows every source's mappings (not only one dataset's), so it
    reads a mixture; on the CPU its tensors are the plain path's."""
    ds = shardcache.torch.IterableDataset(
        batch_size=BATCH,
        columns=["uid"],
        mixture=uris,
        weights=WEIGHTS,
        mix_seed=MIX_SEED,
        **open_options(tmp_path, plan),
    )
    prefetcher = shardcache.torch.DevicePrefetcher(ds, device="cpu")
    assert torch_uids(prefetcher, STEPS) == expected(uris, tmp_path, plan)
    prefetcher.close()
    ds.close()
