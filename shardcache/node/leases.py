"""A memory-tier entry pinned by the trainer process itself, with a file lock.

In sidecar mode the sidecar acquires a shard, then hands it over: the trainer takes a
shared `flock` on the entry's lock file in the shared memory directory, and the sidecar
drops its own hold. From then on the pin belongs to the trainer's process:

* eviction takes an entry only when it can lock the file exclusively, so a shard the
  trainer reads is never evicted;
* the kernel drops the lock when the trainer dies (even by SIGKILL), so a dead trainer
  never leaks a pin;
* the lock and the trainer's memory maps live in the kernel, not in the sidecar, so they
  survive a sidecar SIGKILL and restart.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import threading
import weakref
from pathlib import Path

from shardcache.node import _locks


class PinnedEntry:
    """A shared lock on one memory-tier entry, held until `release()` (idempotent)."""

    def __init__(self, path: Path, lock_path: Path, fd: int) -> None:
        self._path = path
        self._lock_path = lock_path
        self._fd: int | None = fd
        self._mutex = threading.Lock()
        # A lease dropped without release() must still unpin, or the entry stays
        # unevictable for the life of the trainer.
        self._finalizer = weakref.finalize(self, _close_quietly, fd)

    @property
    def path(self) -> Path:
        return self._path

    @property
    def lock_path(self) -> Path:
        return self._lock_path

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        with self._mutex:
            if self._fd is None:
                return
            self._fd = None
            # Closing the descriptor drops the flock; mappings of the data file stay valid.
            self._finalizer()

    def __repr__(self) -> str:
        return f"PinnedEntry({str(self._path)!r}, held={self.held})"


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        _locks.close(fd)


def pin(path: Path, lock_path: Path, size: int | None = None) -> PinnedEntry | None:
    """Take a shared lock on the entry whose data file is `path`.

    Returns None when the entry is gone or was replaced between the sidecar's answer and
    this call (the lock file no longer names the file we locked, or the data file is
    missing, or, given `size`, is not `size` bytes long): the caller asks the sidecar
    again. Never creates files, nor removes any: a lock file that is not a regular file
    (a FIFO, a link: the trainer's own processes put it there) is NotRegularFile, a
    CacheError naming it, never a wait (`regular_files`).
    """
    try:
        fd = _locks.open_for_lock(lock_path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        # Blocks only while an evictor holds the lock exclusively, which is brief; after
        # it the entry is gone and the identity check below says so.
        fcntl.flock(fd, fcntl.LOCK_SH)
        locked = os.fstat(fd)
        try:
            current = os.stat(lock_path)
        except FileNotFoundError:
            current = None
        same = current is not None and (current.st_dev, current.st_ino) == (
            locked.st_dev,
            locked.st_ino,
        )
        if not same or not _is_entry_data(path, size):
            _close_quietly(fd)
            return None
    except BaseException:
        _close_quietly(fd)
        raise
    return PinnedEntry(path, lock_path, fd)


def _is_entry_data(path: Path, size: int | None) -> bool:
    try:
        st = os.lstat(path)  # a link is not the entry, whatever it points to
    except FileNotFoundError:
        return False
    return stat.S_ISREG(st.st_mode) and (size is None or st.st_size == size)
