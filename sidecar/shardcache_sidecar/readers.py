"""The sidecar's registry of readers and of the shard holds it hands over to them.

Pure bookkeeping (no I/O, no cache calls): the server asks it what changed and then
tells the `CacheNode`. Reader ids are chosen by the client, so registering the same id
again (after a sidecar restart, or a client retry) is the same reader, not a new one.

A hold is the sidecar's own lease on a shard between answering an acquire and the
client taking its own file lock on the entry (`shardcache.node.leases`). A client that
dies in between never drops it, so holds expire after `handoff_timeout` seconds.
"""

from __future__ import annotations

import dataclasses
import enum
import secrets
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from shardcache import plans
from shardcache.contract import protocol

L = TypeVar("L")


class Change(enum.Enum):
    CREATED = "created"
    #: Same id, same plan: nothing to tell the cache but the position.
    UNCHANGED = "unchanged"
    #: Same id, another plan (a rank or seed change): the cache must replace the reader.
    REPLACED = "replaced"


#: Seconds an acquire must have waited before the reader's exported stall fraction
#: counts it (`stalls_now`): the client reports its totals once a second, so a wait
#: shorter than that is in its next report; a longer one may never be (the loop is
#: stuck in it).
BLOCKED_AFTER_S = 1.0


@dataclasses.dataclass(frozen=True, eq=False)
class Wait:
    """An acquire of the reader's waiting for a shard: since when (the registry's
    clock, and the wall clock for people), for at most `timeout_s` seconds."""

    shard: int
    since: float
    since_wall: float
    timeout_s: float


@dataclasses.dataclass
class Reader:
    reader_id: str
    params: plans.PlanParams
    position: int
    registered_at: float
    last_seen: float
    #: The last data-stall totals the reader reported (notes), None before the first.
    stalls: protocol.Stalls | None = None
    #: Whether the client holds a reader lock for it (`shardcache.node.reader_locks`)
    #: that the sidecar could see at registration: only such a reader is ever found dead.
    locked: bool = False
    #: Its acquires waiting for a shard now, oldest first (several when threads share it).
    waits: list[Wait] = dataclasses.field(default_factory=list)
    #: The `seq` of the last position applied (`protocol.FEATURE_SEQ`); None while the
    #: client sent none (an older client: every position it sends is applied).
    seq: int | None = None

    def behind(self, seq: int | None) -> bool:
        """Whether a request's position is older than the one applied last: built by the
        client before it, it arrived after (another connection). Its position is not
        applied; the rest of the request is. One int compare: notes are the hot path."""
        return seq is not None and self.seq is not None and seq < self.seq


@dataclasses.dataclass
class Hold(Generic[L]):
    lease_id: str
    reader_id: str
    shard: int
    lease: L
    created: float


def _same_plan(a: plans.PlanParams, b: plans.PlanParams) -> bool:
    # The epoch moves with the reader (update_reader); everything else defines it.
    return a.with_epoch(0) == b.with_epoch(0)


