"""The files of one tier directory, by name: paths of a key, listing, reservations.

Every name here is specified in docs/cache-format.md and defined once in
`shardcache.node.names`. Nothing in this module decides what to keep or evict; it only
says what is on disk and creates or removes single files, under locks the caller holds
where a docstring says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import time
from pathlib import Path

from shardcache.node import _locks, names, regular_files
from shardcache.node.tiers import _entries, _other_users

# One logger for the whole package, as before it was split into modules.
logger = logging.getLogger("shardcache.node.tiers")


@dataclasses.dataclass
class Listing:
    """One pass over the tier directory, classified by file name."""

    data: dict[str, os.stat_result] = dataclasses.field(default_factory=dict)
    meta: set[str] = dataclasses.field(default_factory=set)
    leases: set[str] = dataclasses.field(default_factory=set)
    fills: set[str] = dataclasses.field(default_factory=set)
    tmp: dict[str, int] = dataclasses.field(default_factory=dict)  # name -> bytes counted
    tmp_meta: set[str] = dataclasses.field(default_factory=set)

    @property
    def reserved(self) -> int:
        return sum(self.tmp.values())

    @property
    def used(self) -> int:
        """What counts against the limit: the tier's own data files (`own`) and the
        reservations. A file named like a key that the tier did not make is neither
        counted nor ever removed (docs/security.md)."""
        return sum(st.st_size for st in self.own().values()) + self.reserved

    def committed(self) -> dict[str, os.stat_result]:
        return {key: st for key, st in self.data.items() if key in self.meta}

    def orphans(self) -> dict[str, os.stat_result]:
        """Data files without a meta file but with a lease lock file: what a process
        killed between a commit's two renames, or between an eviction's two unlinks,
        left (both take `<key>.lock` first and remove it last). A file named like a key
        with neither is not the tier's."""
        return {
            key: st for key, st in self.data.items() if key not in self.meta and key in self.leases
        }

    def own(self) -> dict[str, os.stat_result]:
        """The data files this tier made: committed entries and orphans."""
        return {key: st for key, st in self.data.items() if key in self.meta or key in self.leases}

    def foreign(self) -> int:
        """Bytes of files named like keys that are not the tier's (`own`)."""
        own = self.own()
        return sum(st.st_size for key, st in self.data.items() if key not in own)


def reserved_size(tmp_name: str) -> int:
    """The size a temp file reserves, from its name `.tmp-<pid>-<token>-<size>-<key>`."""
    parts = tmp_name[len(names.TMP_PREFIX) :].split("-", 3)
    try:
        return int(parts[2])
    except (IndexError, ValueError):
        return 0


def unlink(path: Path) -> bool:
    """Remove a file (or a link, a FIFO, a directory with all in it, where someone put
    one in a tier file's place: `regular_files`); whether it was there."""
    return regular_files.remove(path)


def replace(source: Path, target: Path, *, tier: str) -> None:
    """`os.replace(source, target)`, first removing a directory at `target` (a file is
    never renamed over one, and it would make the key fail for good). Another user's
    file at `target` in a directory with the sticky bit cannot be replaced:
    `_other_users.Unremovable` names it, its owner and the fix, instead of a bare
    PermissionError."""
    try:
        os.replace(source, target)
    except PermissionError as exc:
        raise _unreplaceable(target, exc, tier=tier) from exc
    except IsADirectoryError:
        logger.warning("removing the directory %s, which was in a tier file's place", target)
        regular_files.remove(target)
        os.replace(source, target)


def _unreplaceable(target: Path, exc: PermissionError, *, tier: str) -> Exception:
    try:
        st = os.lstat(target)
    except OSError:
        return exc
    if st.st_uid == os.geteuid():
        return exc
    return _other_users.Unremovable(
        f"{tier} tier: cannot replace {target} ({_other_users.describe(st)}): "
        f"{exc.strerror}: {_other_users.directory(target.parent)}. The key cannot be "
        f"cached here until that file is gone: remove it as uid {st.st_uid} or root, "
        f"and let the directory's users replace each other's files (mode 2770 without "
        f"the sticky bit: chmod -t {target.parent})"
    )


#: A temp file this process may not open (`_other_users`) is a dead writer's once it
#: has not been written for this long: a producer writes as its bytes arrive.
UNREADABLE_TMP_STALE_S = 3600

#: Entries whose paths are kept (a dataset's shards, many times over); beyond, start over.
_KNOWN_PATHS = 65536


