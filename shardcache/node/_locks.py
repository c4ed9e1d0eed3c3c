"""flock-based locks that work across threads and processes and vanish with their owner.

Every lock here is a `flock` on a file in a tier directory. A flock belongs to an open
file description, so two `os.open` calls in one process conflict exactly like two
processes do: that is what makes the same code thread-safe without a second mechanism.
The kernel drops the lock when the last descriptor closes, including on SIGKILL, so a
dead process never leaves a lock behind.

A forked child (a DataLoader worker) gets a copy of every descriptor, and a copy refers
to the same open file description, so the child would hold each lock its parent held at
the fork for as long as it ran: a lease the parent released still pinned, and the tier
lock a parent's thread held at that instant never let go, so the parent's next insert
waited forever. Every descriptor that holds or will hold a lock is therefore opened and
closed through `open_for_lock` and `close`, which keep a set of them, and a forked child
points each one at /dev/null at once (`dup2`: the number stays taken, so whoever owned
it closes that, never a file the child opened since; the parent's locks stay).

Lock files may be unlinked while someone waits on them (an evicted entry's lock file
goes with it). A waiter that opened the old file would then hold a lock nobody else
can see, so every acquisition checks, once locked, that the path still names the inode
it locked, and starts again otherwise.

Anyone sharing a tier directory can put something else at a lock file's name. A FIFO
there blocked `os.open` for reading until a writer came, which was never: with
`_open_lock` held across that open, every lock of the process waited behind it (every
tier, lease and fill lock; the trainer's pins). So lock files are opened through
`regular_files.open_regular` (never through a link, never blocking on a FIFO, only a
regular file), and `acquire` removes anything else found at the name, with a WARNING,
and takes the lock on a regular file made in its place.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from shardcache import errors
from shardcache.node import regular_files

log = logging.getLogger(__name__)

SHARED = fcntl.LOCK_SH
EXCLUSIVE = fcntl.LOCK_EX
NONBLOCKING = fcntl.LOCK_NB

# Each retry means another process unlinked the file between our open and our lock;
# a thousand in a row means something is deleting lock files in a loop.
_MAX_ATTEMPTS = 1000


#: Every descriptor of this process that holds or may hold a lock (`open_for_lock`);
#: changed under `_open_lock`, which a fork waits for (`_before_fork`). Reentrant: a
#: lease dropped without release() is closed by its finalizer, which the garbage
#: collector may run in the middle of `open_for_lock` on the same thread (a fetch
#: thread deadlocked on itself so, in a CI run, with a plain lock).
_open: set[int] = set()
_open_lock = threading.RLock()


def open_for_lock(path: Path, flags: int, mode: int = 0o644) -> int:
    """`os.open` for a descriptor that will hold a lock: a forked child lets go of it.

    Only a regular file, never through a link: NotRegularFile for anything else. The
    open cannot block (`O_NONBLOCK`: a FIFO without a writer opens at once and is then
    refused), so holding `_open_lock` across it, which makes the descriptor and its
    place in `_open` one step for a fork, never holds up the process's other locks.
    """
    name = os.fspath(path)
    with _open_lock:
        fd = regular_files.open_regular(name, flags, mode)
        _open.add(fd)
    return fd


def close(fd: int) -> None:
    """Close a descriptor `open_for_lock` opened (its lock goes with it)."""
    with _open_lock:
        _open.discard(fd)
        os.close(fd)


def _before_fork() -> None:
    # No descriptor is opened and not yet in the set, or closed and still in it, while
    # the child is made.
    _open_lock.acquire()


def _after_fork_in_parent() -> None:
    _open_lock.release()


def _after_fork_in_child() -> None:
    null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    try:
        for fd in list(_open):  # a finalizer run meanwhile may close one
            with contextlib.suppress(OSError):
                os.dup2(null, fd, inheritable=False)
    finally:
        os.close(null)
    _open.clear()
    _open_lock.release()


os.register_at_fork(
    before=_before_fork,
    after_in_parent=_after_fork_in_parent,
    after_in_child=_after_fork_in_child,
)


def _same_file(fd: int, path: Path) -> bool:
    try:
        on_disk = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (on_disk.st_dev, on_disk.st_ino) == (held.st_dev, held.st_ino)


def acquire(path: Path, operation: int, *, create: bool) -> int | None:
    """Open `path`, flock it with `operation`, and return the descriptor (the lock).

    Returns None if the file does not exist and `create` is false, or if `operation`
    includes NONBLOCKING and someone else holds a conflicting lock. Close the descriptor
    (`close`) to release. Files are opened read-only: flock needs no write access, so
    a reader running as another user can still take a shared lock. Anything but a
    regular file at `path` (a FIFO, a link, a directory) is removed with a WARNING
    first; NotRegularFile if it cannot be.
    """
    flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    removed: set[tuple[int, int] | None] = set()
    for _ in range(_MAX_ATTEMPTS):
        try:
            fd = open_for_lock(path, flags)
        except FileNotFoundError:
            return None
        except regular_files.NotRegularFile as bad:
            # Nobody holds a lock of ours on it (we never open one), so it is only in
            # the way: removed, and the lock is taken on a regular file made in its
            # place (or, without `create`, the name is missing).
            _remove_in_the_way(bad, removed)
            continue
        try:
            fcntl.flock(fd, operation)
        except BlockingIOError:
            close(fd)
            return None
        except BaseException:
            close(fd)
            raise
        if _same_file(fd, path):
            return fd
        close(fd)
    raise errors.CacheError(
        f"could not lock {path}: it was replaced {_MAX_ATTEMPTS} times while locking; "
        "is another program deleting files in the cache directory?"
    )


def _remove_in_the_way(
    bad: regular_files.NotRegularFile, removed: set[tuple[int, int] | None]
) -> None:
    """Remove what `bad` found at a lock file's name; raise `bad` if it stays."""
    if bad.ident in removed:
        raise bad  # removed once and there again, or not removable (rmtree's errors)
    removed.add(bad.ident)
    try:
        gone = regular_files.remove_found(bad)
    except OSError as exc:
        raise errors.CacheError(f"{bad}, and removing it failed: {exc}") from exc
    if gone:
        log.warning(
            "removed %s: it was %s where a lock file belongs (put there by hand or by "
            "another program sharing the directory); a regular lock file takes its place",
            bad.path,
            bad.what,
        )


def lock(fd: int, operation: int) -> None:
    """flock an already open descriptor (a file this process just created)."""
    fcntl.flock(fd, operation)


def unlink_held(fd: int, path: Path) -> None:
    """Unlink the lock file `path` if it is still the file locked by `fd`.

    Call this while holding an exclusive lock; waiters notice the unlink when they get
    the lock (see `acquire`) and open the path again.
    """
    if _same_file(fd, path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@contextlib.contextmanager
def held(path: Path, operation: int) -> Iterator[int]:
    """Hold a blocking lock on `path` (created if missing) for the `with` block."""
    fd = acquire(path, operation, create=True)
    if fd is None:  # only possible with NONBLOCKING, which callers of held() never pass
        raise errors.CacheError(f"could not lock {path}")
    try:
        yield fd
    finally:
        close(fd)
