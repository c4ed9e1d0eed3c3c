"""The tools' view of a plan (`shardcache.placements`, used by `shardcache inspect`,
`lineage`, `diff` and the web inspector) agrees with the plan the dataset reads, in
block and sample mode, with and without elastic-resume segments."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from shardcache import manifests, placements, plans, sequences, streams
from shardcache.inspect import locate
from shardcache.lineage import diff
from tests.support import sightings

pytestmark = pytest.mark.unit

BOUNDED = hypothesis.settings(max_examples=80, deadline=None)
ROWS = [100, 0, 37, 250, 8, 64, 1]
DIGEST = "sha256:test"


@st.composite
def any_plans(draw: st.DrawFn) -> tuple[list[int], plans.PlanParams]:
    rows = draw(st.lists(st.integers(0, 60), min_size=1, max_size=8))
    world = draw(st.integers(1, 6))
    params = plans.PlanParams(
        seed=draw(st.integers(0, 2**40)),
        epoch=draw(st.integers(0, 50)),
        world_size=world,
        rank=draw(st.integers(0, world - 1)),
        shuffle=draw(st.booleans()),
        granularity=draw(st.sampled_from(plans.GRANULARITIES)),
        block_size=draw(st.integers(1, 20)),
        window=draw(st.integers(1, 70)),
    )
    if draw(st.booleans()) and sum(rows) > 1:
        # Segments as an elastic resume leaves them: disjoint, increasing ranges.
        cuts = sorted(draw(st.lists(st.integers(0, sum(rows)), min_size=2, unique=True)))
        ranges = tuple(zip(cuts[::2], cuts[1::2], strict=False))
        params = dataclasses.replace(params, segments=streams.Segments(params.epoch, ranges))
    return rows, params


def truth(rows: list[int], params: plans.PlanParams) -> list[int]:
    """The rank's epoch as manifest indices, from the plan's own sequence."""
    seq = sequences.Sequence(rows, "d", params)
    return [
        i for a, b in plans.stream_ranges(seq.total, params) for i in seq.indices(a, b).tolist()
    ]


@BOUNDED
@hypothesis.given(any_plans())
def test_rank_runs_are_the_rows_the_rank_reads_in_every_mode(
    case: tuple[list[int], plans.PlanParams],
) -> None:
    rows, params = case
    offsets = plans.shard_offsets(rows)
    runs = placements.rank_runs(rows, "d", params)
    assert [offsets[r.shard] + i for r in runs for i in range(r.start, r.stop)] == truth(
        rows, params
    )
    assert all(0 <= r.start < r.stop <= rows[r.shard] for r in runs)


@BOUNDED
@hypothesis.given(any_plans(), st.data())
def test_index_ranges_are_the_rows_at_any_positions_of_the_stream(
    case: tuple[list[int], plans.PlanParams], data: st.DataObject
) -> None:
    rows, params = case
    whole = truth(rows, params)
    start = data.draw(st.integers(0, len(whole)))
    stop = data.draw(st.integers(start, len(whole)))
    got = placements.index_ranges(rows, "d", params, start, stop)
    assert [i for lo, hi in got for i in range(lo, hi)] == whole[start:stop]
    assert all(b[0] != a[1] for a, b in itertools.pairwise(got)), "adjacent ranges merged"


@BOUNDED
@hypothesis.given(any_plans())
def test_a_samples_global_position_is_where_the_sequence_holds_it(
    case: tuple[list[int], plans.PlanParams],
) -> None:
    rows, params = case
    whole = sequences.Sequence(rows, "d", params).indices(0, sum(rows))
    found = placements.global_positions(rows, "d", params, range(sum(rows)))
    assert sorted(i for i, _ in found) == list(range(sum(rows)))
    assert all(int(whole[pos]) == index for index, pos in found)


def sample_query(**kwargs: Any) -> locate.Query:
    return locate.Query(seed=9, block_size=16, granularity="sample", window=70, **kwargs)


@pytest.mark.parametrize(("world_size", "rank"), [(1, 0), (3, 2), (4, 1)])
@pytest.mark.parametrize("batch_size", [1, 33])
def test_inspect_steps_of_a_sample_mode_run_are_its_gathered_batches(
    world_size: int, rank: int, batch_size: int
) -> None:
    q = sample_query(epoch=1, rank=rank, world_size=world_size, batch_size=batch_size)
    params = q.params()
    seq = sequences.Sequence(ROWS, DIGEST, params)
    expected = seq.indices(*plans.rank_bounds(seq.total, params)).tolist()
    got = [
        [p.index for p in locate.step_rows(ROWS, DIGEST, q.replace(step=s))]
        for s in range(locate.step_count(ROWS, q))
    ]
    assert [i for batch in got for i in batch] == expected
    # Not the block plan's rows: the tools used to name those.
    block = locate.step_rows(ROWS, DIGEST, q.replace(granularity="block"))
    assert [p.index for p in block] != got[0]


def test_inspect_finds_every_sample_of_a_sample_mode_run_at_its_step_and_slot() -> None:
    q = sample_query(epoch=2, world_size=3, batch_size=7)
    sightings.assert_sighted_where_their_steps_hold_them(ROWS, DIGEST, q)


def run_plan(**changes: object) -> diff.RunPlan:
    shards = tuple(
        manifests.ShardEntry(f"part-{i}.parquet", 100 + n, "etag:x", n, "f", "v1")
        for i, n in enumerate(ROWS)
    )
    params = plans.PlanParams(seed=1, world_size=3, block_size=16, granularity="sample", window=50)
    return diff.RunPlan(
        manifests.Manifest.build("file:///data", "parquet", shards),
        dataclasses.replace(params, **changes),  # type: ignore[arg-type]
        8,
    )


def test_diff_compares_sample_mode_runs_row_by_row_and_names_the_mode_or_window() -> None:
    assert diff.first_difference(run_plan(), run_plan(), [0, 1]) is None
    # A window changes nothing in block mode, and everything in sample mode.
    assert (
        diff.first_difference(
            run_plan(granularity="block"), run_plan(granularity="block", window=7), [0]
        )
        is None
    )
    mode = diff.first_difference(run_plan(), run_plan(granularity="block"), [0])
    assert mode is not None and "another shuffle: sample vs block" in mode.reasons
    assert (mode.epoch, mode.step) == (0, 0)
    window = diff.first_difference(run_plan(), run_plan(window=60), [0])
    assert window is not None and "another window: 50 vs 60" in window.reasons
    # The rows it reports are the gathered batch's.
    seq = sequences.Sequence(ROWS, run_plan().manifest.digest, run_plan().params)
    offsets = np.asarray(plans.shard_offsets(ROWS))
    first = seq.indices(0, 8)
    shard = np.searchsorted(offsets, first, side="right") - 1
    want = tuple(
        (f"part-{s}.parquet", int(i - offsets[s])) for s, i in zip(shard, first, strict=True)
    )
    assert window.rank == 0 and window.a == want
