"""A storage tier: a byte-limited, LRU, checksummed directory of immutable files.

The disk tier (source bytes, shared by every sidecar on the node) and the memory tier
(decoded Arrow IPC on a memory-backed volume, memory-mapped by trainers) are both a
`Tier`. Several processes may use one directory at once; everything that must agree
between them is on disk and guarded by flock (see `_locks`), never in process memory:

* an entry is a data file `<key>` plus a meta file `<key>.meta.json` (size, sha256,
  format version); it is visible once its meta file is renamed into place;
* a lease is a shared flock on `<key>.lock`, held by `Entry` until released; eviction
  needs an exclusive flock on it, so a leased entry is never evicted, and a dead
  process's leases vanish with it;
* an insert first reserves its bytes as a temp file `.tmp-<pid>-<token>-<size>-<key>`,
  under the tier-wide lock `.tier.lock` that also guards counting and evicting, so the
  total of entries plus reservations never exceeds the limit;
* least recently used is the data file's mtime, which a lookup touches.

The format is specified in docs/cache-format.md; `FORMAT_VERSION` is its version.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import secrets
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Literal, Protocol

from shardcache import contract, errors
from shardcache.node import _locks, names

__all__ = [
    "FILL_LOCK_SUFFIX",
    "FORMAT_VERSION",
    "TIER_LOCK_NAME",
    "Entry",
    "EntryMeta",
    "EntryTooLargeError",
    "IncompatibleFormatError",
    "RoomHeldError",
    "ScanReport",
    "Tier",
    "TierFullError",
    "TierObserver",
    "check_key",
    "mark_used",
    "read_meta",
    "sha256_file",
]

#: Version of the tier directory format (docs/cache-format.md); stored in every meta file.
FORMAT_VERSION = 1

#: The tier-wide lock: held exclusively while counting, evicting, reserving and committing.
TIER_LOCK_NAME = ".tier.lock"
#: Per-key lock held exclusively by the one process producing that key in get_or_insert.
FILL_LOCK_SUFFIX = ".fill.lock"

# Keys become file names; dots are excluded so that `<key>.lock` and friends can never
# collide with another key's data file.
_KEY_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,200}")
# sha256 is streamed in chunks this big: large enough that the per-call overhead is
# negligible, small enough not to matter for memory. hashlib releases the GIL per chunk.
_HASH_CHUNK = 4 * 1024 * 1024
# Backoff while waiting for leases to be released: first poll soon, then settle at a rate
# that costs nothing (each poll lists the directory under the tier lock).
_WAIT_FIRST_S = 0.01
_WAIT_MAX_S = 0.5
# Which setting a user raises when an entry does not fit, by tier name.
_LIMIT_SETTINGS = {"disk": contract.ENV_DISK_LIMIT, "memory": contract.ENV_MEMORY_LIMIT}

logger = logging.getLogger(__name__)


class TierObserver(Protocol):
    """Metrics hooks; the sidecar maps them to Prometheus counters. `tier` is Tier.name."""

    def hit(self, tier: str) -> None: ...

    def miss(self, tier: str) -> None: ...

    def evicted(self, tier: str, nbytes: int) -> None: ...

    def corrupted(self, tier: str, key: str) -> None: ...


class TierFullError(errors.CacheError):
    """An insert with evict=False found no free room (readahead backs off on this)."""


class EntryTooLargeError(errors.CacheError):
    """An entry is bigger than the whole tier: no eviction or wait can ever make room."""

    def __init__(self, message: str, *, size: int, limit: int) -> None:
        super().__init__(message)
        self.size, self.limit = size, limit

    def about(self, what: str) -> EntryTooLargeError:
        """The same error, its message prefixed with what the entry is (e.g. a shard)."""
        return EntryTooLargeError(f"{what}: {self}", size=self.size, limit=self.limit)


class RoomHeldError(TierFullError):
    """An entry does not fit beside the entries its caller holds leases on (`held`).

    Raised at once rather than after `wait_timeout`: only the caller could free that
    room, and it said it will not while it waits.
    """

    def __init__(self, message: str, *, size: int, held: int, limit: int) -> None:
        super().__init__(message)
        self.size, self.held, self.limit = size, held, limit

    def about(self, what: str) -> RoomHeldError:
        """The same error, its message prefixed with what the entry is (e.g. a shard)."""
        return RoomHeldError(f"{what}: {self}", size=self.size, held=self.held, limit=self.limit)


class IncompatibleFormatError(errors.CacheError):
    """A meta file was written in another format version than this code reads."""


@dataclasses.dataclass(frozen=True)
class EntryMeta:
    """Contents of `<key>.meta.json`."""

    key: str
    size: int
    sha256: str
    format_version: int = FORMAT_VERSION

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode() + b"\n"


def read_meta(path: Path, key: str) -> EntryMeta:
    """Read and validate a meta file.

    Raises FileNotFoundError if it is missing, IncompatibleFormatError if it has another
    format_version, and CacheError if it is not a valid meta file for `key`.
    """
    raw = path.read_bytes()
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise errors.CacheError(f"meta file {path} is not JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise errors.CacheError(f"meta file {path}: expected a JSON object, found {raw[:80]!r}")
    version = doc.get("format_version")
    if version != FORMAT_VERSION:
        raise IncompatibleFormatError(
            f"meta file {path} has format_version {version!r}, expected {FORMAT_VERSION}: it "
            "was written by another version of shardcache sharing this cache directory"
        )
    size, sha256 = doc.get("size"), doc.get("sha256")
    if doc.get("key") != key:
        raise errors.CacheError(f"meta file {path} is for key {doc.get('key')!r}, expected {key!r}")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise errors.CacheError(f"meta file {path}: expected a size >= 0, found {size!r}")
    if not isinstance(sha256, str) or not re.fullmatch(r"[0-9a-f]{64}", sha256):
        raise errors.CacheError(f"meta file {path}: expected a hex sha256, found {sha256!r}")
    return EntryMeta(key=key, size=size, sha256=sha256)


def check_key(key: str) -> None:
    """Raise InputError unless `key` can name an entry (it becomes a file name)."""
    if not isinstance(key, str) or not _KEY_PATTERN.fullmatch(key):
        raise errors.InputError(
            f"cache key must be 1-200 characters of A-Z a-z 0-9 _ - (a content hash), found {key!r}"
        )


def sha256_file(path: Path, *, fsync: bool = False) -> str:
    """sha256 of a file, streamed; optionally fsync it through the same descriptor."""
    digest = hashlib.sha256()
    buffer = bytearray(_HASH_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
        if fsync:
            os.fsync(f.fileno())
    return digest.hexdigest()


class Entry:
    """A lease on one committed entry: while held, the entry is never evicted.

    A context manager; `release()` is idempotent and thread-safe. The lease is a shared
    flock held by this object's own descriptor, so leases are independent of each other
    even within one process, and the kernel drops them if the process dies.
    """

    def __init__(self, *, key: str, path: Path, size: int, sha256: str, lease_fd: int) -> None:
        self.key = key
        self.path = path
        self.size = size
        self.sha256 = sha256
        # finalize runs at most once, on release() or when the Entry is collected.
        self._finalizer = weakref.finalize(self, os.close, lease_fd)

    @property
    def leased(self) -> bool:
        return self._finalizer.alive

    def release(self) -> None:
        self._finalizer()

    def __enter__(self) -> Entry:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "leased" if self.leased else "released"
        return f"Entry(key={self.key!r}, size={self.size}, {state})"


@dataclasses.dataclass(frozen=True)
class ScanReport:
    """What `Tier.scan` found and did."""

    entries: int  #: valid entries left in the tier
    bytes: int  #: their total size
    verified: int  #: entries whose sha256 was checked (verify == "always")
    removed_tmp: int  #: temp files of dead writers removed
    removed_incomplete: int  #: data without meta (or meta without data) removed
    corrupted: int  #: entries removed because size or sha256 mismatched
    incompatible: int  #: entries removed because their meta is invalid or of another format


_Outcome = Literal["hit", "missing", "corrupted", "incompatible"]


@dataclasses.dataclass
class _Listing:
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
        return sum(st.st_size for st in self.data.values()) + self.reserved

    def committed(self) -> dict[str, os.stat_result]:
        return {key: st for key, st in self.data.items() if key in self.meta}


def _reserved_size(tmp_name: str) -> int:
    """The size a temp file reserves, from its name `.tmp-<pid>-<token>-<size>-<key>`."""
    parts = tmp_name[len(names.TMP_PREFIX) :].split("-", 3)
    try:
        return int(parts[2])
    except (IndexError, ValueError):
        return 0


def mark_used(path: Path) -> None:
    """Mark an entry used now (a lookup, or a trainer that pins an entry it was handed
    before: `sidecar_client`). An explicit time, because the kernel's own (utime with no
    times) is a clock tick coarse, which would make entries used in a burst tie.

    Setting an explicit time needs ownership of the file; an entry written by a process
    of another user gets the kernel's time if we may write it, else keeps its LRU time
    (LRU order is a heuristic; serving the entry matters more).
    """
    now = time.time_ns()
    try:
        os.utime(path, ns=(now, now))
    except PermissionError:
        with contextlib.suppress(PermissionError):
            os.utime(path)


def _unlink(path: Path) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


class Tier:
    """A byte-limited, LRU, checksummed directory of immutable entries (module docstring)."""

    def __init__(
        self,
        root: Path,
        *,
        limit_bytes: int,
        name: str,
        fsync: bool = True,
        verify: Literal["always", "never"] = "always",
        observer: TierObserver | None = None,
        wait_timeout: float = 300.0,
    ) -> None:
        if limit_bytes < 0:
            raise errors.InputError(f"{name} tier limit must be >= 0 bytes, found {limit_bytes}")
        if verify not in ("always", "never"):
            raise errors.InputError(f"verify must be 'always' or 'never', found {verify!r}")
        if wait_timeout < 0:
            raise errors.InputError(f"wait_timeout must be >= 0 s, found {wait_timeout}")
        self.root = Path(root)
        self.limit_bytes = limit_bytes
        self.name = name
        self.fsync = fsync
        self.verify = verify
        self.observer = observer
        self.wait_timeout = wait_timeout
        self.root.mkdir(parents=True, exist_ok=True)
        self._tier_lock = self.root / TIER_LOCK_NAME

    def __repr__(self) -> str:
        return f"Tier(name={self.name!r}, root={str(self.root)!r}, limit_bytes={self.limit_bytes})"

    # --- paths -----------------------------------------------------------------------
    def _data(self, key: str) -> Path:
        return self.root / key

    def _meta(self, key: str) -> Path:
        return self.root / (key + names.META_SUFFIX)

    def _lease(self, key: str) -> Path:
        return self.root / (key + names.LOCK_SUFFIX)

    def _fill(self, key: str) -> Path:
        return self.root / (key + FILL_LOCK_SUFFIX)

    # --- public API --------------------------------------------------------------------
    def lookup(self, key: str) -> Entry | None:
        """Return a leased, verified entry, or None (missing, or corrupted and removed).

        Touches the entry's LRU time. Verification always checks the size, and the full
        sha256 when verify == "always". A bad entry is removed, logged and counted.
        """
        check_key(key)
        entry, _ = self._lookup(key, touch=True)
        self._count_lookup(entry)
        return entry

    def insert(
        self,
        key: str,
        size: int,
        produce: Callable[[Path], object],
        *,
        evict: bool = True,
        held: int = 0,
    ) -> Entry:
        """Reserve `size` bytes, let `produce(tmp_path)` write them, commit, return a lease.

        `produce` must write exactly `size` bytes into `tmp_path` in place (open it for
        writing; do not replace it with another file). Raises EntryTooLargeError (a
        CacheError) if the entry can never fit, and CacheError if leased entries keep the
        room taken for `wait_timeout` seconds; if `produce` raises, the reservation is
        removed and the error propagates. With evict=False nothing is evicted and nothing
        waited for: if the free room is too small, TierFullError is raised at once (for
        readahead, which should not push out entries that are needed sooner).

        `held` is how many bytes of this tier's entries the caller itself holds leases
        on and keeps holding while this insert waits: if `size` does not fit beside
        them, RoomHeldError is raised at once instead of waiting for room only the
        caller could free.
        """
        check_key(key)
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise errors.InputError(f"entry size must be an int >= 0, found {size!r}")
        if size > self.limit_bytes:
            raise EntryTooLargeError(
                f"entry {key} is {size} bytes but the {self.name} tier holds at most "
                f"{self.limit_bytes} bytes; raise {self._limit_setting()} above {size}",
                size=size,
                limit=self.limit_bytes,
            )
        if size + held > self.limit_bytes:
            raise RoomHeldError(
                f"entry {key} ({size} bytes) does not fit beside the {held} bytes its "
                f"caller holds leases on: the {self.name} tier holds at most "
                f"{self.limit_bytes} bytes; release some, or raise {self._limit_setting()}",
                size=size,
                held=held,
                limit=self.limit_bytes,
            )
        tmp_path, tmp_fd = self._reserve(key, size, evict=evict)
        meta_tmp = tmp_path.with_name(tmp_path.name + names.META_SUFFIX)
        committed = False
        try:
            produce(tmp_path)
            try:
                written = os.stat(tmp_path).st_size
            except FileNotFoundError:
                raise errors.CacheError(
                    f"producing {key} for the {self.name} tier removed its temp file {tmp_path}"
                ) from None
            if written != size:
                raise errors.CacheError(
                    f"producing {key} for the {self.name} tier wrote {written} bytes, "
                    f"expected the declared size {size}"
                )
            sha256 = sha256_file(tmp_path, fsync=self.fsync)
            meta = EntryMeta(key=key, size=size, sha256=sha256)
            self._write_file(meta_tmp, meta.to_json())
            lease_fd = self._take_lease(key, create=True)
            try:
                with _locks.held(self._tier_lock, _locks.EXCLUSIVE):
                    # Data first, meta last: the meta rename is the commit point, and a
                    # crash in between leaves data without meta, which is never served.
                    os.replace(tmp_path, self._data(key))
                    os.replace(meta_tmp, self._meta(key))
                    mark_used(self._data(key))  # the newest entry is the last to evict
                committed = True
            finally:
                if not committed:
                    os.close(lease_fd)
        finally:
            if not committed:
                with _locks.held(self._tier_lock, _locks.EXCLUSIVE):
                    _unlink(tmp_path)
                    _unlink(meta_tmp)
            os.close(tmp_fd)
        if self.fsync:
            self._fsync_dir()
        return Entry(key=key, path=self._data(key), size=size, sha256=sha256, lease_fd=lease_fd)

    def get_or_insert(
        self,
        key: str,
        size: int,
        produce: Callable[[Path], object],
        *,
        evict: bool = True,
        held: int = 0,
    ) -> tuple[Entry, bool]:
        """lookup, else insert; one producer per key across threads and processes.

        Returns (entry, hit). A caller that finds another one producing the key waits
        for it (on the per-key fill lock) and then gets its entry. `evict` and `held`
        as in insert.
        """
        check_key(key)
        entry, _ = self._lookup(key, touch=True)
        if entry is None:
            fill_fd = _locks.acquire(self._fill(key), _locks.EXCLUSIVE, create=True)
            assert fill_fd is not None  # blocking acquire with create never returns None
            try:
                entry, _ = self._lookup(key, touch=True)
                if entry is None:
                    self._count_lookup(None)
                    return self.insert(key, size, produce, evict=evict, held=held), False
            finally:
                _locks.unlink_held(fill_fd, self._fill(key))
                os.close(fill_fd)
        self._count_lookup(entry)
        return entry, True

    def contains(self, key: str) -> bool:
        """Whether a committed entry exists (no lease, no verification)."""
        check_key(key)
        return self._meta(key).exists() and self._data(key).exists()

    def keys(self) -> list[str]:
        """Keys of the committed entries, sorted."""
        return sorted(self._list().committed())

    def resident_bytes(self) -> int:
        """Bytes of committed entries in this tier, written by any process."""
        with _locks.held(self._tier_lock, _locks.SHARED):
            return sum(st.st_size for st in self._list().committed().values())

    def used_bytes(self) -> int:
        """What counts against the limit: every data file plus every live reservation."""
        with _locks.held(self._tier_lock, _locks.SHARED):
            return self._list().used

    def leased_bytes(self) -> int:
        """Bytes of entries some process holds a lease on (a snapshot, best effort)."""
        leased = 0
        with _locks.held(self._tier_lock, _locks.EXCLUSIVE):
            for key, st in self._list().committed().items():
                fd = _locks.acquire(
                    self._lease(key), _locks.EXCLUSIVE | _locks.NONBLOCKING, create=False
                )
                if fd is None:
                    leased += st.st_size if self._lease(key).exists() else 0
                else:
                    os.close(fd)
        return leased

    def evict(self, key: str) -> bool:
        """Remove the entry unless it is leased; return whether it was removed."""
        check_key(key)
        with _locks.held(self._tier_lock, _locks.EXCLUSIVE):
            try:
                size = os.stat(self._data(key)).st_size
            except FileNotFoundError:
                size = None
            if size is None and not self._meta(key).exists():
                return False
            return self._remove_unleased(key, size or 0)

    def scan(self) -> ScanReport:
        """Repair the directory at start-up and report what was found.

        Removes temp files of dead writers, data without meta and meta without data
        (unless a live process holds their lease), then checks every entry like lookup
        does (sha256 too when verify == "always") without touching LRU times.
        """
        removed_incomplete = 0
        with _locks.held(self._tier_lock, _locks.EXCLUSIVE):
            listing = self._list()
            removed_tmp = self._reclaim_tmp(listing)
            for key in set(listing.data) | listing.meta | listing.leases:
                if key in listing.data and key in listing.meta:
                    continue
                lock = _locks.acquire(
                    self._lease(key), _locks.EXCLUSIVE | _locks.NONBLOCKING, create=True
                )
                if lock is None:
                    continue  # a live process is committing it or leases it: leave it
                try:
                    removed = _unlink(self._data(key)) | _unlink(self._meta(key))
                    removed_incomplete += removed
                    if removed:
                        logger.warning(
                            "%s tier: removed incomplete entry %s (data or meta file missing)",
                            self.name,
                            key,
                        )
                    _locks.unlink_held(lock, self._lease(key))
                finally:
                    os.close(lock)
            for key in listing.fills:
                fill = _locks.acquire(
                    self._fill(key), _locks.EXCLUSIVE | _locks.NONBLOCKING, create=False
                )
                if fill is not None:
                    _locks.unlink_held(fill, self._fill(key))
                    os.close(fill)
            complete = sorted(listing.committed())
        counts = {"hit": 0, "missing": 0, "corrupted": 0, "incompatible": 0}
        total = 0
        for key in complete:
            entry, outcome = self._lookup(key, touch=False)
            counts[outcome] += 1
            if entry is not None:
                total += entry.size
                entry.release()
        report = ScanReport(
            entries=counts["hit"],
            bytes=total,
            verified=counts["hit"] + counts["corrupted"] if self.verify == "always" else 0,
            removed_tmp=removed_tmp,
            removed_incomplete=removed_incomplete,
            corrupted=counts["corrupted"],
            incompatible=counts["incompatible"],
        )
        logger.info("%s tier scan of %s: %s", self.name, self.root, report)
        return report

    # --- internals -------------------------------------------------------------------
    def _limit_setting(self) -> str:
        return _LIMIT_SETTINGS.get(self.name, f"the {self.name} tier's limit_bytes")

    def _count_lookup(self, entry: Entry | None) -> None:
        if self.observer is not None:
            if entry is None:
                self.observer.miss(self.name)
            else:
                self.observer.hit(self.name)

    def _take_lease(self, key: str, *, create: bool) -> int:
        fd = _locks.acquire(self._lease(key), _locks.SHARED, create=create)
        if fd is None:
            raise FileNotFoundError(self._lease(key))
        return fd

    def _lookup(self, key: str, *, touch: bool) -> tuple[Entry | None, _Outcome]:
        if not self._meta(key).exists():  # cheap miss without creating a lock file
            return None, "missing"
        lease_fd = _locks.acquire(self._lease(key), _locks.SHARED, create=False)
        if lease_fd is None:
            return None, "missing"  # evicted since we looked
        try:
            try:
                meta: EntryMeta | None = read_meta(self._meta(key), key)
                problem = ""
            except FileNotFoundError:
                os.close(lease_fd)
                return None, "missing"
            except errors.CacheError as exc:
                meta, problem = None, str(exc)
            try:
                st = os.stat(self._data(key))
                data_id: tuple[int, int] | None = (st.st_dev, st.st_ino)
            except FileNotFoundError:
                data_id = None
            if meta is None:
                self._discard(key, lease_fd, data_id, problem, corrupted=False)
                return None, "incompatible"
            if data_id is None:
                self._discard(key, lease_fd, None, "its data file is missing", corrupted=True)
                return None, "corrupted"
            if st.st_size != meta.size:
                why = f"size {st.st_size} bytes, expected {meta.size} (truncated or overwritten)"
                self._discard(key, lease_fd, data_id, why, corrupted=True)
                return None, "corrupted"
            if self.verify == "always":
                found = sha256_file(self._data(key))
                if found != meta.sha256:
                    why = f"sha256 {found}, expected {meta.sha256} (corrupted)"
                    self._discard(key, lease_fd, data_id, why, corrupted=True)
                    return None, "corrupted"
            if touch:
                try:
                    mark_used(self._data(key))
                except FileNotFoundError:  # another process found it corrupted meanwhile
                    os.close(lease_fd)
                    return None, "missing"
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(lease_fd)
            raise
        entry = Entry(
            key=key, path=self._data(key), size=meta.size, sha256=meta.sha256, lease_fd=lease_fd
        )
        return entry, "hit"

    def _discard(
        self,
        key: str,
        lease_fd: int,
        data_id: tuple[int, int] | None,
        why: str,
        *,
        corrupted: bool,
    ) -> None:
        """Remove a bad entry we hold a lease on, and release that lease.

        Only the data and meta files go; the lease lock file stays, because other
        processes may hold leases on it and a new lock file would split them from the
        next writer. The data file is removed only if it is still the one we examined,
        so a good entry committed meanwhile by someone else survives.
        """
        try:
            logger.warning(
                "%s tier: removing entry %s from %s: %s; it will be produced again",
                self.name,
                key,
                self.root,
                why,
            )
            if corrupted and self.observer is not None:
                self.observer.corrupted(self.name, key)
            with _locks.held(self._tier_lock, _locks.EXCLUSIVE):
                try:
                    st = os.stat(self._data(key))
                    current: tuple[int, int] | None = (st.st_dev, st.st_ino)
                except FileNotFoundError:
                    current = None
                if current == data_id:
                    _unlink(self._meta(key))
                    if current is not None:
                        _unlink(self._data(key))
        finally:
            os.close(lease_fd)

    def _list(self) -> _Listing:
        listing = _Listing()
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
                            listing.tmp[name] = max(st.st_size, _reserved_size(name))
                    elif name.startswith("."):
                        continue
                    elif name.endswith(names.META_SUFFIX):
                        listing.meta.add(name[: -len(names.META_SUFFIX)])
                    elif name.endswith(FILL_LOCK_SUFFIX):
                        listing.fills.add(name[: -len(FILL_LOCK_SUFFIX)])
                    elif name.endswith(names.LOCK_SUFFIX):
                        listing.leases.add(name[: -len(names.LOCK_SUFFIX)])
                    elif _KEY_PATTERN.fullmatch(name):
                        listing.data[name] = item.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # removed while we listed
        return listing

    def _reclaim_tmp(self, listing: _Listing) -> int:
        """Remove temp files whose writer died; call with the tier lock held exclusively.

        A live writer holds an exclusive flock on its temp file from creation (under the
        tier lock) to commit (also under the tier lock), so a temp file we can lock here
        belongs to a dead process. Works across PID namespaces, unlike checking the pid.
        """
        removed = 0
        for name in list(listing.tmp):
            path = self.root / name
            fd = _locks.acquire(path, _locks.EXCLUSIVE | _locks.NONBLOCKING, create=False)
            if fd is None:
                continue
            try:
                _unlink(path)
            finally:
                os.close(fd)
            del listing.tmp[name]
            removed += 1
            logger.warning("%s tier: removed %s left by a dead writer", self.name, name)
        for name in list(listing.tmp_meta):
            if name[: -len(names.META_SUFFIX)] not in listing.tmp:
                _unlink(self.root / name)
                listing.tmp_meta.discard(name)
        return removed

    def _remove_unleased(self, key: str, size: int) -> bool:
        """Remove an entry if no lease is held; call with the tier lock held exclusively."""
        lock = _locks.acquire(self._lease(key), _locks.EXCLUSIVE | _locks.NONBLOCKING, create=True)
        if lock is None:
            return False
        try:
            _unlink(self._meta(key))  # uncommit first: a reader never sees data without meta
            _unlink(self._data(key))
            _locks.unlink_held(lock, self._lease(key))
        finally:
            os.close(lock)
        if self.observer is not None:
            self.observer.evicted(self.name, size)
        logger.debug("%s tier: evicted %s (%d bytes)", self.name, key, size)
        return True

    def _reserve(self, key: str, size: int, *, evict: bool) -> tuple[Path, int]:
        """Make room for `size` bytes and reserve them as a locked temp file."""
        deadline = time.monotonic() + self.wait_timeout
        delay = _WAIT_FIRST_S
        warned = False
        while True:
            with _locks.held(self._tier_lock, _locks.EXCLUSIVE):
                listing = self._list()
                self._reclaim_tmp(listing)
                used = listing.used
                leased = 0
                if used + size > self.limit_bytes and not evict:
                    raise TierFullError(
                        f"{self.name} tier has {self.limit_bytes - used} of {self.limit_bytes} "
                        f"bytes free, {key} needs {size}; not evicting (evict=False)"
                    )
                if used + size > self.limit_bytes:
                    # Least recently used first; the key breaks mtime ties deterministically.
                    by_age = sorted(listing.data.items(), key=lambda kv: (kv[1].st_mtime_ns, kv[0]))
                    for victim, st in by_age:
                        if used + size <= self.limit_bytes:
                            break
                        if self._remove_unleased(victim, st.st_size):
                            used -= st.st_size
                        else:
                            leased += st.st_size
                if used + size <= self.limit_bytes:
                    return self._create_reservation(key, size)
                reserved = listing.reserved
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise errors.CacheError(
                    f"{self.name} tier cannot make room for {key} ({size} bytes) within "
                    f"{self.wait_timeout:g} s: limit {self.limit_bytes} bytes, {leased} bytes "
                    f"held by leases, {reserved} bytes reserved by inserts in progress; "
                    f"readers must release entries, or raise {self._limit_setting()}"
                )
            if not warned:
                warned = True
                logger.warning(
                    "%s tier is full: limit %d bytes, %d bytes leased, %d bytes reserved by "
                    "inserts in progress; waiting up to %g s for leases to be released to "
                    "insert %s (%d bytes). Raise %s if this persists.",
                    self.name,
                    self.limit_bytes,
                    leased,
                    reserved,
                    self.wait_timeout,
                    key,
                    size,
                    self._limit_setting(),
                )
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, _WAIT_MAX_S)

    def _create_reservation(self, key: str, size: int) -> tuple[Path, int]:
        """Create `.tmp-<pid>-<token>-<size>-<key>`, locked; call under the tier lock."""
        path = self.root / f"{names.TMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{size}-{key}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        # Not pre-sized: the size in the name is what counts, and an empty file lets the
        # size check after produce catch a writer that wrote less than it declared.
        try:
            _locks.lock(fd, _locks.EXCLUSIVE)
        except BaseException:
            os.close(fd)
            _unlink(path)
            raise
        return path, fd

    def _write_file(self, path: Path, content: bytes) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            view = memoryview(content)
            while view:
                view = view[os.write(fd, view) :]
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _fsync_dir(self) -> None:
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
