"""An insert that found its volume full below the tier's limit: what holds the room.

A tier's limit counts its own files, but the volume under it holds more: the pages of
files the tier evicted that a reader still maps (a mapping keeps an unlinked tmpfs
file's pages until it goes), the tiers of other namespaces on a shared node volume,
and whatever else is there. ENOSPC (or EDQUOT, a quota spent) below the limit is
therefore "no room yet", and `Tier._after_no_space` makes room with what is here. A
producer's full volume counts the same as the insert's own: the disk tier's fetch
(`source.download`) raises the ENOSPC of writing its temp file as it is, never
retried as the store's failure:

* it evicts least recently used unleased entries while that brings room back;
* an eviction whose room does not come back (the insert's own, to fit the limit, or
  one here) is of a file some reader maps: its bytes are counted as `unfreed`, and
  once they cover what is missing, evicting more would only empty the tier for
  nothing (it did: every entry, down to the last, while the reader mapping them was
  the one waiting on this insert); it waits for readers to unmap instead, polling the
  volume's free bytes. A reader drops such mappings within a moment
  (`datasets._Mappings`); if the room has not come back after `UNMAP_GRACE_S`, those
  files are taken to stay mapped (a reader holding on to old batches), and it evicts
  again, at most what is missing each time;
* what it logs and raises names what holds the room: the tier's files, the evicted
  files still mapped, and the rest of the volume.

Pure functions and a small state, so the arithmetic is tested without a full volume.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

from shardcache import source

#: The errnos of a volume out of room (`source.NO_SPACE_ERRNOS`).
ERRNOS = source.NO_SPACE_ERRNOS

# Room an insert needs beside its data: its meta file (a page of a tmpfs, a block of a
# disk), the data itself rounded up to whole pages.
_PAGE = 4096
_META_ROOM = 2 * _PAGE
#: How long evicted files still mapped are waited for before they are taken to stay
#: mapped: a reader of this version drops them within `_Mappings.UNMAP_EVERY_S`.
UNMAP_GRACE_S = 1.0


@dataclasses.dataclass(frozen=True)
class Volume:
    """A filesystem's size and the bytes this process may still write there."""

    total: int
    free: int


def volume(root: Path) -> Volume | None:
    """The volume of `root` by statvfs; None when it cannot be read. Root may write
    the blocks a filesystem reserves for it (ext4's 5 %), anyone else may not."""
    try:
        st = os.statvfs(root)
    except OSError:
        return None
    blocks = st.f_bfree if os.geteuid() == 0 else st.f_bavail
    return Volume(total=st.f_blocks * st.f_frsize, free=blocks * st.f_frsize)


def volume_under(path: Path) -> Volume | None:
    """The volume `path` is or will be on: its own, else its nearest existing parent's
    (a tier directory not made yet lies on the volume of the directory above it)."""
    for place in (path, *path.parents):
        if place.exists():
            return volume(place)
    return None


def limit_within(limit: int, found: Volume | None) -> int:
    """A tier's `limit` at most its volume's size (`found`; None: unknown, unchanged).

    A larger limit can never be reached: the tier would only find out by ENOSPC (the
    disk tier's default is a fixed 50 GiB, whatever disk the node has). Clamped to the
    size, not the free bytes: the tier's own files are part of what is used, and the
    rest of the volume is what `Tier._after_no_space` handles when it fills."""
    if found is None or limit <= found.total:
        return limit
    return found.total


def clamp_level(*, explicit: bool) -> int:
    """The log level that says a limit was clamped to its volume (`limit_within`).

    WARNING for a limit someone set: what they asked for cannot be had, and they can
    change it. INFO for the default: a fixed size (the disk tier's 50 GiB) that a small
    node's volume is expected not to hold; a warning at every start on every such node
    would be one nobody acts on but by setting the limit, and it hides the others."""
    return logging.WARNING if explicit else logging.INFO


def needed(size: int) -> int:
    """Free bytes a volume needs for an entry of `size` bytes and its meta file."""
    return -(-size // _PAGE) * _PAGE + _META_ROOM


@dataclasses.dataclass
class NoSpace:
    """What one insert has seen of its full volume, across its tries."""

    #: Whether the insert logged its WARNING (once per insert, not once per poll).
    warned: bool = False
    #: Bytes of entries evicted for this insert whose room did not come back: files a
    #: reader still maps. They come back when it unmaps them.
    unfreed: int = 0
    #: The volume's free bytes when last looked at.
    free: int | None = None
    #: Since when the insert waits for `unfreed` to come back, instead of evicting.
    waiting_since: float | None = None
    #: The last try was made because the volume seemed to have the room.
    promised: bool = False

    def saw(self, free: int) -> None:
        """The volume has `free` bytes: room that came back since the last look is
        taken to be evicted files unmapped."""
        if self.free is not None and free > self.free:
            self.unfreed = max(0, self.unfreed - (free - self.free))
        self.free = free

    def evicted(self, size: int, *, before: int, after: int) -> None:
        """An entry of `size` bytes was evicted; the volume had `before` free bytes
        and has `after`. Most of its room not back: a reader maps it."""
        if after - before < size // 2:
            self.unfreed += size
        self.free = after

    def waiting_is_enough(self, need: int, free: int, now: float) -> bool:
        """Whether the evicted files still mapped would, once unmapped, give the room
        missing (then evicting more only takes entries for nothing), and have not been
        waited for longer than `UNMAP_GRACE_S` (then they count no more)."""
        if self.unfreed <= 0 or self.unfreed < need - free:
            self.waiting_since = None
            return False
        if self.waiting_since is None:
            self.waiting_since = now
        if now - self.waiting_since < UNMAP_GRACE_S:
            return True
        self.unfreed, self.waiting_since = 0, None
        return False


def holders(found: Volume | None, *, own: int, unfreed: int) -> str:
    """What takes the volume's room, in words: its free bytes, the tier's files, the
    entries evicted for this insert that readers still map, and the rest."""
    if found is None:
        return f"the tier's files take {own} bytes (the volume's size could not be read)"
    other = max(0, found.total - found.free - own - unfreed)
    return (
        f"{found.free} of the volume's {found.total} bytes are free; the tier's files take "
        f"{own}; {unfreed} are entries evicted to make this room that a reader still maps "
        "(their pages stay in the volume until it unmaps them); "
        f"{other} are other files (entries evicted earlier and still mapped, other "
        "programs' or tiers' files)"
    )


def others(found: Volume | None, *, own: int) -> int:
    """Bytes of the volume that are not the tier's files (`own`)."""
    return 0 if found is None else max(0, found.total - found.free - own)