class Registry(Generic[L]):
    """Readers by id, and holds (leases of type L) by lease id. Not thread-safe: the
    server uses it from the event loop only."""

    def __init__(
        self, *, clock: Callable[[], float], wall: Callable[[], float] = time.time
    ) -> None:
        self._clock = clock
        #: The wall clock, for when a wait began as a person reads it (/v1/status).
        self._wall = wall
        self._readers: dict[str, Reader] = {}
        self._holds: dict[str, Hold[L]] = {}

    # --- readers ----------------------------------------------------------------
    def register(
        self,
        reader_id: str,
        params: plans.PlanParams,
        position: int,
        *,
        locked: bool = False,
        seq: int | None = None,
    ) -> Change:
        """Register a reader, or take a known one's plan and position again. A
        registration of a known reader's plan older than its last applied position
        (`seq`: a client registering it again from two threads after a sidecar restart)
        leaves the reader where it is: the caller reads epoch and position back from it."""
        now = self._clock()
        old = self._readers.get(reader_id)
        if old is None:
            self._readers[reader_id] = Reader(
                reader_id, params, position, now, now, locked=locked, seq=seq
            )
            return Change.CREATED
        change = Change.UNCHANGED if _same_plan(old.params, params) else Change.REPLACED
        old.last_seen, old.locked = now, locked
        if change is Change.UNCHANGED and old.behind(seq):
            return change
        old.params, old.position, old.seq = params, position, seq
        return change

    def locked(self) -> list[str]:
        """The readers whose client holds a reader lock, to check whether they live."""
        return [r.reader_id for r in self._readers.values() if r.locked]

    def locked_at_rank(self, rank: int) -> bool:
        """Whether a reader whose client holds a reader lock reads as `rank`: one a rank
        registering anew may have been before it crashed."""
        return any(r.locked and r.params.rank == rank for r in self._readers.values())

    def get(self, reader_id: str) -> Reader | None:
        return self._readers.get(reader_id)

    def move(
        self, reader_id: str, *, epoch: int, position: int, seq: int | None = None
    ) -> Reader | None:
        """Move a known reader to `epoch`/`position` (None for an unknown one); one
        whose position `seq` is behind the last applied stays where it is."""
        reader = self._readers.get(reader_id)
        if reader is None:
            return None
        reader.last_seen = self._clock()
        if reader.behind(seq):
            return reader
        if seq is not None:
            reader.seq = seq
        if epoch != reader.params.epoch:
            reader.params = reader.params.with_epoch(epoch)
        reader.position = position
        return reader

    def report_stalls(self, reader_id: str, stalls: protocol.Stalls) -> tuple[float, float]:
        """Take a reader's stall totals; returns how much its wait and step seconds grew
        since the last report (what the sidecar's counters add). Totals that went down
        (a client that reopened under the same id) count from zero again."""
        reader = self._readers.get(reader_id)
        if reader is None:
            return 0.0, 0.0
        old = reader.stalls
        reader.stalls = stalls
        if (
            old is None
            or stalls.wait_seconds < old.wait_seconds
            or stalls.step_seconds < old.step_seconds
        ):
            return stalls.wait_seconds, stalls.step_seconds
        return stalls.wait_seconds - old.wait_seconds, stalls.step_seconds - old.step_seconds

    def begin_wait(self, reader_id: str, shard: int, timeout_s: float) -> Wait | None:
        """Note that an acquire of the reader waits for `shard` from now on (None for
        an unknown reader); `end_wait` it when the acquire is answered."""
        reader = self._readers.get(reader_id)
        if reader is None:
            return None
        wait = Wait(shard, self._clock(), self._wall(), timeout_s)
        reader.waits.append(wait)
        return wait

    def end_wait(self, reader_id: str, wait: Wait | None) -> None:
        reader = self._readers.get(reader_id)
        if reader is not None and wait is not None and wait in reader.waits:
            reader.waits.remove(wait)

    def stalls_now(self, reader: Reader) -> protocol.Stalls | None:
        """The reader's stall totals as the sidecar exports them now: as it reported
        them, but with the recent fraction of a loop stuck in an acquire.

        A blocked loop sends no report (its batches stopped), so the last reported
        fraction would stay what it was before the block, as low as a healthy loop's,
        for as long as the block lasts, and no stall alert would fire for a rank that
        only waits. Once its oldest acquire has waited `BLOCKED_AFTER_S`, the fraction
        is at least what that wait is of it and one mean step (the reader's reported
        step seconds per batch): 0.8 after 1 s at 0.25 s steps, 0.99 after 20 s. A
        reader that never reported shows that too (a rank stuck at its first shard).
        None for a reader neither reporting nor blocked."""
        reported = reader.stalls
        if not reader.waits:
            return reported
        waited = self._clock() - reader.waits[0].since
        if waited < BLOCKED_AFTER_S:
            return reported
        if reported is None:
            return protocol.Stalls(0.0, 0.0, 0, 1.0)
        step = reported.step_seconds / reported.batches if reported.batches else 0.0
        blocked = waited / (waited + step)
        if blocked <= reported.recent_fraction:
            return reported
        return dataclasses.replace(reported, recent_fraction=min(1.0, blocked))

    def unregister(self, reader_id: str) -> tuple[Reader | None, list[Hold[L]]]:
        """Remove a reader; returns it and the holds it still had (to release)."""
        reader = self._readers.pop(reader_id, None)
        holds = [h for h in self._holds.values() if h.reader_id == reader_id]
        for hold in holds:
            del self._holds[hold.lease_id]
        return reader, holds

    def readers(self) -> list[Reader]:
        return list(self._readers.values())

    def __len__(self) -> int:
        return len(self._readers)

    # --- holds ------------------------------------------------------------------
    def hold(self, reader_id: str, shard: int, lease: L) -> Hold[L]:
        lease_id = secrets.token_hex(16)
        hold = Hold(lease_id, reader_id, shard, lease, self._clock())
        self._holds[lease_id] = hold
        return hold

    def drop(self, lease_id: str) -> Hold[L] | None:
        """Forget a hold; the caller releases its lease. None if unknown (idempotent)."""
        return self._holds.pop(lease_id, None)

    def expired(self, max_age: float) -> list[Hold[L]]:
        """Forget and return holds older than `max_age` seconds; the caller releases them."""
        cutoff = self._clock() - max_age
        stale = [h for h in self._holds.values() if h.created <= cutoff]
        for hold in stale:
            del self._holds[hold.lease_id]
        return stale

    def holds(self) -> list[Hold[L]]:
        return list(self._holds.values())

    def next_expiry(self, max_age: float) -> float:
        """When `expired(max_age)` next has a hold to return, on this registry's clock,
        if no hold is made before then: the oldest hold's, else `max_age` from now (a
        hold made later expires later). Holds are kept in the order they were made."""
        oldest = next(iter(self._holds.values()), None)
        return (self._clock() if oldest is None else oldest.created) + max_age
