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
it locked (itself, not through a symbolic link put there meanwhile), and starts again
otherwise. A file renamed over a lock file while it is held cannot be prevented by
anyone who may write the directory; `held` says so at release (an ERROR), since a
process that locked the new file meanwhile ran beside the holder.

Anyone sharing a tier directory can put something else at a lock file's name. A FIFO
there blocked `os.open` for reading until a writer came, which was never: with
`_open_lock` held across that open, every lock of the process waited behind it (every
tier, lease and fill lock; the trainer's pins). So lock files are opened through
`regular_files.open_regular` (never through a link, never blocking on a FIFO, only a
regular file), and `acquire` removes anything else found at the name, with a WARNING,
and takes the lock on a regular file made in its place.

A process that holds a lock and stops (SIGSTOP, a debugger, a hung NFS or disk write
in D state) keeps it for as long as it is stopped: the kernel drops it only when the
process dies. Every sidecar sharing the directory then waited in `flock` forever, on
each insert, count and metrics scrape, and a new sidecar never passed its start-up
check. So a wait may be bounded (`timeout`): the lock is tried without blocking until
it is free or the time is up, and then `LockTimeout` names the lock file and its
holders as /proc/locks shows them (pid, state, command), so that the caller fails that
one operation with the reason and goes on serving what needs no lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
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

#: How long a bounded wait sleeps between tries at most: a lock held for the usual
#: instant is taken within a millisecond or two, one held longer costs no busy loop.
_MAX_POLL_S = 0.05


class LockTimeout(errors.CacheError, TimeoutError):
    """A lock was held by another process for longer than the wait allowed.

    A TimeoutError, hence an OSError, too: callers that already treat a tier
    directory's OSError as "this tier fails now" (a metrics scrape, the sidecar's
    start-up check) do so for a lock stuck behind a frozen process as well."""

    def __init__(
        self,
        path: Path,
        waited: float,
        holders: list[str],
        *,
        pids: frozenset[int] = frozenset(),
        ident: tuple[int, int] | None = None,
    ) -> None:
        who = "; ".join(holders) if holders else "no holder found in /proc/locks"
        super().__init__(
            f"could not lock {path} within {waited:g} s: held by {who}. A process that "
            "is stopped (SIGSTOP, a debugger) or stuck in the kernel (state D) holds it "
            "until it runs or dies"
        )
        self.path = path
        self.waited = waited
        self.holders = holders
        #: The holders' pids as this process sees them (0: another PID namespace's).
        self.pids = pids
        #: (st_dev, st_ino) of the file waited on, for `unlink_waited_on`.
        self.ident = ident


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
        # Not through a link: one put at the name, leading to the file locked here,
        # would pass, and the next process (which never opens a link) would remove it
        # and lock a new file, both then holding "the" lock.
        on_disk = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (on_disk.st_dev, on_disk.st_ino) == (held.st_dev, held.st_ino)


def process_stat(pid: int) -> tuple[str, str]:
    """A process's command and state letter ("T": stopped) from /proc/<pid>/stat;
    OSError if it cannot be read (gone, or not in this PID namespace). The command is
    between the first "(" and the last ")": it may hold either."""
    with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as stat_file:
        text = stat_file.read()
    end = text.rfind(")")
    return text[text.find("(") + 1 : end], text[end + 2 : end + 3]


def _state(pid: int) -> str:
    """A process's state and command from /proc/<pid>/stat, in words."""
    try:
        comm, state = process_stat(pid)
    except OSError:
        return "not visible here"
    words = {
        "T": "stopped",
        "t": "stopped by a debugger",
        "D": "in uninterruptible sleep (D)",
        "Z": "a zombie",
    }.get(state, f"state {state}")
    return f"{comm}, {words}"


def _holders(fd: int) -> list[tuple[int, str]]:
    """Who holds a lock on the file open as `fd` (`holders_in` of /proc/locks)."""
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as locks_file:
            locks_text = locks_file.read()
    except OSError:
        return []
    return holders_in(locks_text, os.fstat(fd))


def holders_in(locks_text: str, st: os.stat_result) -> list[tuple[int, str]]:
    """The holders of a lock on the file of `st` in `locks_text` (/proc/locks' format),
    each a pid and "pid 123 (python, stopped), exclusive"; waiters ("->") are not
    holders. A pid of 0 is a process of another PID namespace (another pod's sidecar),
    which this one cannot name."""
    wanted = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    found = []
    for line in locks_text.splitlines():
        fields = line.split()
        if len(fields) < 6 or fields[1] == "->":  # "->": a waiter, not a holder
            continue
        try:
            major, minor, inode = fields[5].split(":")
            ident = (int(major, 16), int(minor, 16), int(inode))
            pid = int(fields[4])
        except ValueError:
            continue
        if ident != wanted:
            continue
        kind = "exclusive" if fields[3] == "WRITE" else "shared"
        if pid <= 0:
            found.append((0, f"a process of another PID namespace (another pod), {kind}"))
        else:
            found.append((pid, f"pid {pid} ({_state(pid)}), {kind}"))
    return found


def _flock_within(fd: int, operation: int, path: Path, timeout: float) -> None:
    """flock `fd` with `operation`, waiting at most `timeout` s; LockTimeout after."""
    deadline = time.monotonic() + timeout
    pause = 0.001
    while True:
        try:
            fcntl.flock(fd, operation | NONBLOCKING)
            return
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                found = _holders(fd)
                st = os.fstat(fd)
                raise LockTimeout(
                    path,
                    timeout,
                    [words for _, words in found],
                    pids=frozenset(pid for pid, _ in found),
                    ident=(st.st_dev, st.st_ino),
                ) from None
            time.sleep(min(pause, left))
            pause = min(pause * 2, _MAX_POLL_S)


def acquire(
    path: Path, operation: int, *, create: bool, timeout: float | None = None
) -> int | None:
    """Open `path`, flock it with `operation`, and return the descriptor (the lock).

    Returns None if the file does not exist and `create` is false, or if `operation`
    includes NONBLOCKING and someone else holds a conflicting lock. Close the descriptor
    (`close`) to release. Files are opened read-only: flock needs no write access, so
    a reader running as another user can still take a shared lock. Anything but a
    regular file at `path` (a FIFO, a link, a directory) is removed with a WARNING
    first; NotRegularFile if it cannot be.

    `timeout`: a blocking `operation` waits at most so many seconds, then raises
    LockTimeout naming the holders; None waits as long as it takes.
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
            if timeout is None or operation & NONBLOCKING:
                fcntl.flock(fd, operation)
            else:
                _flock_within(fd, operation, path, timeout)
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


def unlink_waited_on(timed_out: LockTimeout) -> bool:
    """Unlink the lock file a wait timed out on, if its name still holds that very file:
    whoever locks the name next locks a new file, and its holder keeps a lock nobody
    waits on. Only for a lock that guards no shared state (a fill lock: its holder's
    work is done again, never undone). Whether it was unlinked (not when replaced
    meanwhile, or another user's in a directory with the sticky bit)."""
    try:
        st = os.lstat(timed_out.path)
    except FileNotFoundError:
        return False
    if (st.st_dev, st.st_ino) != timed_out.ident:
        return False
    try:
        os.unlink(timed_out.path)
    except (FileNotFoundError, PermissionError):
        return False
    return True


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
def held(path: Path, operation: int, *, timeout: float | None = None) -> Iterator[int]:
    """Hold a blocking lock on `path` (created if missing) for the `with` block; waited
    for at most `timeout` s (LockTimeout), or as long as it takes (None)."""
    fd = acquire(path, operation, create=True, timeout=timeout)
    if fd is None:  # only possible with NONBLOCKING, which callers of held() never pass
        raise errors.CacheError(f"could not lock {path}")
    try:
        yield fd
    finally:
        try:
            if not _same_file(fd, path):
                log.error(
                    "%s was replaced or removed while this process held it: a process that "
                    "locked it since may have run at the same time (is another program "
                    "writing the cache directory?)",
                    path,
                )
        finally:
            close(fd)
