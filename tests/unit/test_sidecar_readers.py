"""The sidecar's reader registry and handover holds (pure bookkeeping)."""

from __future__ import annotations

import dataclasses

import pytest
from shardcache_sidecar import readers

from shardcache import plans, streams
from shardcache.contract import protocol

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_reregistering_an_id_is_the_same_reader_and_a_new_plan_replaces_it() -> None:
    registry: readers.Registry[str] = readers.Registry(clock=Clock())
    params = plans.PlanParams(seed=1, rank=0, world_size=2)
    assert registry.register("r", params, 0) is readers.Change.CREATED
    # After a sidecar restart the client registers again, at a later epoch/position.
    assert registry.register("r", params.with_epoch(3), 50) is readers.Change.UNCHANGED
    assert (
        registry.register("r", plans.PlanParams(seed=2, world_size=2), 0) is readers.Change.REPLACED
    )
    assert len(registry) == 1
    reader = registry.get("r")
    assert reader is not None and reader.params.seed == 2


def test_a_reader_resumed_elastically_is_a_new_plan_that_keeps_its_segments() -> None:
    registry: readers.Registry[str] = readers.Registry(clock=Clock())
    params = plans.PlanParams(seed=1, rank=0, world_size=2, epoch=1)
    registry.register("r", params, 0)
    seg = streams.Segments(1, ((3, 9), (20, 24)))
    resized = dataclasses.replace(params, segments=seg)
    assert registry.register("r", resized, 0) is readers.Change.REPLACED
    # The prefetcher's plan is the segments in their epoch, rule 5 after.
    moved = registry.move("r", epoch=2, position=0)
    assert moved is not None and moved.params.segments == seg
    assert plans.stream_ranges(40, moved.params.with_epoch(1)) == [(3, 9), (20, 24)]
    assert plans.stream_ranges(40, moved.params) == [(0, 20)]


def test_move_follows_epoch_and_position_of_known_readers_only() -> None:
    registry: readers.Registry[str] = readers.Registry(clock=Clock())
    registry.register("r", plans.PlanParams(), 0)
    moved = registry.move("r", epoch=2, position=77)
    assert moved is not None and (moved.params.epoch, moved.position) == (2, 77)
    assert registry.move("unknown", epoch=0, position=0) is None


def test_a_position_behind_the_last_applied_seq_leaves_the_reader_where_it_is() -> None:
    registry: readers.Registry[str] = readers.Registry(clock=Clock())
    params = plans.PlanParams()
    registry.register("r", params, 0, seq=0)
    registry.move("r", epoch=1, position=900, seq=3)
    # Built before the move above, arrived after it (notes on another connection).
    stale = registry.move("r", epoch=0, position=300, seq=2)
    assert stale is not None and (stale.params.epoch, stale.position, stale.seq) == (1, 900, 3)
    # So with a registration again of the same plan; one of another plan is applied.
    assert registry.register("r", params, 10, seq=1) is readers.Change.UNCHANGED
    reader = registry.get("r")
    assert reader is not None and (reader.params.epoch, reader.position) == (1, 900)
    registry.move("r", epoch=1, position=950, seq=4)
    assert (reader.params.epoch, reader.position) == (1, 950)
    other = plans.PlanParams(seed=5)
    assert registry.register("r", other, 20, seq=1) is readers.Change.REPLACED
    assert (reader.params, reader.position, reader.seq) == (other, 20, 1)


def test_positions_without_seq_are_applied_in_the_order_they_arrive() -> None:
    # An older client sends none: as before the feature, the last to arrive wins.
    registry: readers.Registry[str] = readers.Registry(clock=Clock())
    registry.register("r", plans.PlanParams(), 0)
    registry.move("r", epoch=1, position=900)
    moved = registry.move("r", epoch=0, position=300)
    assert moved is not None and (moved.params.epoch, moved.position) == (0, 300)
    registry.move("r", epoch=0, position=400, seq=7)
    moved = registry.move("r", epoch=0, position=5)
    assert moved is not None and moved.position == 5
    # A registration without one forgets the reader's: a lower seq applies after it.
    registry.register("r", plans.PlanParams(), 6)
    moved = registry.move("r", epoch=0, position=8, seq=1)
    assert moved is not None and moved.position == 8


