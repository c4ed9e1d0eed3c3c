"""Readers that wait for room in the memory volume that only they could give back.

A reader keeps the batch it last used while it asks for its next shard (a plain
`for batch in ds.batches(n)` loop holds it until the next one is assigned). That batch
was a zero-copy slice (block mode now hands it out as a copy, `datasets.Dataset._sliced`:
what follows is a reader that keeps more than it in hand), so it kept its whole
shard's file mapped, and once the tier has evicted (unlinked) that shard its pages
stay in the volume, outside the tier's limit, until the batch goes. With K readers that is about K decoded shards beyond
the limit. When that is more than the volume's room over the limit plus what the
tier can still give up, every insert waits for readers to unmap and every reader
waits in an acquire for an insert: nobody unmaps, and the tier's wait ran its whole
five minutes before every rank failed with "stayed out of space".

Only a process that serves every reader of the volume can tell (the sidecar: its
memory tier is its pod's own, `memory_sole_writer`): when all its readers wait in an
acquire, the volume has not gained room for `GRACE_S`, and neither its free bytes
nor the tier's unleased entries cover the insert, the room is held by the waiting
readers themselves. The acquire then fails with what the volume needs.

Readers need not all wait in an acquire for the cycle to hold: a rank that got its last
batch and then waits for the others (a collective, a barrier; in the explorer's run a
rank blocked writing its output to a pipe) keeps its batch mapped and asks for nothing,
so "every reader waits" never came true and three of eight ranks waited out the tier's
300 s. Such a reader cannot be told from one busy with a long shard, so the cycle short
of some readers fails only after `IDLE_GRACE_S` in which no acquire ended and the volume
gained neither free nor evictable room: a busy reader that moves on gives back room (or
joins the waiting), which starts the grace again.

Pure functions and a small state, so the arithmetic is tested without a full volume.
"""

from __future__ import annotations

import dataclasses

#: Seconds the cycle must last before an acquire fails: longer than a reader of this
#: version takes to drop its own mappings of evicted files while it waits
#: (`datasets._Mappings.UNMAP_EVERY_S`) and than the tier waits for them before it
#: evicts again (`tiers._no_space.UNMAP_GRACE_S`).
GRACE_S = 3.0

#: Seconds a cycle must last while some readers are not in an acquire: they asked for
#: nothing and gave back no room meanwhile. Long, because a reader busy with one shard
#: (a slow step, an evaluation) asks for nothing either, and far inside the tier's own
#: wait for room (300 s), which fails the acquire anyway with a vaguer error.
IDLE_GRACE_S = 60.0


@dataclasses.dataclass(frozen=True)
class Look:
    """The memory volume and its readers, at one poll of a waiting insert."""

    #: The volume's size and free bytes (statvfs).
    total: int
    free: int
    #: Bytes of the tier's own files (committed entries and reservations).
    own: int
    #: Bytes of the tier's entries nobody leases: what eviction could still give.
    evictable: int
    #: Free bytes the waiting insert needs (its data and meta file).
    need: int
    #: Readers this process serves, and the acquires of theirs in progress.
    readers: int
    waiting: int
    #: Readers' acquires ended so far (a count that only grows): one that ended is
    #: progress, or a reader that failed and gives its room back.
    ended: int = 0

    @property
    def mapped(self) -> int:
        """Volume bytes that are not the tier's files: entries evicted that readers
        still map (and whatever else is there)."""
        return max(0, self.total - self.free - self.own)


def held(look: Look) -> bool:
    """Whether only readers could give the insert its room: neither the free bytes nor
    the unleased entries cover what it needs, while readers' mappings hold part of the
    volume."""
    return look.free + look.evictable < look.need and look.mapped > 0


def stuck(look: Look) -> bool:
    """Whether nothing but the waiting readers could give the insert its room: every
    reader waits in an acquire, and the room is `held`."""
    return look.readers > 0 and look.waiting >= look.readers and held(look)


