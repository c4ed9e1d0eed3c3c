"""The sidecar's reader registry and handover holds (pure bookkeeping)."""

from __future__ import annotations

import dataclasses

import pytest
from shardcache_sidecar import readers

from shardcache import plans, streams

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
