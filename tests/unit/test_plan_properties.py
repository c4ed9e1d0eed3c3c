"""The reading plan's rules, as properties over random datasets and parameters.

docs/reading-plan.md states them: every row once per epoch across the ranks, rank sizes
within one row of each other, the ranks' ranges one contiguous cut of the global order,
and resuming at any position yields exactly the rest. Hypothesis draws shard sizes
(zeros included), more ranks than rows, any epoch, seed, block size and world size.
"""

from __future__ import annotations

import hypothesis
import hypothesis.strategies as st
import pytest

from shardcache import plans

pytestmark = pytest.mark.unit

# Bounded so `make test` stays fast; no deadline: a loaded CI machine is slow, not wrong.
BOUNDED = hypothesis.settings(max_examples=150, deadline=None)

shard_rows = st.lists(st.integers(min_value=0, max_value=60), min_size=0, max_size=12)
digests = st.sampled_from(["sha256:" + "0" * 64, "sha256:" + "ab" * 32, "d"])


@st.composite
def plan_inputs(draw: st.DrawFn) -> tuple[list[int], str, plans.PlanParams]:
    rows = draw(shard_rows)
    params = plans.PlanParams(
        seed=draw(st.integers(min_value=0, max_value=2**63)),
        epoch=draw(st.integers(min_value=0, max_value=10_000)),
        # Up to far more ranks than rows: some ranks read nothing.
        world_size=draw(st.integers(min_value=1, max_value=40)),
        shuffle=draw(st.booleans()),
        block_size=draw(st.integers(min_value=1, max_value=25)),
    )
    return rows, draw(digests), params


def rows_of(runs: list[plans.Run]) -> list[tuple[int, int]]:
    return [(r.shard, i) for r in runs for i in range(r.start, r.stop)]


def all_ranks(rows: list[int], digest: str, params: plans.PlanParams) -> list[list[plans.Run]]:
    return [
        plans.rank_runs(rows, digest, plans.PlanParams(**{**vars(params), "rank": rank}))
        for rank in range(params.world_size)
    ]


@BOUNDED
@hypothesis.given(plan_inputs())
def test_every_row_is_read_exactly_once_and_rank_sizes_are_within_one(
    case: tuple[list[int], str, plans.PlanParams],
) -> None:
    rows, digest, params = case
    per_rank = [rows_of(runs) for runs in all_ranks(rows, digest, params)]
    seen = [row for rank in per_rank for row in rank]
    assert sorted(seen) == [(s, i) for s, n in enumerate(rows) for i in range(n)]
    sizes = [len(rank) for rank in per_rank]
    assert max(sizes) - min(sizes) <= 1


@BOUNDED
@hypothesis.given(plan_inputs())
def test_the_ranks_in_order_are_one_cut_of_the_global_order(
    case: tuple[list[int], str, plans.PlanParams],
) -> None:
    rows, digest, params = case
    concatenated = [row for runs in all_ranks(rows, digest, params) for row in rows_of(runs)]
    assert concatenated == rows_of(plans.global_runs(rows, digest, params))


@BOUNDED
@hypothesis.given(plan_inputs())
def test_the_plan_is_a_pure_function_of_its_inputs(
    case: tuple[list[int], str, plans.PlanParams],
) -> None:
    rows, digest, params = case
    assert plans.global_runs(rows, digest, params) == plans.global_runs(list(rows), digest, params)


@BOUNDED
@hypothesis.given(plan_inputs(), st.data())
def test_resuming_at_any_position_yields_exactly_the_rest(
    case: tuple[list[int], str, plans.PlanParams], data: st.DataObject
) -> None:
    rows, digest, params = case
    rank = data.draw(st.integers(min_value=0, max_value=params.world_size - 1))
    runs = plans.rank_runs(rows, digest, plans.PlanParams(**{**vars(params), "rank": rank}))
    whole = rows_of(runs)
    position = data.draw(st.integers(min_value=0, max_value=len(whole)))
    assert rows_of(list(plans.skip(runs, position))) == whole[position:]
    count = data.draw(st.integers(min_value=1, max_value=5))
    upcoming = plans.upcoming_shards(runs, position)
    assert plans.next_shards(runs, plans.run_ends(runs), position, count) == upcoming[:count]


@BOUNDED
@hypothesis.given(shard_rows, st.data())
def test_locate_inverts_global_index(rows: list[int], data: st.DataObject) -> None:
    hypothesis.assume(sum(rows) > 0)
    offsets = plans.shard_offsets(rows)
    index = data.draw(st.integers(min_value=0, max_value=sum(rows) - 1))
    shard, row = plans.locate(offsets, index)
    assert 0 <= row < rows[shard]
    assert plans.global_index(offsets, shard, row) == index
