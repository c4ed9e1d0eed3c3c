"""Elastic resume (W ranks -> W' ranks), checked row by row against the plan.

For random datasets, world sizes and positions in an epoch, the new ranks read every
row no old rank consumed exactly once and no consumed row again; later epochs follow
the new world size exactly; resizes chain (4 -> 3 -> 5) and compose with skips.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence

import hypothesis
import hypothesis.strategies as st
import pytest

from shardcache import elastic, errors, plans, states, streams

pytestmark = pytest.mark.unit

BOUNDED = hypothesis.settings(max_examples=120, deadline=None)
DIGEST = "sha256:" + "ab" * 32


def rows_of(shard_rows: Sequence[int], params: plans.PlanParams) -> list[int]:
    """Dataset-wide indices `params.rank` reads in its epoch, in order."""
    offsets = plans.shard_offsets(shard_rows)
    return [
        offsets[r.shard] + i
        for r in plans.rank_runs(shard_rows, DIGEST, params)
        for i in range(r.start, r.stop)
    ]


def start_states(
    world: int, epoch: int, *, block_size: int, shuffle: bool
) -> list[states.DataState]:
    base = plans.PlanParams(
        seed=7, epoch=epoch, world_size=world, shuffle=shuffle, block_size=block_size
    )
    return [
        states.DataState(DIGEST, dataclasses.replace(base, rank=r), position=0, batch_size=4)
        for r in range(world)
    ]


def advance(
    shard_rows: Sequence[int], old: list[states.DataState], fractions: Sequence[float], skip: bool
) -> tuple[list[states.DataState], list[int]]:
    """Each rank moved a fraction into its stream (the first rank's last 3 positions
    skipped when `skip`), and the rows they consumed (read or skipped)."""
    total = sum(shard_rows)
    moved: list[states.DataState] = []
    consumed: list[int] = []
    for s, f in zip(old, fractions, strict=False):
        n = plans.rank_samples(total, s.params)
        pos = s.position + int((n - s.position) * f)
        rows = rows_of(shard_rows, s.params)
        consumed += rows[s.position : pos]
        skips = s.skips
        if skip and s.rank == 0 and pos - s.position >= 3:
            skips = states.normalise([*skips, states.Skip(s.epoch, pos - 3, pos)])
        moved.append(dataclasses.replace(s, position=pos, skips=skips))
    return moved, consumed


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[int], list[int], list[list[float]], bool, int, bool]:
    rows = draw(st.lists(st.integers(min_value=0, max_value=50), min_size=1, max_size=8))
    worlds = draw(st.lists(st.integers(min_value=1, max_value=9), min_size=2, max_size=4))
    fractions = [
        draw(st.lists(st.floats(min_value=0, max_value=1), min_size=w, max_size=w)) for w in worlds
    ]
    return (
        rows,
        worlds,
        fractions,
        draw(st.booleans()),
        draw(st.integers(1, 9)),
        draw(st.booleans()),
    )


def check_resize(
    shard_rows: Sequence[int],
    worlds: Sequence[int],
    fractions: Sequence[Sequence[float]],
    *,
    skip: bool = False,
    block_size: int = 4,
    shuffle: bool = True,
) -> None:
    total = sum(shard_rows)
    epoch = 2
    current = start_states(worlds[0], epoch, block_size=block_size, shuffle=shuffle)
    consumed: list[int] = []
    for world, frac in zip(worlds[1:], fractions, strict=False):
        current, read = advance(shard_rows, current, frac, skip)
        consumed += read
        current = elastic.resize(current, total_rows=total, world_size=world)
        assert [s.rank for s in current] == list(range(world))
        assert all(s.world_size == world and s.epoch == epoch for s in current)
        sizes = [plans.rank_samples(total, s.params) for s in current]
        assert max(sizes) - min(sizes) <= 1
    rest = [i for s in current for i in rows_of(shard_rows, s.params)]
    # No consumed row again, and every unconsumed row exactly once.
    assert len(consumed) == len(set(consumed))
    assert not set(rest) & set(consumed)
    assert Counter(rest) == Counter(set(range(total)) - set(consumed))
    # The next epoch is the new world size's plan, exactly.
    last = worlds[-1]
    for s in current:
        fresh = plans.PlanParams(
            seed=7, epoch=epoch + 1, rank=s.rank, world_size=last, shuffle=shuffle,
            block_size=block_size,
        )  # fmt: skip
        assert rows_of(shard_rows, s.params.with_epoch(epoch + 1)) == rows_of(shard_rows, fresh)


@pytest.mark.parametrize("worlds", [(4, 3), (2, 8), (8, 5), (4, 3, 5), (3, 3), (5, 1)])
@hypothesis.given(data=st.data())
@BOUNDED
def test_every_unconsumed_row_is_read_once_after_a_resize(
    worlds: tuple[int, ...], data: st.DataObject
) -> None:
    rows = data.draw(st.lists(st.integers(min_value=0, max_value=60), min_size=1, max_size=8))
    fractions = [
        data.draw(st.lists(st.floats(min_value=0, max_value=1), min_size=w, max_size=w))
        for w in worlds
    ]
    check_resize(
        rows, worlds, fractions, skip=data.draw(st.booleans()),
        block_size=data.draw(st.integers(1, 9)), shuffle=data.draw(st.booleans()),
    )  # fmt: skip


@hypothesis.given(scenarios())
@BOUNDED
def test_chains_of_resizes_keep_every_row_exactly_once(
    scenario: tuple[list[int], list[int], list[list[float]], bool, int, bool],
) -> None:
    rows, worlds, fractions, skip, block_size, shuffle = scenario
    check_resize(rows, worlds, fractions, skip=skip, block_size=block_size, shuffle=shuffle)


def test_the_remainder_is_cut_in_global_order_into_near_equal_parts() -> None:
    # 4 ranks of 10 rows (no shuffle: global order is 0..39); rank 1 read 10 of 10.
    old = start_states(4, 0, block_size=4, shuffle=False)
    old = [dataclasses.replace(s, position=p) for s, p in zip(old, [3, 10, 0, 8], strict=True)]
    new = elastic.resize(old, total_rows=40, world_size=3)
    # Left: [3, 10), [20, 30), [38, 40): 19 rows, cut 6 / 6 / 7; the smallest part (6)
    # is where drop_last ends every new rank's batches.
    assert [s.params.segments for s in new] == [
        streams.Segments(0, ((3, 9),), 6),
        streams.Segments(0, ((9, 10), (20, 25)), 6),
        streams.Segments(0, ((25, 30), (38, 40)), 6),
    ]
    assert [s.position for s in new] == [0, 0, 0]


def with_rank(s: states.DataState, rank: int) -> states.DataState:
    return dataclasses.replace(s, params=dataclasses.replace(s.params, rank=rank))


def with_plan(s: states.DataState, **changes: object) -> states.DataState:
    return dataclasses.replace(s, params=dataclasses.replace(s.params, **changes))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda ss: ss[:2], r"missing \[2\]"),
        (lambda ss: [ss[0], ss[1], with_rank(ss[2], 1)], r"duplicated \[1\]"),
        (
            lambda ss: [*ss[:2], dataclasses.replace(ss[2], params=ss[2].params.with_epoch(4))],
            "epoch: 0 vs 4",
        ),
        (lambda ss: [*ss[:2], dataclasses.replace(ss[2], digest="sha256:x")], "digest"),
        (
            lambda ss: [
                *ss[:2],
                dataclasses.replace(ss[2], params=dataclasses.replace(ss[2].params, seed=8)),
            ],
            "seed: 7 vs 8",
        ),
        (lambda ss: [*ss[:2], dataclasses.replace(ss[2], plan_version=9)], "plan_version"),
        (lambda ss: [*ss[:2], with_plan(ss[2], granularity="sample")], "granularity: 'block' vs"),
        (
            lambda ss: [with_plan(s, granularity="sample", window=8 if s.rank else 9) for s in ss],
            "window: 9 vs 8",
        ),
        (lambda ss: [], "no state given"),
    ],
)
def test_states_that_are_not_one_run_at_one_point_are_refused(
    change: Callable[[list[states.DataState]], list[states.DataState]], message: str
) -> None:
    old = start_states(3, 0, block_size=4, shuffle=True)
    with pytest.raises(errors.StateMismatchError, match=message):
        elastic.resize(change(old), total_rows=30, world_size=2)


def test_ranks_of_block_mode_may_differ_in_the_window_which_only_sample_mode_reads() -> None:
    old = [with_plan(s, window=8 + s.rank) for s in start_states(3, 0, block_size=4, shuffle=True)]
    new = elastic.resize(old, total_rows=30, world_size=2)
    assert sum(streams.length(s.params.segments.ranges) for s in new if s.params.segments) == 30


def test_a_position_past_the_end_of_an_old_rank_is_refused() -> None:
    old = start_states(2, 0, block_size=4, shuffle=True)
    old[1] = dataclasses.replace(old[1], position=16)
    with pytest.raises(errors.StateMismatchError, match="past the end"):
        elastic.resize(old, total_rows=30, world_size=3)


def with_segments(s: states.DataState, *ranges: streams.Range, least: int) -> states.DataState:
    return with_plan(s, segments=streams.Segments(s.epoch, tuple(ranges), least))


@pytest.mark.parametrize(
    "change,message",
    [
        # Rank 0's state after a 2 -> 3 resize, ranks 1 and 2 from the run before it
        # (rank 1 read [10, 13) of its [10, 20), which rank 0's segments hold too).
        (
            lambda ss: [
                with_segments(ss[0], (3, 12), least=9),
                dataclasses.replace(ss[1], position=3),
                ss[2],
            ],
            r"ranks \[0\] read epoch 0 in the segments an elastic resume gave them, ranks "
            r"\[1, 2\] read the epoch's plain rule-5 ranges",
        ),
        # States of two resizes: their smallest parts differ.
        (
            lambda ss: [
                with_segments(ss[0], (0, 5), least=5),
                with_segments(ss[1], (5, 10), least=5),
                with_segments(ss[2], (10, 16), least=6),
            ],
            r"come from different elastic resumes \(the smallest part, by rank: "
            r"\{0: 5, 1: 5, 2: 6\}",
        ),
        # ...or they agree on it and two ranks read the same rows.
        (
            lambda ss: [
                with_segments(ss[0], (0, 5), least=5),
                dataclasses.replace(with_segments(ss[1], (4, 9), least=5), position=1),
                with_segments(ss[2], (10, 15), least=5),
            ],
            r"ranks 0 and 1 both read positions \[4, 5\) of epoch 0",
        ),
    ],
)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_states_of_ranks_from_before_and_after_a_resize_are_refused(
    change: Callable[[list[states.DataState]], list[states.DataState]], message: str, world: int
) -> None:
    """Every key of the plan agrees, but the ranks' streams overlap and leave rows to no
    one: a resize (or, at the same world size, each rank's own state) read some rows
    twice and others never, without a word (where what the ranks left did not overlap
    too). Refused at every world size, naming the ranks."""
    old = change(start_states(3, 0, block_size=4, shuffle=True))
    with pytest.raises(errors.StateMismatchError, match=message):
        elastic.resize(old, total_rows=30, world_size=world)


def test_segments_of_an_earlier_epoch_do_not_make_states_of_two_runs() -> None:
    """A resize's segments stay in its ranks' states in later epochs; there they are
    history, and a later epoch's states resize as any others."""
    old = start_states(3, 1, block_size=4, shuffle=True)
    old = [with_plan(old[0], segments=streams.Segments(0, ((3, 12),), 9)), *old[1:]]
    new = elastic.resize(old, total_rows=30, world_size=2)
    assert [s.params.segments for s in new] == [
        streams.Segments(1, ((0, 15),), 15),
        streams.Segments(1, ((15, 30),), 15),
    ]
