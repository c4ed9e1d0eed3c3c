"""A cap on the operator's resolve children across namespaces, shared fairly.

Why: `source_reads` lets each namespace run `PER_NAMESPACE` resolves at once, each a
child process that may map `operator.settings.resolveMemory` (`resolve_children`). Many
namespaces resolving at once (a wave of new DatasetMounts, a store outage ending and
every mount retrying) added children past the operator container's memory limit: the
kernel then killed children (`oom_score_adj` 1000), failing resolves that would have
fitted one after another, and the operator itself could be hit. Here the operator runs
at most `capacity` children in all (`capacity_for`: the container's memory limit less
`OPERATOR_RESERVE`, divided by `resolveMemory`, at least `MIN_DEFAULT`; or the chart
value operator.settings.resolveChildren).

Fairness: a namespace holds at most `share` of the slots (half, rounded up: never all
of them once there are two), and a freed slot goes to the waiting namespace served
least recently (round-robin over the namespaces waiting), not to the earliest waiter.
The share is what keeps a namespace whose store never answers from holding every slot
until its children's timeouts (a held slot cannot be taken back before then); the
turns keep a namespace with a long queue from taking every slot that comes free while
another waits. Round-robin alone would not do: it decides who gets a freed slot, and a
stalled namespace frees none until its timeouts. A cap on the share leaves slots
idle while one namespace alone resolves; resolves are rare (create, source change,
retry), so that costs time, never memory. With one slot the share is that slot: a
namespace whose store never answers would hold it through each of its timeouts, every
other namespace waiting; so the default is never under two (`MIN_DEFAULT`), and the
chart's default container limit (1Gi) holds two at their worst.

Waiting counts against the resolve's own deadline (`source_reads.remaining`): a resolve
that gets no slot in time fails `AllBusy` (a retried SourceError whose message says the
operator's resolves are busy, not the tenant's store). Called from the gate's threads
(`resolve_children.Resolver`), so it blocks with a lock and events, not asyncio.

The periodic reads' worker processes (`read_workers`) are capped the same way, by a
`Slots` of their own (`Kind` names them in `AllBusy`), with a share of one per
namespace.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
from collections.abc import Iterator

from shardcache_operator import source_reads

#: Memory the operator process keeps for itself within its container's limit: it
#: peaked at 260-330 MiB in the 500-mount benchmark (docs/benchmarks.md), rounded up.
OPERATOR_RESERVE = 384 << 20
#: The fewest slots the default gives: with two, a namespace holds one (its share) and
#: the others take turns at the other. Over the container's room, a child is what the
#: kernel kills (`oom_score_adj` 1000), never the operator.
MIN_DEFAULT = 2


class AllBusy(source_reads.Busy):
    """Every slot of the operator's children of one kind stayed taken for the whole
    timeout (or the namespace's share of them): its resolves (or its reads,
    `read_workers`), not the tenant's store, are busy."""


@dataclasses.dataclass(frozen=True)
class Kind:
    """What a `Slots` counts, as its `AllBusy` message names it."""

    #: The operator's work that is busy ("resolves").
    work: str
    #: What each slot is ("resolve processes").
    holders: str
    #: What happens to the work that got none ("retried with backoff").
    then: str
    #: What sizes the slots, and where the docs say so.
    sizing: str


RESOLVES = Kind(
    work="resolves",
    holders="resolve processes",
    then="retried with backoff",
    sizing=(
        "operator.settings.resolveChildren and the operator's memory limit size them: "
        'docs/operator.md, "Pinning"'
    ),
)


