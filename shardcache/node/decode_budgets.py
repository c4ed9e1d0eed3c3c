"""The memory decodes of shards hold at once in one process, bounded across its fetches.

Each fetch decodes one shard in memory before writing it to the memory tier, so
`fetch_concurrency` decodes at once would take that many times a shard's decode peak.
A decode first reserves its peak here (`quotas.decode_peak` of its decoded size from
the shard's metadata, or of its budget when the format cannot tell) and holds it until
the shard is written. The capacity is the smaller of the memory tier's limit and the
room the container's memory limit leaves beside the memory volume and the process
(`capacity`; issue 13, docs/security.md; explorer D2, docs/faults.md): however many
fetches run, the decodes fit the cgroup, and a shard whose decode could never fit is
refused with `DecodeRoomError` before it is decoded, not OOM-killed while it is.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from shardcache import errors
from shardcache.node import quotas


class DecodeRoomError(errors.CacheError):
    """A shard's decode would peak over the whole decode budget: no wait makes room."""

    def __init__(self, message: str, *, size: int, room: int) -> None:
        super().__init__(message)
        self.size, self.room = size, room


def capacity(memory_tier_bytes: int, room: int | None) -> tuple[int, str]:
    """The budget's bytes for a tier of `memory_tier_bytes` and the room to decode in
    (`quotas.decode_room`, None without a memory limit), and what set it, for errors.

    Without a memory limit the tier's limit bounds the decodes, as a peak
    (`quotas.decode_peak`): a shard the tier holds is decoded, one at a time if it
    must. With one, the room does where it is less."""
    tier = quotas.decode_peak(memory_tier_bytes)
    if room is None or room >= tier:
        return tier, (
            f"the memory tier's limit of {memory_tier_bytes} bytes x the decode peak "
            f"factor {quotas.DECODE_PEAK_FACTOR}"
        )
    return room, (
        f"the {room} bytes the container's memory limit leaves to decode in, beside the "
        "memory volume's tmpfs pages and the process itself"
    )


class DecodeBudget:
    def __init__(self, capacity: int, *, what: str = "") -> None:
        #: Bytes all reservations together may hold (`capacity`)...
        self.capacity = capacity
        #: ...and what set it, for the error of a reservation over it.
        self.what = what or f"{capacity} bytes"
        self._held = 0
        self._changed = threading.Condition()

    @property
    def held(self) -> int:
        with self._changed:
            return self._held

    def check_fits(self, decoded_bytes: int) -> None:
        """Raise `DecodeRoomError` where a shard's decoded bytes alone exceed the whole
        capacity: that decode can never fit, however long it waits."""
        if decoded_bytes > self.capacity:
            raise DecodeRoomError(
                f"that is more than the decode budget of {self.capacity} bytes ({self.what})",
                size=decoded_bytes,
                room=self.capacity,
            )

    @contextlib.contextmanager
    def reserve(self, nbytes: int) -> Iterator[None]:
        """Hold `nbytes` for the block, waiting while others hold too much for it.

        A reservation over the whole capacity could never be granted: raised at once
        (the caller says which shard, and what would make room)."""
        if nbytes > self.capacity:
            raise DecodeRoomError(
                f"its decode peaks at about {nbytes} bytes, more than the decode budget of "
                f"{self.capacity} bytes ({self.what})",
                size=nbytes,
                room=self.capacity,
            )
        with self._changed:
            self._changed.wait_for(lambda: self._held + nbytes <= self.capacity)
            self._held += nbytes
        try:
            yield
        finally:
            with self._changed:
                self._held -= nbytes
                self._changed.notify_all()