def test_holds_expire_after_the_handoff_timeout_and_go_with_their_reader() -> None:
    clock = Clock()
    registry: readers.Registry[str] = readers.Registry(clock=clock)
    registry.register("a", plans.PlanParams(), 0)
    registry.register("b", plans.PlanParams(), 0)
    old = registry.hold("a", 0, "lease-a0")
    clock.now += 20
    young = registry.hold("a", 1, "lease-a1")
    other = registry.hold("b", 2, "lease-b2")
    assert len({old.lease_id, young.lease_id, other.lease_id}) == 3
    clock.now += 15
    assert [h.lease for h in registry.expired(30.0)] == ["lease-a0"]
    assert registry.drop(old.lease_id) is None  # already gone: drop is idempotent
    reader, holds = registry.unregister("a")
    assert reader is not None and [h.lease for h in holds] == ["lease-a1"]
    assert [h.lease for h in registry.holds()] == ["lease-b2"]
    dropped = registry.drop(other.lease_id)
    assert dropped is not None and dropped.lease == "lease-b2"
    assert registry.holds() == []


def test_the_next_expiry_is_the_oldest_holds_so_maintenance_sleeps_until_then() -> None:
    clock = Clock()
    registry: readers.Registry[str] = readers.Registry(clock=clock)
    registry.register("a", plans.PlanParams(), 0)
    # No hold: nothing can expire before a timeout from now.
    assert registry.next_expiry(30.0) == 130.0
    old = registry.hold("a", 0, "lease-a0")
    clock.now += 20
    registry.hold("a", 1, "lease-a1")
    assert registry.next_expiry(30.0) == 130.0
    # Woken then, the old one expires; the next is the younger one's.
    clock.now = 130.0
    assert [h.lease for h in registry.expired(30.0)] == ["lease-a0"]
    assert registry.next_expiry(30.0) == 150.0
    assert registry.drop(old.lease_id) is None


def test_only_readers_registered_with_a_lock_the_sidecar_saw_are_checked_for_life() -> None:
    registry: readers.Registry[str] = readers.Registry(clock=Clock())
    registry.register("old-client", plans.PlanParams(), 0)
    registry.register("locked", plans.PlanParams(), 0, locked=True)
    assert registry.locked() == ["locked"]
    # Registered again (after a sidecar restart) by a client that lost its lock file.
    registry.register("locked", plans.PlanParams(), 5, locked=False)
    assert registry.locked() == []


def stalls(wait: float, step: float, batches: int, recent: float) -> protocol.Stalls:
    return protocol.Stalls(
        wait_seconds=wait, step_seconds=step, batches=batches, recent_fraction=recent
    )


def test_a_reader_stuck_in_an_acquire_reads_as_stalled_though_its_last_report_was_clear() -> None:
    clock = Clock()
    registry: readers.Registry[str] = readers.Registry(clock=clock, wall=lambda: 1_700_000_000.0)
    registry.register("r", plans.PlanParams(), 0)
    reader = registry.get("r")
    assert reader is not None
    # 40 batches of 0.25 s steps, hardly a wait: a loop whose data keeps up.
    clear = stalls(0.2, 10.0, 40, 0.02)
    registry.report_stalls("r", clear)
    wait = registry.begin_wait("r", 7, 600.0)
    assert wait is not None and (wait.shard, wait.since_wall) == (7, 1_700_000_000.0)
    # A wait shorter than a report interval is in the next report: left as reported.
    clock.now += 0.5
    assert registry.stalls_now(reader) == clear
    clock.now += 0.5
    now = registry.stalls_now(reader)
    assert now is not None and now.recent_fraction == pytest.approx(1.0 / 1.25)
    clock.now += 19.0
    now = registry.stalls_now(reader)
    assert now is not None and now.recent_fraction == pytest.approx(20.0 / 20.25)
    # Only the fraction: the totals stay what the reader reported (the counters').
    assert dataclasses.replace(now, recent_fraction=clear.recent_fraction) == clear
    registry.end_wait("r", wait)
    assert reader.waits == []
    assert registry.stalls_now(reader) == clear


def test_a_reader_stuck_before_its_first_report_reads_as_only_waiting() -> None:
    clock = Clock()
    registry: readers.Registry[str] = readers.Registry(clock=clock)
    registry.register("r", plans.PlanParams(), 0)
    reader = registry.get("r")
    assert reader is not None
    assert registry.stalls_now(reader) is None
    first = registry.begin_wait("r", 0, 600.0)
    clock.now += 2.0
    second = registry.begin_wait("r", 1, 600.0)
    now = registry.stalls_now(reader)
    assert now is not None and now.recent_fraction == 1.0
    # The oldest wait counts, and each ends on its own.
    assert [w.shard for w in reader.waits] == [0, 1]
    registry.end_wait("r", first)
    assert [w.shard for w in reader.waits] == [1]
    registry.end_wait("r", second)
    assert registry.stalls_now(reader) is None
    assert registry.begin_wait("gone", 0, 1.0) is None
