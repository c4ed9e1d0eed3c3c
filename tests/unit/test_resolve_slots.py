"""The operator's cap on resolve children across namespaces (`resolve_slots`): real
threads holding and waiting for slots, as the gate's threads do."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest
from shardcache_operator import resolve_slots, source_reads

pytestmark = pytest.mark.unit

MiB = 1 << 20


class Holder:
    """A thread that takes a slot for `namespace` and holds it until `release`."""

    def __init__(self, slots: resolve_slots.Slots, namespace: str, timeout: float = 30) -> None:
        self.namespace = namespace
        self.holding = threading.Event()
        self.released = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(slots, timeout), daemon=True)
        self.thread.start()

    def _run(self, slots: resolve_slots.Slots, timeout: float) -> None:
        try:
            with slots.held(self.namespace, timeout=timeout, what="resolving"):
                self.holding.set()
                self.released.wait(30)
        except BaseException as exc:
            self.error = exc

    def release(self) -> None:
        self.released.set()
        self.thread.join(30)


def waiting(slots: resolve_slots.Slots, count: int) -> None:
    """Until `count` holders wait in all (their threads queue asynchronously)."""
    for _ in range(3000):
        with slots._lock:
            if sum(len(q) for q in slots._queues.values()) == count:
                return
        threading.Event().wait(0.01)
    raise AssertionError(f"expected {count} waiting")


def until(condition: Callable[[], bool]) -> None:
    for _ in range(3000):
        if condition():
            return
        threading.Event().wait(0.01)
    raise AssertionError("the condition never held")


@pytest.fixture
def holders() -> Iterator[list[Holder]]:
    made: list[Holder] = []
    yield made
    for holder in made:
        holder.release()


def test_namespaces_at_once_hold_no_more_slots_than_the_cap(holders: list[Holder]) -> None:
    slots = resolve_slots.Slots(3)
    holders += [Holder(slots, f"team-{i}") for i in range(8)]
    waiting(slots, 5)
    assert slots.running() == 3
    assert sum(h.holding.is_set() for h in holders) == 3
    # Each release lets exactly one waiter in, never more.
    for left in range(4, -1, -1):
        done = next(h for h in holders if h.holding.is_set() and not h.released.is_set())
        done.release()
        waiting(slots, left)
        until(lambda left=left: sum(h.holding.is_set() for h in holders) == 8 - left)
        assert slots.running() == 3
        assert sum(h.holding.is_set() and not h.released.is_set() for h in holders) == 3


def test_a_namespace_asking_for_every_slot_first_leaves_room_for_another(
    holders: list[Holder],
) -> None:
    slots = resolve_slots.Slots(4)
    hog = [Holder(slots, "hog") for _ in range(4)]
    holders += hog
    waiting(slots, 2)
    # Half the slots, the hog's share; the rest stay free for other namespaces.
    assert slots.running("hog") == slots.share == 2
    other = Holder(slots, "other")
    holders.append(other)
    assert other.holding.wait(30)
    assert slots.running() == 3


def test_a_freed_slot_goes_to_the_next_namespace_waiting_not_the_earliest_waiter(
    holders: list[Holder],
) -> None:
    slots = resolve_slots.Slots(1)
    first = Holder(slots, "hog")
    assert first.holding.wait(30)
    queued = [Holder(slots, "hog") for _ in range(3)]
    waiting(slots, 3)
    other = Holder(slots, "other")
    holders += [*queued, other]
    waiting(slots, 4)
    first.release()
    assert other.holding.wait(30)
    assert not any(h.holding.is_set() for h in queued)
    other.release()
    waiting(slots, 2)
    until(lambda: sum(h.holding.is_set() for h in queued) == 1)
    assert slots.running() == 1


def test_a_wait_past_its_timeout_fails_saying_the_operator_is_busy_and_gives_up_its_turn(
    holders: list[Holder],
) -> None:
    slots = resolve_slots.Slots(1)
    first = Holder(slots, "ml")
    holders.append(first)
    assert first.holding.wait(30)
    late = Holder(slots, "cv", timeout=0.2)
    late.thread.join(30)
    assert isinstance(late.error, resolve_slots.AllBusy)
    assert isinstance(late.error, source_reads.Busy)  # retried, as a SourceError
    message = str(late.error)
    assert "resolving: the operator's resolves are all busy, not the source" in message
    assert "1 of its 1 resolve processes" in message and "within 0.2 s" in message
    assert "retried with backoff (operator.settings.resolveChildren" in message
    # Its turn is gone: the next namespace to ask gets the slot once it is free.
    first.release()
    after = Holder(slots, "cv")
    holders.append(after)
    assert after.holding.wait(30)
    assert slots.running() == 1


def test_without_a_cap_nobody_waits(holders: list[Holder]) -> None:
    slots = resolve_slots.Slots(None)
    holders += [Holder(slots, "ml") for _ in range(20)]
    assert all(h.holding.wait(30) for h in holders)


def test_less_than_one_slot_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1 of the resolve processes at once, found 0"):
        resolve_slots.Slots(0)


@pytest.mark.parametrize(
    ("setting", "memory_limit", "resolve_memory", "read_workers", "expected"),
    [
        # The chart's defaults: 1536Mi beside 384Mi for the operator and two read
        # workers holds two resolves of 256Mi.
        (0, 1536 * MiB, 256 * MiB, 2, 2),
        (0, 2048 * MiB, 256 * MiB, 2, 4),
        (0, 2048 * MiB, 256 * MiB, 0, 6),
        (0, 2048 * MiB, 512 * MiB, 0, 3),
        # Less room than two: two still, so one namespace cannot hold every slot.
        (0, 1024 * MiB, 256 * MiB, 2, 2),
        (0, 256 * MiB, 256 * MiB, 0, 2),
        # No container limit: no cap.
        (0, None, 256 * MiB, 2, None),
        # Set explicitly: that, whatever the limit.
        (5, 512 * MiB, 256 * MiB, 2, 5),
        (1, 2048 * MiB, 256 * MiB, 2, 1),
        (2, None, 256 * MiB, 2, 2),
    ],
)
def test_the_cap_is_the_setting_or_what_the_memory_limit_holds_beside_the_read_workers(
    setting: int,
    memory_limit: int | None,
    resolve_memory: int,
    read_workers: int,
    expected: int | None,
) -> None:
    assert (
        resolve_slots.capacity_for(
            setting,
            memory_limit=memory_limit,
            resolve_memory=resolve_memory,
            read_workers=read_workers,
        )
        == expected
    )