def grace(look: Look) -> float | None:
    """How long `look` must last to be a cycle: `GRACE_S` when every reader waits in
    an acquire, `IDLE_GRACE_S` when some do and the others may be waiting for them
    elsewhere; None when no reader waits or the room is not `held`."""
    if look.readers <= 0 or look.waiting <= 0 or not held(look):
        return None
    return GRACE_S if look.waiting >= look.readers else IDLE_GRACE_S


def volume_needed(limit: int, readers: int, shard_bytes: int) -> int:
    """The volume that serves `readers` readers each still mapping one evicted shard of
    `shard_bytes` decoded bytes beside a full tier of `limit` bytes."""
    return limit + readers * shard_bytes


def limit_needed(limit: int, total: int, readers: int, shard_bytes: int) -> int | None:
    """The memory limit whose volume, grown in the proportion this one has to it (the
    webhook's sizing: the limit plus a fixed fraction), gives `readers` evicted shards
    room beyond the limit; None when this volume has no room beyond its limit."""
    if total <= limit:
        return None
    return -(-readers * shard_bytes * limit // (total - limit))


@dataclasses.dataclass
class Watch:
    """One insert's polls: since when the cycle has lasted."""

    since: float | None = None
    free: int | None = None
    evictable: int | None = None
    ended: int | None = None

    def reset(self) -> None:
        """No cycle now: the next one starts its grace afresh."""
        self.since = self.free = self.evictable = self.ended = None

    def lasted(self, look: Look, now: float) -> bool:
        """Whether `look` is a cycle that has lasted its `grace`: not while the volume
        gains free or evictable room (a reader unmapped or let go: progress, however
        slow) or an acquire ends. A reader joining the waiting keeps the time: the
        room it holds was missing already."""
        wanted = grace(look)
        if wanted is None:
            self.reset()
            return False
        if (
            self.since is None
            or (self.free is not None and look.free > self.free)
            or (self.evictable is not None and look.evictable > self.evictable)
            or look.ended != self.ended
        ):
            self.since = now
        self.free, self.evictable, self.ended = look.free, look.evictable, look.ended
        return now - self.since >= wanted


def describe(look: Look, *, root: str, limit: int, shard_bytes: int, setting: str) -> str:
    """The error of an acquire that fails on the cycle: what holds the volume, what is
    missing, and the volume (or the memory limit) that would serve these readers."""
    wanted = volume_needed(limit, look.readers, shard_bytes)
    raised = limit_needed(limit, look.total, look.readers, shard_bytes)
    pod = (
        ""
        if raised is None
        else f"; in a pod, whose run volume the webhook sizes in proportion to "
        f"spec.cache.memory, a memory limit of at least {raised} bytes"
    )
    return (
        f"the memory volume {root} ({look.total} bytes) cannot hold what its "
        f"{look.readers} reader(s) keep mapped beside the tier: {_who_waits(look)}, "
        f"{look.mapped} bytes of the volume are shards the tier evicted that "
        "readers still map (zero-copy batches a reader keeps beyond the one it was "
        "handed last, which is a copy at a shard's end), the tier's files take "
        f"{look.own} ({look.evictable} of them unleased) and {look.free} bytes are free, but this shard needs {look.need}. "
        "No reader can unmap while it waits, so they would wait for each other. The "
        f"volume needs at least {wanted} bytes: the memory limit ({limit} bytes, "
        f"{setting}) plus one decoded shard ({shard_bytes} bytes) per reader{pod} "
        '(docs/operator.md, "The run volume"). Or run fewer readers on the node, or '
        "let go of each batch before asking for the next (a copy keeps no mapping)"
    )


def _who_waits(look: Look) -> str:
    if look.waiting >= look.readers:
        return "every reader waits in an acquire"
    return (
        f"{look.waiting} of them wait in an acquire and the other "
        f"{look.readers - look.waiting} gave back no room for {IDLE_GRACE_S:g} s while "
        "keeping theirs mapped (a rank that waits for the others, in a collective or a "
        "barrier, or one busy elsewhere)"
    )
