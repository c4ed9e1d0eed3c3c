"""Elastic resume through real datasets: W ranks read part of an epoch and save their
states, W' ranks load the list and finish it. Checked row by row (the `uid` column is
the global sample index): every row no old rank consumed is read exactly once, no
consumed row again, and the next epoch is the new world size's plan. In block mode
and in sample mode (windows of WINDOW rows, which no batch size here divides, so the
old ranks stop mid-window), embedded and through a real sidecar."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import hypothesis
import hypothesis.strategies as st
import pyarrow.fs as pafs
import pytest

import shardcache
from shardcache import errors
from tests.support import datasets
from tests.support.sidecar import SidecarProcess

pytestmark = pytest.mark.integration

SHARDS = [70, 0, 33, 128, 9, 50]
TOTAL = sum(SHARDS)
BATCH, BLOCK, SEED, EPOCH = 8, 16, 5, 1
#: Sample-mode window: spans shards, and is no multiple of BATCH.
WINDOW = 37
MODES = ["block", "sample"]

Opener = Callable[[int, int], shardcache.Dataset]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("elastic")
    datasets.write_dataset(pafs.LocalFileSystem(), str(path / "ds"), SHARDS)
    return path


def embedded(root: Path, mode: str = "block") -> Opener:
    def open_rank(rank: int, world: int) -> shardcache.Dataset:
        return shardcache.open(
            str(root / "ds"), cache_dir=root / "c", rank=rank, world_size=world, seed=SEED,
            block_size=BLOCK, shuffle=mode, window=WINDOW,
        )  # fmt: skip

    return open_rank


def uids(batches: Iterator[Any]) -> list[int]:
    return [int(u) for b in batches for u in b.column("uid").to_pylist()]


def resize(
    open_rank: Opener, old_world: int, new_world: int, rng: random.Random, *, skip: bool
) -> tuple[list[int], list[int], list[dict[str, Any]]]:
    """Old ranks read a random number of batches (of 3 or BATCH rows) of epoch EPOCH
    (rank 0 also skips one batch when `skip`) and save; new ranks load every state, in
    a shuffled order, and read the rest of the epoch. Returns (consumed rows, rows read after, new states at
    the end of the epoch)."""
    saved: list[dict[str, Any]] = []
    consumed: list[int] = []
    for rank in range(old_world):
        with open_rank(rank, old_world) as ds:
            ds.set_epoch(EPOCH)
            # Old ranks stop anywhere: mid-batch of the new ranks' batch size, and
            # (sample mode) mid-window.
            size = rng.choice([3, BATCH])
            n = rng.randint(0, len(ds) // size + 1)
            it = ds.batches(size)
            consumed += uids(b for _, b in zip(range(n), it, strict=False))
            if skip and rank == 0:
                before = ds.position
                ds.skip_batches(1, batch_size=BATCH)
                consumed += rows_at(open_rank, rank, old_world, before, ds.position)
            it.close()
            saved.append(ds.state_dict())
    rng.shuffle(saved)
    after: list[int] = []
    ends: list[dict[str, Any]] = []
    for rank in range(new_world):
        with open_rank(rank, new_world) as ds:
            ds.load_state_dict(saved)
            ds.set_epoch(EPOCH)
            after += uids(ds.batches(BATCH))
            ends.append(ds.state_dict())
    return consumed, after, ends


def rows_at(open_rank: Opener, rank: int, world: int, lo: int, hi: int) -> list[int]:
    """The rows at positions [lo, hi) of a fresh rank's stream in epoch EPOCH, read
    (not computed from the plan): what a skip of those positions passed over."""
    with open_rank(rank, world) as ds:
        ds.set_epoch(EPOCH)
        return uids(ds.batches(BATCH))[lo:hi]


def check(open_rank: Opener, old: int, new: int, rng: random.Random, *, skip: bool) -> None:
    consumed, after, ends = resize(open_rank, old, new, rng, skip=skip)
    assert len(consumed) == len(set(consumed))
    assert not set(after) & set(consumed)
    assert Counter(after) == Counter(set(range(TOTAL)) - set(consumed))
    # The next epoch follows the new world size exactly, from a resized state too.
    for rank in range(new):
        with open_rank(rank, new) as resumed, open_rank(rank, new) as fresh:
            resumed.load_state_dict(ends[rank])
            resumed.set_epoch(EPOCH + 1)
            fresh.set_epoch(EPOCH + 1)
            assert uids(resumed.batches(BATCH)) == uids(fresh.batches(BATCH))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("old", "new"), [(4, 3), (2, 8), (8, 5)])
@hypothesis.given(seed=st.integers(0, 2**32), skip=st.booleans())
@hypothesis.settings(
    max_examples=4,
    deadline=None,
    suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture],
)
def test_every_unconsumed_row_is_read_once_at_the_new_world_size(
    root: Path, mode: str, old: int, new: int, seed: int, skip: bool
) -> None:
    check(embedded(root, mode), old, new, random.Random(seed), skip=skip)


@pytest.mark.parametrize("mode", MODES)
def test_a_chain_of_resizes_in_one_epoch_reads_every_row_once(root: Path, mode: str) -> None:
    open_rank = embedded(root, mode)
    rng = random.Random(3)
    consumed: list[int] = []
    saved: list[dict[str, Any]] = []
    for rank in range(4):
        with open_rank(rank, 4) as ds:
            ds.set_epoch(EPOCH)
            consumed += uids(
                b for _, b in zip(range(rng.randint(0, 4)), ds.batches(BATCH), strict=False)
            )
            saved.append(ds.state_dict())
    for world in (3, 5):
        states_now: list[dict[str, Any]] = []
        for rank in range(world):
            with open_rank(rank, world) as ds:
                ds.load_state_dict(saved)
                consumed += uids(
                    b for _, b in zip(range(rng.randint(0, 3)), ds.batches(BATCH), strict=False)
                )
                states_now.append(ds.state_dict())
        saved = states_now
    after: list[int] = []
    for rank in range(2):
        with open_rank(rank, 2) as ds:
            ds.load_state_dict(saved)
            after += uids(ds.batches(BATCH))
    assert len(consumed) == len(set(consumed))
    assert Counter(after) == Counter(set(range(TOTAL)) - set(consumed))


def test_a_single_state_at_another_world_size_is_refused_with_what_to_do(root: Path) -> None:
    open_rank = embedded(root)
    with open_rank(0, 4) as ds:
        state = ds.state_dict()
    with open_rank(0, 3) as ds, pytest.raises(errors.StateMismatchError, match="list of every"):
        ds.load_state_dict(state)
    with open_rank(0, 3) as ds, pytest.raises(errors.StateMismatchError, match=r"missing \[3\]"):
        ds.load_state_dict([state, {**state, "rank": 1}, {**state, "rank": 2}])


@pytest.mark.parametrize("differ", ["granularity", "window"])
@pytest.mark.parametrize("new_world", [2, 3])
def test_a_list_of_ranks_that_read_other_plans_is_refused_at_any_world_size(
    root: Path, differ: str, new_world: int
) -> None:
    """Rank 0 saved by a sample-mode run, rank 1 by a block-mode run (or a sample-mode
    run with another window): their states are ranges of two different global
    sequences. A resize to 3 ranks used to take them and read some rows twice and others
    never; now every world size refuses the list, naming what differs."""
    plans = (
        [("sample", WINDOW), ("block", WINDOW)]
        if differ == "granularity"
        else [("sample", WINDOW), ("sample", WINDOW + 1)]
    )
    saved = []
    for rank, (mode, window) in enumerate(plans):
        with shardcache.open(
            str(root / "ds"), cache_dir=root / "c", rank=rank, world_size=2, seed=SEED,
            block_size=BLOCK, shuffle=mode, window=window,
        ) as ds:  # fmt: skip
            batches = ds.batches(BATCH)
            next(batches)
            batches.close()
            saved.append(ds.state_dict())
    for rank in range(new_world):
        with embedded(root, "sample")(rank, new_world) as ds:
            with pytest.raises(errors.StateMismatchError, match=f"{differ}: "):
                ds.load_state_dict(saved)
            assert ds.position == 0


@pytest.mark.parametrize("mode", MODES)
def test_resize_through_a_real_sidecar_reads_every_unconsumed_row_once(
    root: Path,
    mode: str,
    sidecar_factory: Callable[..., SidecarProcess],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    proc = sidecar_factory((root / "ds").as_uri())
    proc.start(wait="ready")
    for name, value in proc.client_env().items():
        monkeypatch.setenv(name, value)

    def open_rank(rank: int, world: int) -> shardcache.Dataset:
        return shardcache.open(
            rank=rank, world_size=world, seed=SEED, block_size=BLOCK, shuffle=mode, window=WINDOW
        )

    check(open_rank, 4, 3, random.Random(11), skip=True)
    check(open_rank, 2, 5, random.Random(12), skip=False)