def capacity_for(
    setting: int, *, memory_limit: int | None, resolve_memory: int, read_workers: int = 0
) -> int | None:
    """Children at once: `setting` (operator.settings.resolveChildren) when set, else as
    many as fit the operator container's `memory_limit` (bytes; None: no limit, then no
    cap) beside `OPERATOR_RESERVE` and the `read_workers` (`read_workers`, which map as
    much), each at its `resolve_memory` worst; at least `MIN_DEFAULT`, so that one
    namespace cannot hold them all."""
    if setting > 0:
        return setting
    if memory_limit is None:
        return None
    room = memory_limit - OPERATOR_RESERVE - read_workers * resolve_memory
    return max(MIN_DEFAULT, room // resolve_memory)


class _Waiter:
    __slots__ = ("granted", "namespace")

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.granted = threading.Event()


class Slots:
    """At most `capacity` holders at once (None: no cap), `share` of them from one
    namespace (None: half, rounded up), the least recently served waiting namespace
    first. Thread-safe."""

    def __init__(
        self, capacity: int | None, kind: Kind = RESOLVES, *, share: int | None = None
    ) -> None:
        if capacity is not None and capacity < 1:
            raise ValueError(f"expected at least 1 of the {kind.holders} at once, found {capacity}")
        self.capacity = capacity
        self.kind = kind
        #: Half the slots, rounded up: 1 of 1 or 2, 2 of 3 or 4, ...
        half = None if capacity is None else capacity - capacity // 2
        self.share = half if share is None or half is None else min(share, half)
        self._lock = threading.Lock()
        self._running: dict[str, int] = {}
        self._total = 0
        #: Waiters by namespace, namespaces in the order they began to wait.
        self._queues: dict[str, collections.deque[_Waiter]] = {}
        #: When each namespace holding or waiting was last handed a slot (a count of
        #: slots handed): the least recently served waiting namespace goes next.
        self._served: dict[str, int] = {}
        self._handed = 0

    def running(self, namespace: str | None = None) -> int:
        """Slots held, by `namespace` or (None) in all."""
        with self._lock:
            return self._total if namespace is None else self._running.get(namespace, 0)

    @contextlib.contextmanager
    def held(self, namespace: str, *, timeout: float, what: str) -> Iterator[None]:
        """A slot for `namespace` while the block runs, waited for at most `timeout`
        seconds (`AllBusy` then, naming `what`)."""
        self._acquire(namespace, timeout, what)
        try:
            yield
        finally:
            self._release(namespace)

    def _acquire(self, namespace: str, timeout: float, what: str) -> None:
        waiter = _Waiter(namespace)
        with self._lock:
            self._queues.setdefault(namespace, collections.deque()).append(waiter)
            self._grant()
        if waiter.granted.wait(timeout):
            return
        with self._lock:
            if waiter.granted.is_set():  # handed a slot just as the wait ended
                return
            queue = self._queues[namespace]
            queue.remove(waiter)
            if not queue:
                del self._queues[namespace]
                self._forget(namespace)
            mine, total = self._running.get(namespace, 0), self._total
        assert self.capacity is not None and self.share is not None  # no cap: never waits
        kind = self.kind
        raise AllBusy(
            f"{what}: the operator's {kind.work} are all busy, not the source: {total} of "
            f"its {self.capacity} {kind.holders} at once are running ({mine} of them this "
            f"namespace's, which may hold {self.share}), and none came free for it within "
            f"{timeout:g} s; {kind.then} ({kind.sizing})"
        )

    def _release(self, namespace: str) -> None:
        with self._lock:
            left = self._running[namespace] - 1
            if left:
                self._running[namespace] = left
            else:
                del self._running[namespace]
                self._forget(namespace)
            self._total -= 1
            self._grant()

    def _grant(self) -> None:
        """Free slots to waiters, each to the least recently served waiting namespace
        under its share (under the lock)."""
        while self.capacity is None or self._total < self.capacity:
            eligible = [
                (self._served.get(namespace, -1), order, namespace)
                for order, namespace in enumerate(self._queues)
                if self.share is None or self._running.get(namespace, 0) < self.share
            ]
            if not eligible:
                return  # nobody waits, or every waiting namespace holds its share
            _, _, namespace = min(eligible)
            queue = self._queues[namespace]
            waiter = queue.popleft()
            if not queue:
                del self._queues[namespace]
            self._running[namespace] = self._running.get(namespace, 0) + 1
            self._total += 1
            self._served[namespace] = self._handed
            self._handed += 1
            waiter.granted.set()

    def _forget(self, namespace: str) -> None:
        """Drop the turn of a namespace that neither holds nor waits (under the lock):
        what is kept stays bounded by the namespaces active now."""
        if namespace not in self._running and namespace not in self._queues:
            self._served.pop(namespace, None)
