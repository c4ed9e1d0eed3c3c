"""Whether this process can use a tier directory at all, and if not, who may.

A tier finds out lazily: its directory is first written by an insert, its `.tier.lock`
first opened by a lookup or a size count. A process that may not write the directory
(a node directory nobody prepared for its user) then fails every shard and every
count, and each failure names one file, not the cause. `unusable` tries what every
tier operation needs once, up front, and says what it found: the step that failed,
the user it runs as, and the owner and mode of the directory (or of the nearest
directory above it that exists, when it could not be made).
"""

from __future__ import annotations

import dataclasses
import os
import stat
from pathlib import Path

from shardcache.node import _locks, names
from shardcache.node.tiers import _directory, _other_users

#: The key part of the probe's reservation: a zero-byte `.tmp-` file as an insert
#: makes one (docs/cache-format.md), so a probe left by a process killed between its
#: creation and its removal is reclaimed like any dead writer's.
_PROBE_KEY = "access-probe"

#: How long the check waits for `.tier.lock`, which others hold for an instant: one
#: held longer is held by a stopped or stuck process, which kept the sidecar's start
#: waiting forever, with nothing in /readyz. The check is repeated every few seconds.
LOCK_TIMEOUT_S = 10.0


@dataclasses.dataclass(frozen=True)
class Owner:
    """Owner and mode of a directory, as `stat` found them."""

    path: Path
    uid: int
    gid: int
    mode: int

    def describe(self) -> str:
        return (
            f"owned by uid {self.uid}, gid {self.gid}, mode {stat.S_IMODE(self.mode):04o} "
            f"({stat.filemode(self.mode)})"
        )


@dataclasses.dataclass(frozen=True)
class Unusable:
    """Why this process cannot use the tier directory `path`."""

    path: Path
    #: What failed, e.g. "opening /var/cache/shardcache/.tier.lock".
    step: str
    error: OSError
    uid: int
    gid: int
    #: Supplementary groups of the process (a group-writable directory needs one).
    groups: tuple[int, ...]
    #: The directory, or the nearest one above it that exists; None if none could be read.
    owner: Owner | None
    #: The tier lock, when it is there and this process may not open it (a process of
    #: another user made it with a restrictive umask): what to remove, not the directory.
    lock_owner: Owner | None = None

    def describe(self) -> str:
        """One sentence naming the directory, the step and error, the process's user and
        the directory's owner and mode."""
        others = ", ".join(str(g) for g in self.groups if g != self.gid)
        who = f"uid {self.uid}, gid {self.gid}" + (
            f", groups {others}" if others else ", no other groups"
        )
        if self.owner is None:
            where = "its owner could not be read"
        elif self.owner.path == self.path:
            where = f"it is {self.owner.describe()}"
        else:
            where = f"it does not exist and {self.owner.path} is {self.owner.describe()}"
        text = (
            f"{self.step} failed ({type(self.error).__name__}: "
            f"{self.error.strerror or self.error}); this process runs as {who}; {where}"
        )
        lock = self.lock_owner
        if lock is not None:
            text += (
                f"; the tier lock {lock.path} is {lock.describe()}: a process of uid "
                f"{lock.uid} made it with a restrictive umask (this version makes it 0644). "
                f"Remove that file (rm {lock.path}): safe once no process of uid "
                f"{lock.uid} uses the directory, whose entries this sidecar then replaces"
            )
        return text


def _owner(path: Path) -> Owner | None:
    for candidate in (path, *path.parents):
        try:
            st = os.stat(candidate)
        except OSError:
            continue
        return Owner(candidate, st.st_uid, st.st_gid, st.st_mode)
    return None


def _try(root: Path, lock_timeout: float | None) -> tuple[str, OSError] | None:
    step = f"creating the directory {root}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = root / names.TIER_LOCK_NAME
        step = f"opening {lock}"
        with _locks.held(lock, _locks.SHARED, timeout=lock_timeout):
            # Under the shared tier lock, as an insert reserves: a scan reclaiming dead
            # writers' temp files holds it exclusively, so it never takes this one.
            step = f"creating a file in {root}"
            path, fd = _directory.Directory(root, name="probe").create_reservation(_PROBE_KEY, 0)
            try:
                _directory.unlink(path)
            finally:
                _locks.close(fd)
    except _locks.LockTimeout as exc:
        return f"locking {root / names.TIER_LOCK_NAME}", exc
    except OSError as exc:
        return step, exc
    return None


def unusable(root: Path, *, lock_timeout: float | None = LOCK_TIMEOUT_S) -> Unusable | None:
    """None when this process can make `root`, open and lock its `.tier.lock` (waiting
    at most `lock_timeout` s) and create and remove a file in it (all a tier does to
    it); else what failed, and who may."""
    failed = _try(Path(root), lock_timeout)
    if failed is None:
        return None
    step, exc = failed
    lock_owner = None
    lock = Path(root) / names.TIER_LOCK_NAME
    if isinstance(exc, PermissionError) and step == f"opening {lock}":
        try:
            st = os.stat(lock)
        except OSError:
            pass  # not there (the directory is not writable), or not reachable
        else:
            if not _other_users.readable(st):
                lock_owner = Owner(lock, st.st_uid, st.st_gid, st.st_mode)
    return Unusable(
        path=Path(root),
        step=step,
        error=exc,
        uid=os.geteuid(),
        gid=os.getegid(),
        groups=tuple(os.getgroups()),
        owner=_owner(Path(root)),
        lock_owner=lock_owner,
    )