class Directory:
    """The files of the tier named `name` (used in log messages) under `root`."""

    def __init__(self, root: Path, *, name: str, lock_timeout: float | None = None) -> None:
        self.root = root
        self.name = name
        self.tier_lock = root / names.TIER_LOCK_NAME
        #: How long a wait for `.tier.lock` lasts before it fails (`_locks.LockTimeout`);
        #: None waits as long as it takes.
        self.lock_timeout = lock_timeout
        self._prefix = os.path.join(os.fspath(root), "")
        self._known: dict[str, tuple[Path, Path, Path]] = {}

    def tier_locked(
        self, operation: int, *, timeout: float | None = None
    ) -> contextlib.AbstractContextManager[int]:
        """`.tier.lock` held with `operation` for a `with` block, waited for at most
        `timeout` s (this directory's `lock_timeout` if None)."""
        wait = self.lock_timeout if timeout is None else timeout
        return _locks.held(self.tier_lock, operation, timeout=wait)

    def data(self, key: str) -> Path:
        return self._paths(key)[0]

    def meta(self, key: str) -> Path:
        return self._paths(key)[1]

    def lease(self, key: str) -> Path:
        return self._paths(key)[2]

    def _paths(self, key: str) -> tuple[Path, Path, Path]:
        """An entry's data, meta and lease paths, built once per key: a lookup uses each
        several times, and building a `Path` cost more than the system calls on it."""
        paths = self._known.get(key)
        if paths is None:
            if len(self._known) >= _KNOWN_PATHS:
                self._known.clear()
            paths = self._known[key] = (
                self.root / key,
                self.root / (key + names.META_SUFFIX),
                self.root / (key + names.LOCK_SUFFIX),
            )
        return paths

    def fill(self, key: str) -> Path:
        return self.root / (key + names.FILL_LOCK_SUFFIX)

    def committed(self, key: str) -> bool:
        """Whether the entry's meta and data files both exist. With string paths: the
        prefetcher asks this for every shard ahead of a reader at every request it
        makes, where building `Path`s cost more than the two stat calls."""
        return os.path.exists(self._prefix + key + names.META_SUFFIX) and os.path.exists(
            self._prefix + key
        )

    def listing(self) -> Listing:
        """Every file of the tier, classified; files removed meanwhile are skipped."""
        listing = Listing()
        with os.scandir(self.root) as it:
            for item in it:
                name = item.name
                try:
                    if not item.is_file(follow_symlinks=False):
                        continue
                    if name.startswith(names.TMP_PREFIX):
                        if name.endswith(names.META_SUFFIX):
                            listing.tmp_meta.add(name)
                        else:
                            st = item.stat(follow_symlinks=False)
                            listing.tmp[name] = max(st.st_size, reserved_size(name))
                    elif name.startswith("."):
                        continue
                    elif name.endswith(names.META_SUFFIX):
                        listing.meta.add(name[: -len(names.META_SUFFIX)])
                    elif name.endswith(names.FILL_LOCK_SUFFIX):
                        listing.fills.add(name[: -len(names.FILL_LOCK_SUFFIX)])
                    elif name.endswith(names.LOCK_SUFFIX):
                        listing.leases.add(name[: -len(names.LOCK_SUFFIX)])
                    elif _entries.KEY_PATTERN.fullmatch(name):
                        listing.data[name] = item.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # removed while we listed
        return listing

    def reclaim_tmp(self, listing: Listing) -> int:
        """Remove temp files whose writer died; call with the tier lock held exclusively.

        A live writer holds an exclusive flock on its temp file from creation (under the
        tier lock) to commit (also under the tier lock), so a temp file we can lock here
        belongs to a dead process. Works across PID namespaces, unlike checking the pid.
        """
        removed = 0
        for name in list(listing.tmp):
            path = self.root / name
            try:
                fd = _locks.acquire(path, _locks.EXCLUSIVE | _locks.NONBLOCKING, create=False)
            except PermissionError:
                # Another user's, made with a restrictive umask: its lock cannot be
                # tried. A live writer keeps writing it; one untouched this long is dead.
                if self._stale(path):
                    unlink(path)
                    del listing.tmp[name]
                    removed += 1
                    logger.warning(
                        "%s tier: removed %s, which this process may not open, untouched "
                        "for over %d s: a dead writer's",
                        self.name, name, UNREADABLE_TMP_STALE_S,
                    )  # fmt: skip
                continue
            if fd is None:
                continue
            try:
                unlink(path)
            finally:
                _locks.close(fd)
            del listing.tmp[name]
            removed += 1
            logger.warning("%s tier: removed %s left by a dead writer", self.name, name)
        for name in list(listing.tmp_meta):
            if name[: -len(names.META_SUFFIX)] not in listing.tmp:
                unlink(self.root / name)
                listing.tmp_meta.discard(name)
        return removed

    @staticmethod
    def _stale(path: Path) -> bool:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return False
        return time.time() - st.st_mtime > UNREADABLE_TMP_STALE_S

    def create_reservation(self, key: str, size: int) -> tuple[Path, int]:
        """Create `.tmp-<pid>-<token>-<size>-<key>`, locked; call under the tier lock."""
        path = self.root / f"{names.TMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{size}-{key}"
        fd = _locks.open_for_lock(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC)
        # Not pre-sized: the size in the name is what counts, and an empty file lets the
        # size check after produce catch a writer that wrote less than it declared.
        try:
            _locks.lock(fd, _locks.EXCLUSIVE)
        except BaseException:
            _locks.close(fd)
            unlink(path)
            raise
        return path, fd

    def write_file(self, path: Path, content: bytes, *, fsync: bool) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            # Readable by the directory's other users whatever the umask (`_other_users`).
            os.fchmod(fd, 0o644)
            view = memoryview(content)
            while view:
                view = view[os.write(fd, view) :]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def fsync(self) -> None:
        """Make renames in the directory durable."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
