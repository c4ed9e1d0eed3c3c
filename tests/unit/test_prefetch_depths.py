"""The prefetch-depth controller: grows on stalls with room, holds when memory is short,
shrinks back when the stall clears, stays in its bounds, and does not oscillate."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from shardcache_sidecar import prefetch_depths

MiB = 1 << 20
POLICY = prefetch_depths.Policy(floor=2, ceiling=16, patience=2, calm=3)
STALLED = prefetch_depths.Signal(stall_fraction=0.9, misses=3, waited_seconds=1.5)
CLEAR = prefetch_depths.Signal(stall_fraction=0.01, misses=0)
PLENTY = prefetch_depths.Room(free_bytes=1024 * MiB, shard_bytes=10 * MiB)
NONE_FREE = prefetch_depths.Room(free_bytes=0, shard_bytes=10 * MiB)


def run(
    state: prefetch_depths.State,
    signals: list[prefetch_depths.Signal],
    space: prefetch_depths.Room = PLENTY,
) -> list[prefetch_depths.Decision]:
    decisions = []
    for signal in signals:
        decision = prefetch_depths.decide(POLICY, state, signal, space)
        decisions.append(decision)
        state = decision.state
    return decisions


def test_a_reader_stalled_on_cold_shards_grows_by_half_after_the_patience_with_room() -> None:
    first, second = run(prefetch_depths.start(POLICY), [STALLED, STALLED])
    assert first == prefetch_depths.Decision(prefetch_depths.State(depth=2, stalled=1))
    assert second == prefetch_depths.Decision(
        prefetch_depths.State(depth=3), prefetch_depths.Reason.STALLED
    )
    # Half again each time: 3 -> 4 -> 6 -> 9, with the streak starting over each time.
    depths = [d.state.depth for d in run(second.state, [STALLED] * 6)]
    assert depths == [3, 4, 4, 6, 6, 9]


def test_a_stall_without_waiting_acquires_does_not_grow() -> None:
    # The loop waits, but every shard was resident: its stall is elsewhere (collation,
    # a slow worker), and a deeper read-ahead would not help it.
    busy = prefetch_depths.Signal(stall_fraction=0.95, misses=0, waited_seconds=0.0)
    decisions = run(prefetch_depths.start(POLICY), [busy] * 10)
    assert {d.state.depth for d in decisions} == {2}
    assert all(d.reason is None for d in decisions)


def test_memory_short_holds_the_depth_while_stalled() -> None:
    decisions = run(prefetch_depths.State(depth=4), [STALLED] * 5, NONE_FREE)
    assert [d.state.depth for d in decisions] == [4] * 5
    assert all(d.reason is None for d in decisions)


def test_growth_takes_only_the_shards_that_fit() -> None:
    # Room for one more 10 MiB shard (and a bit): 4 -> 5, not 4 -> 6.
    space = prefetch_depths.Room(free_bytes=15 * MiB, shard_bytes=10 * MiB)
    decisions = run(prefetch_depths.State(depth=4), [STALLED, STALLED], space)
    assert decisions[-1] == prefetch_depths.Decision(
        prefetch_depths.State(depth=5), prefetch_depths.Reason.STALLED
    )


def test_room_that_shrank_under_the_depth_shrinks_it_at_once_but_not_below_the_floor() -> None:
    over = prefetch_depths.Room(free_bytes=-25 * MiB, shard_bytes=10 * MiB)  # three shards too many
    decision = prefetch_depths.decide(POLICY, prefetch_depths.State(depth=9), CLEAR, over)
    assert decision == prefetch_depths.Decision(
        prefetch_depths.State(depth=6), prefetch_depths.Reason.MEMORY
    )
    deep_under = prefetch_depths.Room(free_bytes=-500 * MiB, shard_bytes=10 * MiB)
    assert prefetch_depths.decide(
        POLICY, prefetch_depths.State(depth=9), STALLED, deep_under
    ) == prefetch_depths.Decision(prefetch_depths.State(depth=2), prefetch_depths.Reason.MEMORY)
    # At the floor already: nothing to give back, nothing logged.
    held = prefetch_depths.decide(POLICY, prefetch_depths.State(depth=2), STALLED, deep_under)
    assert (held.state.depth, held.reason) == (2, None)


def test_a_cleared_stall_shrinks_one_shard_per_calm_period_back_to_the_floor() -> None:
    decisions = run(prefetch_depths.State(depth=4), [CLEAR] * 12)
    assert [d.state.depth for d in decisions] == [4, 4, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2]
    assert [d.reason for d in decisions if d.reason] == [prefetch_depths.Reason.RECOVERED] * 2


def test_the_hysteresis_band_holds_the_depth_and_restarts_both_streaks() -> None:
    between = prefetch_depths.Signal(stall_fraction=0.1, misses=1)
    # Stalled, then in the band, then stalled again: the band reset the streak, so no
    # growth after two stalled reports that were not in a row.
    decisions = run(prefetch_depths.State(depth=4), [STALLED, between, STALLED])
    assert [d.state.depth for d in decisions] == [4, 4, 4]
    # Calm, band, calm, calm: never three calm in a row, no shrink.
    decisions = run(prefetch_depths.State(depth=4), [CLEAR, between, CLEAR, CLEAR, between] * 4)
    assert {d.state.depth for d in decisions} == {4}


def test_alternating_stall_and_clear_does_not_oscillate() -> None:
    # A reader whose signal flips every report never meets either streak.
    decisions = run(prefetch_depths.State(depth=4), [STALLED, CLEAR] * 20)
    assert {d.state.depth for d in decisions} == {4}
    assert all(d.reason is None for d in decisions)


def test_the_ceiling_caps_growth_and_a_ceiling_below_the_floor_acts_as_the_floor() -> None:
    decisions = run(prefetch_depths.State(depth=12), [STALLED] * 10)
    assert max(d.state.depth for d in decisions) == 16
    assert decisions[-1].state.depth == 16
    low = prefetch_depths.Policy(floor=4, ceiling=1)
    assert (
        prefetch_depths.decide(low, prefetch_depths.State(depth=4), STALLED, PLENTY).state.depth
        == 4
    )
    assert (
        prefetch_depths.decide(
            low, prefetch_depths.State(depth=4, stalled=5), STALLED, PLENTY
        ).state.depth
        == 4
    )


def test_room_keeps_every_readers_window_and_the_reserved_shards() -> None:
    space = prefetch_depths.room(100 * MiB, depths=[4, 2], shard_bytes=10 * MiB, reserved_shards=2)
    # (4 + 1) + (2 + 1) + 2 = 10 shards kept: nothing free.
    assert space == prefetch_depths.Room(free_bytes=0, shard_bytes=10 * MiB)
    assert space.extra_shards() == 0
    assert (
        prefetch_depths.room(
            95 * MiB, depths=[4, 2], shard_bytes=10 * MiB, reserved_shards=2
        ).extra_shards()
        == -1
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"floor": 0, "ceiling": 4}, "floor must be >= 1"),
        ({"floor": 1, "ceiling": 4, "grow_above": 0.1, "shrink_below": 0.1}, "hysteresis"),
        ({"floor": 1, "ceiling": 4, "calm": 0}, "patience and calm"),
    ],
)
def test_a_policy_without_a_band_or_floor_is_refused(
    kwargs: dict[str, float], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        prefetch_depths.Policy(**kwargs)  # type: ignore[arg-type]


signals = st.builds(
    prefetch_depths.Signal,
    stall_fraction=st.floats(0.0, 1.0),
    misses=st.integers(0, 5),
    waited_seconds=st.floats(0.0, 10.0),
)
rooms = st.builds(
    prefetch_depths.Room,
    free_bytes=st.integers(-200 * MiB, 200 * MiB),
    shard_bytes=st.integers(1, 50 * MiB),
)


@settings(max_examples=300, deadline=None)
@given(
    floor=st.integers(1, 8),
    ceiling=st.integers(0, 32),
    steps=st.lists(st.tuples(signals, rooms), max_size=40),
)
def test_the_depth_never_leaves_its_bounds_and_only_changes_with_a_reason(
    floor: int, ceiling: int, steps: list[tuple[prefetch_depths.Signal, prefetch_depths.Room]]
) -> None:
    policy = prefetch_depths.Policy(floor=floor, ceiling=ceiling)
    state = prefetch_depths.start(policy)
    for signal, space in steps:
        decision = prefetch_depths.decide(policy, state, signal, space)
        new = decision.state.depth
        assert policy.floor <= new <= max(policy.floor, policy.ceiling)
        assert (decision.reason is None) == (new == state.depth)
        if decision.reason is prefetch_depths.Reason.STALLED:
            # Grown only into room there was.
            assert new - state.depth <= space.extra_shards()
        state = decision.state
