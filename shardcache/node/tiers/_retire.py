"""Taking a whole tier directory out of use: renamed aside, under its tier lock, only
while no process uses it.

The node disk tier is one directory per namespace (`ns-<namespace>`) below the node
path, and only that namespace's sidecars ever evict from it: once the namespace is
deleted nothing would. The node-cache DaemonSet's reclaim (`shardcache_operator.
node_reclaim`) removes such a directory, and this is the part that must agree with
the tiers' own locking (package docstring):

* the tier lock `.tier.lock`, taken exclusively and without waiting: a process
  counting, reserving, committing or evicting holds it, so none is half done;
* every lease and fill lock (`<key>.lock`, `<key>.fill.lock`) and every live limit
  declaration (`.limits/*.lock`), each tried exclusively without waiting: one held
  means a live process (a reader's lease, a fill, a sidecar that inserted) uses the
  tier, and the directory is left for a later round;
* then, still under the tier lock, one `rename` to a dot name beside it, which no
  sidecar mounts and no tier lists: a sidecar started later (a namespace recreated
  with the same name) gets a new, empty directory from the kubelet, never one half
  removed. The caller removes the renamed copy at leisure.

The directory is opened once, without following a link (`O_NOFOLLOW`), and everything
after is done through that descriptor, so a link put at its name is never followed.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from pathlib import Path

from shardcache import errors
from shardcache.node import _locks, names, regular_files
from shardcache.node.tiers import _limits

_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _held(path: Path) -> bool:
    """Whether a live process holds a flock on the lock file `path` (a name that is not
    a regular file, or is gone, is held by nobody)."""
    try:
        fd = _locks.open_for_lock(path, os.O_RDONLY | regular_files.SAFE_FLAGS)
    except (FileNotFoundError, regular_files.NotRegularFile):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        _locks.close(fd)
    return False


def _user(tier: Path) -> str | None:
    """The first lock of `tier` a live process holds, by name, or None."""
    candidates = [
        tier / entry.name
        for entry in os.scandir(tier)
        if entry.name.endswith(names.LOCK_SUFFIX) and entry.name != names.TIER_LOCK_NAME
    ]
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        limits = tier / _limits.DIRECTORY
        candidates += [limits / n for n in os.listdir(limits) if n.endswith(names.LOCK_SUFFIX)]
    return next((p.relative_to(tier).as_posix() for p in candidates if _held(p)), None)


def move_aside_unused(root: Path, name: str, aside: str) -> str | None:
    """Rename the tier directory `root/name` to `root/aside` if no process uses it.

    Returns None once renamed, else why it was left where it is ("its tier lock is
    held", "a process holds <key>.lock", "a symbolic link, not a directory"). `name`
    and `aside` must be single path components; `aside` must not exist."""
    for component in (name, aside):
        if not component or "/" in component or component in (".", ".."):
            raise errors.InputError(
                f"a tier directory's name must be one path component, found {component!r}"
            )
    root_fd = os.open(root, _DIRECTORY_FLAGS)
    try:
        try:
            tier_fd = os.open(name, _DIRECTORY_FLAGS, dir_fd=root_fd)
        except OSError as exc:
            if isinstance(exc, FileNotFoundError):
                return "gone already"
            with contextlib.suppress(OSError):
                found = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
                return f"{regular_files.kind(found.st_mode)}, not a directory: left alone"
            return f"could not be opened as a directory ({exc}): left alone"
        try:
            return _move_aside_locked(root_fd, tier_fd, name, aside)
        finally:
            os.close(tier_fd)
    finally:
        os.close(root_fd)


def _move_aside_locked(root_fd: int, tier_fd: int, name: str, aside: str) -> str | None:
    # The open directory, by descriptor: whatever is put at `name` meanwhile, every
    # lock below is tried in the directory that was opened.
    tier = Path(f"/proc/self/fd/{tier_fd}")
    lock = _locks.acquire(
        tier / names.TIER_LOCK_NAME, _locks.EXCLUSIVE | _locks.NONBLOCKING, create=True
    )
    if lock is None:
        return "its tier lock is held"
    try:
        user = _user(tier)
        if user is not None:
            return f"a process holds {user}"
        os.rename(name, aside, src_dir_fd=root_fd, dst_dir_fd=root_fd)
        moved = os.stat(aside, dir_fd=root_fd, follow_symlinks=False)
        opened = os.fstat(tier_fd)
        if not stat.S_ISDIR(moved.st_mode) or (moved.st_dev, moved.st_ino) != (
            opened.st_dev,
            opened.st_ino,
        ):
            # Something replaced the directory between the open and the rename (only a
            # writer of the node path itself could): put it back, remove nothing.
            os.rename(aside, name, src_dir_fd=root_fd, dst_dir_fd=root_fd)
            return "it was replaced while being checked: left alone"
        return None
    finally:
        _locks.close(lock)
