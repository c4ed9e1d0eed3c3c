"""Plan version 2's sample mode: windows of the block-level sequence, permuted.

docs/reading-plan.md ("Plan version 2") states the rules; these check them as
properties over random datasets (bounded), and against the examples the issue gave.
"""

from __future__ import annotations

import dataclasses
import itertools

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from shardcache import errors, plans, sequences, streams, windows

pytestmark = pytest.mark.unit

BOUNDED = hypothesis.settings(max_examples=120, deadline=None)

shard_rows = st.lists(st.integers(min_value=0, max_value=60), min_size=0, max_size=10)


@st.composite
def sample_plans(draw: st.DrawFn) -> tuple[list[int], plans.PlanParams]:
    rows = draw(shard_rows)
    params = plans.PlanParams(
        seed=draw(st.integers(min_value=0, max_value=2**63)),
        epoch=draw(st.integers(min_value=0, max_value=1000)),
        world_size=draw(st.integers(min_value=1, max_value=12)),
        shuffle=True,
        granularity="sample",
        block_size=draw(st.integers(min_value=1, max_value=25)),
        window=draw(st.integers(min_value=1, max_value=80)),
    )
    return rows, params


def rank_indices(rows: list[int], params: plans.PlanParams) -> list[list[int]]:
    seq = sequences.Sequence(rows, "d", params)
    out = []
    for rank in range(params.world_size):
        lo, hi = plans.rank_bounds(seq.total, plans.PlanParams(**{**params.__dict__, "rank": rank}))
        out.append(seq.indices(lo, hi).tolist())
    return out


def test_keys_are_the_specified_splitmix64_outputs() -> None:
    rng = plans._SplitMix64(12345)
    assert sequences.splitmix_keys(12345, 6).tolist() == [rng.next() for _ in range(6)]


@BOUNDED
@hypothesis.given(sample_plans())
def test_every_row_is_read_exactly_once_per_epoch_across_the_ranks(
    case: tuple[list[int], plans.PlanParams],
) -> None:
    rows, params = case
    parts = rank_indices(rows, params)
    flat = [i for part in parts for i in part]
    assert sorted(flat) == list(range(sum(rows)))
    sizes = [len(p) for p in parts]
    assert max(sizes, default=0) - min(sizes, default=0) <= 1


