"""`drop_last=True` gives every rank of an epoch the same number of batches (rank sizes
differ by one row under rule 5 and after an elastic resize; a rank with one batch more
waited in a collective its peers never joined: a DDP job hung at the epoch's end).
Regression tests of the s19 explorer's D0 (`shardcache.even_batches`)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import shardcache
from shardcache import batching, errors, even_batches, plans, streams
from tests.support import datasets

pytestmark = pytest.mark.unit

MODES: list[bool | str] = [True, "sample", False]
Opener = Callable[..., shardcache.Dataset]


@pytest.fixture
def open_ds(tmp_path: Path) -> Iterator[Opener]:
    opened: list[shardcache.Dataset] = []
    uris: dict[tuple[int, ...], str] = {}

    def opener(shards: tuple[int, ...], **kw: Any) -> shardcache.Dataset:
        if shards not in uris:
            root = tmp_path / f"ds-{len(uris)}"
            uris[shards] = datasets.write_local(root, list(shards))[0]
        ds = shardcache.open(
            uris[shards], cache_dir=tmp_path / "cache", window=8, block_size=4, **kw
        )
        opened.append(ds)
        return ds

    yield opener
    for ds in opened:
        ds.close()


def uids(batches: Any) -> list[list[int]]:
    return [b.column("uid").to_pylist() for b in batches]


@pytest.mark.parametrize("shuffle", MODES)
def test_drop_last_gives_every_rank_the_same_number_of_batches(
    open_ds: Opener, shuffle: bool | str
) -> None:
    """The explorer's case (15 rows, W=2: ranks of 7 and 8, B=4) and a few more."""
    for shards, world, size in [((9, 6), 2, 4), ((13, 7, 9), 3, 3), ((5, 5, 1), 4, 2)]:
        counts, seen = [], []
        for rank in range(world):
            ds = open_ds(shards, rank=rank, world_size=world, shuffle=shuffle, gather_threads=0)
            got = uids(ds.batches(size, drop_last=True))
            counts.append(len(got))
            seen += [u for b in got for u in b]
            assert all(len(b) == size for b in got)
            # The trimmed rows count as consumed: the state says the epoch is done.
            assert ds.position == len(ds)
        least = sum(shards) // world
        assert counts == [least // size] * world, (shards, world, size)
        assert len(seen) == len(set(seen))


@pytest.mark.parametrize("shuffle", MODES)
@pytest.mark.parametrize("threads", [0, 2])
def test_a_state_after_the_last_batch_says_the_epoch_is_done(
    open_ds: Opener, shuffle: bool | str, threads: int
) -> None:
    """Taken right after the last batch (before the iterator says it is done), the state
    is at the epoch's end: a resume reads nothing of the epoch again, with or without
    drop_last."""
    shards = (9, 6)
    for rank in range(2):
        ds = open_ds(shards, rank=rank, world_size=2, shuffle=shuffle, gather_threads=threads)
        it = ds.batches(4, drop_last=True)
        assert len(uids([next(it)])) == 1
        state = ds.state_dict()
        assert state["position"] == len(ds)
        it.close()
        again = open_ds(shards, rank=rank, world_size=2, shuffle=shuffle, gather_threads=threads)
        again.load_state_dict(state)
        assert uids(again.batches(4)) == []


@pytest.mark.parametrize("shuffle", MODES)
def test_drop_last_counts_stay_equal_across_a_mid_epoch_resume(
    open_ds: Opener, shuffle: bool | str
) -> None:
    shards, world, size = (13, 7, 9), 2, 5  # ranks of 14 and 15 rows: 2 and 3 batches
    for stop in range(3):
        counts = []
        for rank in range(world):
            ds = open_ds(shards, rank=rank, world_size=world, shuffle=shuffle)
            head = list(itertools.islice(ds.batches(size, drop_last=True), stop))
            resumed = open_ds(shards, rank=rank, world_size=world, shuffle=shuffle)
            resumed.load_state_dict(ds.state_dict())
            counts.append(len(head) + len(list(resumed.batches(size, drop_last=True))))
        assert counts == [2, 2], stop


@pytest.mark.parametrize("shuffle", MODES)
def test_drop_last_counts_stay_equal_after_an_elastic_resize(
    open_ds: Opener, shuffle: bool | str
) -> None:
    """W=3 reads one batch, then W'=2 resumes; the new ranks' parts differ by one row
    (rule 8): each knows the smallest from its segments, also after its own state was
    saved mid-epoch and loaded again (at W')."""
    shards = (13, 7, 9)  # 29 rows: 9, 10, 10; one batch of 3 each leaves 20: not even
    old = []
    for rank in range(3):
        ds = open_ds(shards, rank=rank, world_size=3, shuffle=shuffle)
        next(ds.batches(3))
        old.append(ds.state_dict())
    for old_states in (old, [*old[:2], {**old[2], "position": 4}]):  # leaves 20, then 19
        counts, sizes, seen = [], [], []
        for rank in range(2):
            ds = open_ds(shards, rank=rank, world_size=2, shuffle=shuffle)
            ds.load_state_dict(old_states)
            sizes.append(len(ds))
            first = uids(itertools.islice(ds.batches(2, drop_last=True), 1))
            again = open_ds(shards, rank=rank, world_size=2, shuffle=shuffle)
            again.load_state_dict(ds.state_dict())  # the single state, same world size
            rest = uids(again.batches(2, drop_last=True))
            counts.append(len(first) + len(rest))
            seen += [u for b in first + rest for u in b]
            assert again.position == len(again)
            # Written as version 4: a shardcache that reads 3 would ignore `least`,
            # yield one batch more on the larger part and hang the others' collective.
            assert ds.state_dict()["version"] == again.state_dict()["version"] == 4
        assert counts == [min(sizes) // 2] * 2, (sizes, counts)
        assert len(seen) == len(set(seen))
    assert sizes[0] != sizes[1]  # the uneven split was exercised


@pytest.mark.parametrize("shuffle", MODES)
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_reader_worker_splits_give_every_rank_the_same_number_of_batches(
    open_ds: Opener, shuffle: bool | str, workers: int
) -> None:
    """What a DataLoader of `workers` processes yields per rank (batching.Reader)."""
    shards, world, size = (9, 6), 2, 2  # ranks of 7 and 8 rows: 3 and 4 batches
    options = batching.Options(batch_size=size, columns=("uid",), drop_last=True)
    counts = []
    for rank in range(world):
        total = 0
        for index in range(workers):
            ds = open_ds(shards, rank=rank, world_size=world, shuffle=shuffle)
            total += sum(1 for _ in batching.Reader(ds, options, batching.Split(index, workers)))
        counts.append(total)
    assert counts == [3, 3]


def test_segments_record_the_smallest_part_and_older_segments_still_load() -> None:
    seg = streams.Segments(0, ((0, 5), (9, 12)), 7)
    assert streams.Segments.from_json(seg.to_json()) == seg
    older = streams.Segments.from_json({"epoch": 0, "ranges": [[0, 5], [9, 12]]})
    assert older.least is None and "least" not in older.to_json()
    # A state resized before `least` was recorded: the rank's own rows stand in.
    params = plans.PlanParams(epoch=0, world_size=2, segments=older)
    assert even_batches.least_samples(100, params) == 8
    with pytest.raises(errors.InputError, match=r"least must be an int in \[0, 8\].*found 9"):
        streams.Segments(0, ((0, 5), (9, 12)), 9)
    with pytest.raises(errors.InputError, match="least must be an integer, found '7'"):
        streams.Segments.from_json({"epoch": 0, "ranges": [[0, 5]], "least": "7"})


def test_stop_ends_after_the_last_whole_batch_before_the_least() -> None:
    assert even_batches.stop(0, 4, 7) == 4
    assert even_batches.stop(1, 4, 9) == 9
    assert even_batches.stop(6, 4, 7) == 6
    assert even_batches.stop(8, 4, 7) == 8
    # Rule 5: floor(N/W), whatever the rank.
    assert {
        even_batches.least_samples(15, plans.PlanParams(rank=r, world_size=2)) for r in (0, 1)
    } == {7}
