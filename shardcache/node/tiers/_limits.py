"""The byte limits of the processes inserting into one tier directory, and the one that
bounds it: the largest.

Every DatasetMount of a namespace shares the namespace's node disk tier
(`ns-<namespace>`), each sidecar with its mount's `cache.disk` as its limit. Each
process enforced its own limit on the whole directory, so the largest bounded it, and a
mount with a smaller limit evicted the others' entries down to its own limit at every
insert, and, while their readers leased more than its limit, could insert nothing at
all: it waited out the tier's wait (five minutes) and failed, holding nothing itself.

So each inserting process declares its limit in the directory, and every insert counts
against the largest live one (`effective`): the directory stays bounded by the largest
limit, as before, and no process evicts below it. A declaration is
`.limits/<limit>-<pid>-<token>.lock`, held under a shared `flock` by its process for as
long as it lives; one whose lock can be taken exclusively belongs to a dead process:
it counts nothing, and is removed by whoever finds it and may (no process ID is
trusted, as for temp files). The directory is 1777, like /tmp: every user of the tier
declares there, and only a file's owner (or the directory's, or root) removes it, so
no process can remove another user's live declaration (which would let its own,
smaller, limit evict that user's entries). A dead process's declaration of another user
stays until a process of that user (or root) finds it, counting nothing meanwhile. A
dot name and a directory: tiers of every format version ignore it.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
import threading
import time
import weakref
from pathlib import Path

from shardcache.node import _locks, after_fork

#: The subdirectory of the tier's directory (a dot name: tiers ignore it).
DIRECTORY = ".limits"
_NAME = re.compile(r"(\d{1,20})-\d+-[0-9a-f]+\.lock")
# Any user of the tier's directory declares here (the directory's own mode, 2770 for
# the node disk tier, bounds who that is); the sticky bit keeps each user's files its
# own to remove (module docstring).
_DIRECTORY_MODE = 0o1777
#: How long `bound` may answer from its last look: a status request or metrics scrape
#: listed `.limits/` and tried a lock per declaration each time, while declarations
#: change only when a sidecar starts or ends. A declaration made or removed changes
#: the directory's mtime and is seen at once; a process that died with its
#: declaration in place (its lock free, the file left) is seen within this.
BOUND_TTL_SECONDS = 1.0


def _release(fd: int, path: Path) -> None:
    with contextlib.suppress(OSError):
        _locks.unlink_held(fd, path)
    with contextlib.suppress(OSError):
        _locks.close(fd)


class Limits:
    """This process's declaration of `limit` in the tier directory `root`, made at the
    first `effective` (an insert's), and the live declarations of the others."""

    def __init__(self, root: Path, limit: int) -> None:
        self._dir = root / DIRECTORY
        self._limit = limit
        self._pid = -1
        self._lock = threading.Lock()
        self._finalizer: weakref.finalize[..., Limits] | None = None
        #: (monotonic time of the look, the directory's (inode, mtime) then, the
        #: answer) of the last `bound`.
        self._bound: tuple[float, tuple[int, int], int] | None = None
        after_fork.register(self)

    def after_fork(self) -> None:
        # The child's copy of the descriptor points at /dev/null (`_locks`): it holds
        # nothing, and declares its own at its first insert.
        if self._finalizer is not None:
            self._finalizer.detach()
        self._finalizer = None
        self._pid = -1
        self._lock = threading.Lock()
        self._bound = None

    def effective(self) -> int:
        """The largest limit of the processes inserting into the directory now, this
        one's included (declared first, if it is not yet). Call under the tier lock.
        Best effort: a declaration that cannot be made or read counts nothing (then
        this process's own limit is what it is held to, as before declarations)."""
        try:
            self._declare()
        except OSError:
            return self._limit
        return self._largest_live(remove_dead=True)

    def bound(self) -> int:
        """What bounds the directory now, for a status: the largest limit of the live
        processes' declarations, this one's own included. Only looks (declares nothing,
        removes nothing), so it needs no tier lock; a declaration whose lock can be
        taken belongs to a dead process and counts nothing. Answered from the last
        look while the directory is unchanged and that look is less than
        `BOUND_TTL_SECONDS` old (one stat instead of a lock per declaration)."""
        now = time.monotonic()
        try:
            st = os.stat(self._dir)
        except OSError:
            return self._largest_live(remove_dead=False)
        version = (st.st_ino, st.st_mtime_ns)
        cached = self._bound  # one read: another thread may replace it meanwhile
        if cached is not None and cached[1] == version and 0 <= now - cached[0] < BOUND_TTL_SECONDS:
            return cached[2]
        largest = self._largest_live(remove_dead=False)
        self._bound = (now, version, largest)
        return largest

    def _largest_live(self, *, remove_dead: bool) -> int:
        """The largest limit of the declarations a live process holds, and this one's.
        A dead process's, whatever its limit, is removed with `remove_dead` (under the
        tier lock: none piles up), else left to the next insert."""
        largest = self._limit
        try:
            names = os.listdir(self._dir)
        except OSError:
            return largest
        for name in names:
            found = _NAME.fullmatch(name)
            if found is None:
                continue
            path = self._dir / name
            try:
                fd = _locks.acquire(path, _locks.EXCLUSIVE | _locks.NONBLOCKING, create=False)
            except OSError:
                continue
            if fd is None:
                # Held: a live process's (this one's own among them). Without the tier
                # lock it may have been removed meanwhile.
                if remove_dead or path.exists():
                    largest = max(largest, int(found.group(1)))
                continue
            if remove_dead:
                # Refused (PermissionError, suppressed) for another user's: the sticky bit.
                _release(fd, path)
            else:
                _locks.close(fd)
        return largest

    def _declare(self) -> None:
        with self._lock:
            if self._pid == os.getpid():
                return
            with contextlib.suppress(FileExistsError):
                os.mkdir(self._dir, _DIRECTORY_MODE)
            # Whatever the umask, and on a directory an older release made 0777 (only
            # its owner may change it; another user's is left as it is).
            with contextlib.suppress(OSError):
                st = os.lstat(self._dir)
                if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != _DIRECTORY_MODE:
                    os.chmod(self._dir, _DIRECTORY_MODE)
            path = self._dir / f"{self._limit}-{os.getpid()}-{secrets.token_hex(4)}.lock"
            fd = _locks.acquire(path, _locks.SHARED, create=True)
            if fd is None:  # only with NONBLOCKING, not passed here
                return
            self._finalizer = weakref.finalize(self, _release, fd, path)
            self._pid = os.getpid()
