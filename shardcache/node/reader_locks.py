"""Reader locks: how the sidecar tells that the process behind a reader is gone.

A reader lives in the trainer's process, and a rank killed mid-epoch (SIGKILL, the OOM
killer) never unregisters it. The sidecar runs in another container, usually without a
shared PID namespace, so a process ID (SO_PEERCRED's included) names nothing it could
check. What the two do share is the memory tier's directory, and the kernel drops a
process's `flock`s when it dies, however it dies (the pins of `leases` rely on that too).

So a client takes a shared `flock` on `.readers/<reader id>.lock` under the memory
directory *before* it registers the reader, holds it for as long as the reader is open,
and says so in the registration; the sidecar finds the reader dead exactly when it can
take that lock exclusively, or the file is gone, and drops it (`probe`). Nothing here
times out: a trainer in a step that takes minutes, sending nothing, keeps its lock and
its reader.

A forked child does not hold its parent's lock (`_locks` lets go of the copy at the
fork): a reader belongs to the process that opened it.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import fcntl
import logging
import os
import stat
import threading
import weakref
from collections.abc import Iterable
from pathlib import Path

from shardcache.node import _locks

log = logging.getLogger(__name__)

#: The subdirectory of the memory directory (a dot name: tiers ignore it).
DIRECTORY = ".readers"
SUFFIX = ".lock"
#: Any container's user may add its readers' files; only their owner and the
#: directory's (the sidecar, which made it) may remove them, as in /tmp.
_DIRECTORY_MODE = 0o1777
#: Readable by the sidecar, which may run as another user: a flock needs read access.
_FILE_MODE = 0o644


def path_of(memory_dir: Path, reader_id: str) -> Path:
    return memory_dir / DIRECTORY / f"{reader_id}{SUFFIX}"


def _open_directory(memory_dir: Path, *, create: bool) -> int:
    """A descriptor of the directory of lock files, never through a link (the trainer
    writes the memory directory); made if missing and `create`."""
    directory = memory_dir / DIRECTORY
    made = False
    if create:
        try:
            # Private until opened below: a link swapped in meanwhile fails the open,
            # and fchmod never changes what a link points to.
            os.mkdir(directory, 0o700)
            made = True
        except FileExistsError:
            pass
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    if made:
        try:
            os.fchmod(fd, _DIRECTORY_MODE)
        except BaseException:
            os.close(fd)
            raise
    return fd


class ReaderLock:
    """A shared lock on one reader's lock file, held until `release()` (the client's)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd
        self._mutex = threading.Lock()
        # A provider dropped without close() lets its readers go with it, as a process
        # that exits does.
        self._finalizer = weakref.finalize(self, _close_quietly, fd)

    def held(self) -> bool:
        """Whether the lock is still on the file at `path`: the sidecar removes the
        file of a reader it found dead, and anyone may remove it by hand; a reader that
        registers again then needs a new one."""
        with self._mutex:
            if self._fd is None:
                return False
            try:
                on_disk = os.stat(self.path)
            except OSError:
                return False
            locked = os.fstat(self._fd)
        return (on_disk.st_dev, on_disk.st_ino) == (locked.st_dev, locked.st_ino)

    def release(self) -> None:
        """Remove the file (if it is still the one locked) and let go of the lock."""
        with self._mutex:
            fd, self._fd = self._fd, None
            if fd is None:
                return
            with contextlib.suppress(OSError):
                _locks.unlink_held(fd, self.path)
            self._finalizer()

    def forget(self) -> None:
        """Let go of the descriptor without removing the file: in a forked child, where
        the lock and the file are the parent's (`_locks` pointed the descriptor at
        /dev/null at the fork)."""
        with self._mutex:
            if self._fd is not None:
                self._fd = None
                self._finalizer()


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        _locks.close(fd)


def hold(memory_dir: Path, reader_id: str) -> ReaderLock:
    """Create the reader's lock file and hold a shared lock on it (client side).

    Raises OSError when the memory directory is not there or not writable here: the
    reader is then registered without a lock, and lives until it is closed or the
    sidecar restarts, as before reader locks.
    """
    os.close(_open_directory(memory_dir, create=True))
    path = path_of(memory_dir, reader_id)
    fd = _locks.acquire(path, _locks.SHARED, create=True)
    if fd is None:  # only with NONBLOCKING, not passed here
        raise OSError(errno.EAGAIN, "could not lock the reader's file", str(path))
    # A trainer's umask (077) must not hide the file from the sidecar's user. Only the
    # file's owner may change it: one made by another process of the same reader stays.
    with contextlib.suppress(OSError):
        os.fchmod(fd, _FILE_MODE)
    return ReaderLock(path, fd)


class Found(enum.Enum):
    """What `probe` found of a reader's lock file."""

    #: Someone holds a lock on it: the reader's process lives.
    HELD = "held"
    #: Nobody held it: the process is gone. The file is removed.
    FREE = "free"
    #: There is no such file: its process is gone (its file removed) or never made it
    #: in this directory (another directory mounted as the memory tier).
    MISSING = "missing"
    #: It cannot be opened here (no permission, not a regular file, a link): unknown.
    UNKNOWN = "unknown"


def probe(memory_dir: Path, reader_ids: Iterable[str]) -> dict[str, Found]:
    """Whether the process holding each reader's lock file still lives (sidecar side).

    Takes each lock exclusively without waiting, so it never blocks on a live reader,
    and removes the files nobody held; never follows a link.
    """
    ids = list(reader_ids)
    try:
        directory = _open_directory(memory_dir, create=False)
    except FileNotFoundError:
        return dict.fromkeys(ids, Found.MISSING)
    except OSError:
        return dict.fromkeys(ids, Found.UNKNOWN)
    try:
        return {reader_id: _probe_in(directory, reader_id + SUFFIX) for reader_id in ids}
    finally:
        os.close(directory)


def _probe_in(directory: int, name: str) -> Found:
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, dir_fd=directory)
    except FileNotFoundError:
        return Found.MISSING
    except OSError:
        return Found.UNKNOWN
    try:
        locked = os.fstat(fd)
        if not stat.S_ISREG(locked.st_mode):
            return Found.UNKNOWN
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return Found.HELD
        # Removed while locked, and only if the name is still the file locked: a
        # client taking the lock meanwhile sees it gone and makes a new one (`_locks`).
        with contextlib.suppress(OSError):  # not ours to remove: it stays, unlocked
            on_disk = os.stat(name, dir_fd=directory, follow_symlinks=False)
            if (on_disk.st_dev, on_disk.st_ino) == (locked.st_dev, locked.st_ino):
                os.unlink(name, dir_fd=directory)
        return Found.FREE
    finally:
        os.close(fd)


def prepare(memory_dir: Path) -> int:
    """Make the directory for readers' lock files, and remove those nobody holds: left
    by readers whose process died while no sidecar watched it. The number removed."""
    directory = _open_directory(memory_dir, create=True)
    try:
        # Listed through the descriptor: a link swapped in for the directory is not.
        names = [name for name in os.listdir(directory) if name.endswith(SUFFIX)]
        removed = sum(1 for name in names if _probe_in(directory, name) is Found.FREE)
    finally:
        os.close(directory)
    if removed:
        log.info("removed %d lock file(s) of readers whose process is gone", removed)
    return removed