@BOUNDED
@hypothesis.given(sample_plans())
def test_a_row_never_leaves_its_window_of_the_block_level_sequence(
    case: tuple[list[int], plans.PlanParams],
) -> None:
    rows, params = case
    seq = sequences.Sequence(rows, "d", params)
    block = sequences.Sequence(
        rows, "d", plans.PlanParams(**{**params.__dict__, "granularity": "block"})
    )
    for k in range(-(-seq.total // params.window)):
        lo, hi = windows.window_span(seq.total, params.window, k)
        assert sorted(seq.indices(lo, hi).tolist()) == sorted(block.indices(lo, hi).tolist())
        got_shards = set(np.searchsorted(seq.offsets, seq.indices(lo, hi), side="right") - 1)
        assert got_shards == set(seq.window_shards(lo, hi))


@BOUNDED
@hypothesis.given(sample_plans(), st.data())
def test_any_range_of_the_sequence_is_the_same_rows_as_the_whole_epoch_cut_there(
    case: tuple[list[int], plans.PlanParams], data: st.DataObject
) -> None:
    # The abstraction a resume at another world size builds on: [a, b) of the sequence.
    rows, params = case
    seq = sequences.Sequence(rows, "d", params)
    whole = seq.indices(0, seq.total).tolist()
    a = data.draw(st.integers(min_value=0, max_value=seq.total))
    b = data.draw(st.integers(min_value=a, max_value=seq.total))
    assert seq.indices(a, b).tolist() == whole[a:b]


def test_block_mode_indices_are_the_version_1_runs() -> None:
    rows = [30, 0, 17, 64, 5]
    params = plans.PlanParams(seed=4, world_size=3, rank=1, block_size=8)
    seq = sequences.Sequence(rows, "d", params)
    offsets = plans.shard_offsets(rows)
    want = [
        offsets[r.shard] + i
        for r in plans.rank_runs(rows, "d", params)
        for i in range(r.start, r.stop)
    ]
    assert seq.indices(*plans.rank_bounds(seq.total, params)).tolist() == want


def test_a_single_shard_dataset_is_read_in_a_different_order_every_epoch_and_seed() -> None:
    # The example: 5,000 rows in one shard, two blocks: block mode can repeat.
    orders = set()
    for seed in (0, 1):
        for epoch in range(4):
            params = plans.PlanParams(seed=seed, epoch=epoch, granularity="sample", window=4096)
            orders.add(tuple(sequences.Sequence([5000], "d", params).indices(0, 5000).tolist()))
    assert len(orders) == 8


def test_sample_mode_mixes_rows_far_apart_and_from_several_shards() -> None:
    rows = [1000] * 8
    params = plans.PlanParams(seed=1, granularity="sample", window=4000, block_size=100)
    batch = sequences.Sequence(rows, "d", params).indices(0, 256)
    assert len(set((batch // 1000).tolist())) >= 3
    assert float(np.abs(np.diff(batch)).mean()) > 500


def test_manifest_order_ignores_the_granularity() -> None:
    params = plans.PlanParams(shuffle=False, granularity="sample")
    assert params.granularity == "block" and not params.sampled
    assert sequences.Sequence([3, 4], "d", params).indices(0, 7).tolist() == list(range(7))


def test_shuffle_modes_name_the_plans() -> None:
    assert plans.shuffle_mode(True) == (True, "block")
    assert plans.shuffle_mode("sample") == (True, "sample")
    assert plans.shuffle_mode(False) == (False, "block")
    with pytest.raises(errors.InputError, match='expected "sample", "block", True or False'):
        plans.shuffle_mode("rows")


def test_the_prefetcher_keeps_the_current_and_next_window_of_a_reader() -> None:
    rows = [100] * 10
    params = plans.PlanParams(seed=2, granularity="sample", window=250, block_size=50)
    wins = windows.rank_windows(rows, "d", params)
    ends = windows.window_ends(wins)
    assert ends == [250, 500, 750, 1000]
    seq = sequences.Sequence(rows, "d", params)
    for position in (0, 249, 250, 600):
        k = position // 250
        want = seq.window_shards(k * 250, min(1000, (k + 2) * 250))
        got = windows.next_shards(wins, ends, position, count=1)
        assert got == want
    assert windows.next_shards(wins, ends, 1000, count=4) == []


def test_out_of_range_indices_are_refused_naming_the_first() -> None:
    offsets = np.asarray([0, 10, 10], dtype=np.int64)
    shard, row = sequences.locate(offsets, 15, np.asarray([0, 9, 10, 14]))
    assert (shard.tolist(), row.tolist()) == ([0, 0, 2, 2], [0, 9, 0, 4])
    with pytest.raises(
        errors.InputError, match="sample index 15 is out of range: the dataset has 15"
    ):
        sequences.locate(offsets, 15, np.asarray([3, 15, -1]))


@st.composite
def segmented_plans(draw: st.DrawFn) -> tuple[list[int], plans.PlanParams]:
    """A sample-mode plan whose rank reads, in its epoch, segments as an elastic resume
    leaves them: disjoint ranges of the global sequence in increasing order."""
    rows, params = draw(sample_plans())
    total = sum(rows)
    hypothesis.assume(total > 0)
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=2, max_size=8, unique=True)))
    ranges = tuple(itertools.pairwise(cuts))[::2]
    seg = streams.Segments(params.epoch, ranges)
    return rows, dataclasses.replace(params, rank=0, segments=seg)


@BOUNDED
@hypothesis.given(segmented_plans(), st.data())
def test_a_segmented_stream_reads_its_segments_in_order_from_any_position(
    case: tuple[list[int], plans.PlanParams], data: st.DataObject
) -> None:
    rows, params = case
    seq = sequences.Sequence(rows, "d", params)
    ranges = plans.stream_ranges(seq.total, params)
    whole = [i for a, b in ranges for i in seq.indices(a, b).tolist()]
    p = data.draw(st.integers(0, len(whole)))
    q = data.draw(st.integers(p, len(whole)))
    assert seq.stream_indices(ranges, p, q).tolist() == whole[p:q]
    touched = np.searchsorted(seq.offsets, seq.stream_indices(ranges, p, q), side="right") - 1
    assert set(touched.tolist()) <= set(seq.stream_window_shards(ranges, p, q))


@BOUNDED
@hypothesis.given(segmented_plans())
def test_the_prefetcher_follows_the_segments_window_by_window(
    case: tuple[list[int], plans.PlanParams],
) -> None:
    # The sidecar's read-ahead for a resized sample-mode reader: the windows it meets
    # are those of its segments, ending where its stream leaves each one.
    rows, params = case
    seq = sequences.Sequence(rows, "d", params)
    ranges = plans.stream_ranges(seq.total, params)
    wins = windows.rank_windows(rows, "d", params)
    ends = windows.window_ends(wins)
    assert ends == sorted(set(ends)) and ends[-1] == streams.length(ranges)
    start = 0
    for win in wins:
        read = seq.stream_indices(ranges, start, win.end)
        touched = np.searchsorted(seq.offsets, read, side="right") - 1
        assert set(touched.tolist()) <= set(win.shards)
        assert windows.next_shards(wins, ends, start, count=1)[: len(win.shards)] == list(
            win.shards
        )
        start = win.end
