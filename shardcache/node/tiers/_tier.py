"""The `Tier` class: lookups, inserts, eviction and start-up repair of one directory.

The package docstring (`shardcache.node.tiers`) says how processes share a tier; the
files are `_directory`, the entry and lease types `_entries`, the eviction order
`_eviction`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal, Protocol

from shardcache import contract, errors, faultpoints
from shardcache.node import _locks, names, regular_files
from shardcache.node.tiers import (
    _directory,
    _entries,
    _errors,
    _eviction,
    _limits,
    _membership,
    _no_space,
    _other_users,
)

# Backoff while waiting for leases to be released: first poll soon, then settle at a rate
# that costs nothing (each poll lists the directory under the tier lock).
_WAIT_FIRST_S = 0.01
_WAIT_MAX_S = 0.5
# Waiting for a full volume to have room polls `statvfs` only (no lock, no listing), and
# the room comes back the moment a reader unmaps: polled more often than leases.
_NO_SPACE_POLL_MAX_S = 0.1
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
# Which setting a user raises when an entry does not fit, by tier name.
_LIMIT_SETTINGS = {"disk": contract.ENV_DISK_LIMIT, "memory": contract.ENV_MEMORY_LIMIT}

# One logger for the whole package, as before it was split into modules.
logger = logging.getLogger("shardcache.node.tiers")


class TierObserver(Protocol):
    """Metrics hooks; the sidecar maps them to Prometheus counters. `tier` is Tier.name."""

    def hit(self, tier: str) -> None: ...

    def miss(self, tier: str) -> None: ...

    def evicted(self, tier: str, nbytes: int) -> None: ...

    def corrupted(self, tier: str, key: str) -> None: ...


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

#: Meta files a tier remembers (`Tier._read_meta`): far more than the entries a tier
#: holds at once (hundreds to thousands of shards), a few MB at most.
_METAS_KEPT = 65536

#: How long an operation waits for `.tier.lock` or an entry's lease lock, which others
#: hold for the instant of a count, an eviction or a commit, before it fails with
#: `_locks.LockTimeout` naming the holder: only a holder that is stopped or stuck holds
#: one this long, and every sidecar of the node waited for it forever.
LOCK_TIMEOUT_S = 60.0


class Tier:
    """A byte-limited, LRU, checksummed directory of immutable entries (package docstring)."""

    def __init__(
        self,
        root: Path,
        *,
        limit_bytes: int,
        name: str,
        fsync: bool = True,
        verify: Literal["always", "never"] = "always",
        hashed: bool = True,
        observer: TierObserver | None = None,
        wait_timeout: float = 300.0,
        sole_writer: bool = False,
        lock_timeout: float | None = LOCK_TIMEOUT_S,
    ) -> None:
        """`hashed=False`: meta files carry no sha256 (null, format version 2) unless the
        producer's caller gives one, and an insert never reads its entry back to hash
        it. Only for a tier that never verifies (verify="never"): the memory tier,
        whose files are decoded from bytes already checked against the manifest.

        `sole_writer=True`: this object is the only one that commits or removes
        entries in `root` (other processes may lease and read them); membership is
        then answered from memory (`contains`, and a lookup's miss) instead of with
        system calls. `_membership` says why that stays exact.

        `lock_timeout`: how long an operation waits for the tier lock or an entry's
        lease lock before it fails with `_locks.LockTimeout` (None: as long as it
        takes). Waiting for another process producing the same key (the fill lock)
        lasts up to `wait_timeout`, after which this one produces it too."""
        if limit_bytes < 0:
            raise errors.InputError(f"{name} tier limit must be >= 0 bytes, found {limit_bytes}")
        if verify not in ("always", "never"):
            raise errors.InputError(f"verify must be 'always' or 'never', found {verify!r}")
        if not hashed and verify != "never":
            raise errors.InputError(
                f"{name} tier: hashed=False needs verify='never' (an entry without a "
                "sha256 cannot be verified), found verify='always'"
            )
        if wait_timeout < 0:
            raise errors.InputError(f"wait_timeout must be >= 0 s, found {wait_timeout}")
        if lock_timeout is not None and lock_timeout < 0:
            raise errors.InputError(f"lock_timeout must be >= 0 s or None, found {lock_timeout}")
        self.root = Path(root)
        self.limit_bytes = limit_bytes
        self.name = name
        self.fsync = fsync
        self.verify = verify
        self.hashed = hashed
        self.observer = observer
        self.wait_timeout = wait_timeout
        self.root.mkdir(parents=True, exist_ok=True)
        self._files = _directory.Directory(self.root, name=name, lock_timeout=lock_timeout)
        #: Meta files read by lookups, by key, with the (inode, mtime, size) they had:
        #: see `_read_meta`.
        self._metas: dict[str, tuple[tuple[int, int, int], _entries.EntryMeta]] = {}
        #: The committed keys, kept by this object's commits and removals; None when
        #: other writers may change the directory (then every answer asks the files).
        self._members = _membership.Membership(self._files) if sole_writer else None
        #: A sole writer's holds kept in its own memory (`hold`): how many on each key.
        #: Only this object evicts from its directory, and it never takes a held key.
        self._pins: dict[str, int] = {}
        #: Keys this object is removing now (`_remove_unleased`): `hold` takes none.
        self._removing: set[str] = set()
        self._pins_lock = threading.Lock()
        #: This process's limit declared in the directory, and the others' (`_limits`);
        #: a sole writer has no others.
        self._limits = None if sole_writer else _limits.Limits(self.root, limit_bytes)
        #: Keys eviction found it may not remove (`_cannot_remove`), said once each,
        #: with why (`unremovable`).
        self._unremovable: dict[str, str] = {}

    @property
    def lock_timeout(self) -> float | None:
        """How long an operation waits for the tier lock or an entry's lease lock (the
        directory's, `_directory.Directory.lock_timeout`: one setting for both)."""
        return self._files.lock_timeout

    def __repr__(self) -> str:
        return f"Tier(name={self.name!r}, root={str(self.root)!r}, limit_bytes={self.limit_bytes})"

    # --- public API --------------------------------------------------------------------
    def lookup(self, key: str, *, count: bool = True) -> _entries.Entry | None:
        """Return a leased, verified entry, or None (missing, or corrupted and removed).

        Touches the entry's LRU time. Verification always checks the size, and the full
        sha256 when verify == "always". A bad entry is removed, logged and counted.
        `count=False` leaves the hit or miss uncounted, for a caller that counts it
        itself once it knows whether the lookup served a reader.
        """
        _entries.check_key(key)
        entry, _ = self._lookup(key, touch=True)
        if count:
            self._count_lookup(entry)
        return entry

    def hold(self, key: str, *, count: bool = True) -> _entries.Entry | None:
        """`lookup`'s answer, held in this process's memory where the tier is the sole
        writer of a directory it never verifies (the sidecar's memory tier); `lookup`
        itself anywhere else, and for a key whose meta file no lookup has read since it
        was committed.

        Why: a lookup of a resident shard is eight system calls (the lease file's open,
        flock, stat and fstat, the meta and data files' stats, the LRU touch, the close
        at release), about 40 us each on the sidecar's event loop with cold caches, and
        an acquire with grants makes five (docs/benchmarks.md, "Where a warm pass's
        sidecar CPU goes"). The lease exists so that no eviction takes the entry while
        it is held; a sole writer's evictions are all this object's
        (`_remove_unleased`), which skips a key held here exactly as one leased on
        disk, under `_pins_lock`, so a hold never meets an eviction half done. What is
        still checked is what a lookup checks of a resident entry besides its lease:
        the data file is there with the size its meta file says (else the lookup
        decides: a miss, or a bad entry removed), and its LRU time is touched.
        """
        members = self._members
        if members is None or self.verify != "never":
            return self.lookup(key, count=count)
        _entries.check_key(key)
        with self._pins_lock:
            known = self._metas.get(key)
            pinned = known is not None and key in members.keys and key not in self._removing
            if pinned:
                self._pins[key] = self._pins.get(key, 0) + 1
        if known is None or not pinned:
            return self.lookup(key, count=count)
        meta = known[1]
        data = self._files.data(key)
        entry = _entries.Entry(
            key=key,
            path=data,
            size=meta.size,
            sha256=meta.sha256,
            unpin=functools.partial(self._unpin, key),
        )
        try:
            st = os.lstat(data)
            intact = stat.S_ISREG(st.st_mode) and st.st_size == meta.size
            if intact:
                _entries.mark_used(data)
        except FileNotFoundError:
            intact = False
        if not intact:  # the files say what became of it (`_lookup`)
            entry.release()
            return self.lookup(key, count=count)
        if count:
            self._count_lookup(entry)
        return entry

    def _unpin(self, key: str) -> None:
        with self._pins_lock:
            left = self._pins.get(key, 0) - 1
            if left > 0:
                self._pins[key] = left
            else:
                self._pins.pop(key, None)

    def insert(
        self,
        key: str,
        size: int,
        produce: Callable[[Path], object],
        *,
        evict: bool = True,
        held: int = 0,
        sha256: str | None = None,
        waiting: Callable[[], None] | None = None,
    ) -> _entries.Entry:
        """Reserve `size` bytes, let `produce(tmp_path)` write them, commit, return a lease.

        `produce` must write exactly `size` bytes into `tmp_path` in place (open it for
        writing; do not replace it with another file). Raises EntryTooLargeError (a
        CacheError) if the entry can never fit, and CacheError if leased entries keep the
        room taken for `wait_timeout` seconds; if `produce` raises, the reservation is
        removed and the error propagates. With evict=False nothing is evicted and nothing
        waited for: if the free room is too small, TierFullError is raised at once (for
        readahead, which should not push out entries that are needed sooner).
        ENOSPC or EDQUOT while producing (the volume is fuller than the tier's files: a
        reader still maps evicted ones, other files fill it; `source.download` raises
        them as they are) is "no room yet" too: see `_after_no_space`.

        `held` is how many bytes of this tier's entries the caller itself holds leases
        on and keeps holding while this insert waits: if `size` does not fit beside
        them, RoomHeldError is raised at once instead of waiting for room only the
        caller could free.

        `waiting`: called each time the insert is about to wait for leases to be
        released; what it raises ends the wait (a caller that can tell the room will not
        come: the node cache's sample-mode readers, `CacheNode._window_room_check`).

        `sha256`: the hex sha256 of the bytes `produce` writes, when the caller knows it
        (the node cache's fetch checks the source's bytes against the manifest's sha256
        as they arrive); it goes into the meta file as it is, and the tier does not read
        the entry back to hash it. Otherwise the tier hashes the written file if it is
        `hashed`. A tier with verify="always" still checks it on every lookup.
        """
        self._check_entry(key, size, sha256)
        if size + held > self.limit_bytes:
            raise _errors.RoomHeldError(
                f"entry {key} ({size} bytes) does not fit beside the {held} bytes its "
                f"caller holds leases on: the {self.name} tier holds at most "
                f"{self.limit_bytes} bytes; release some, or raise {self._limit_setting()}",
                size=size,
                held=held,
                limit=self.limit_bytes,
            )
        deadline = time.monotonic() + self.wait_timeout
        room = _no_space.NoSpace()
        while True:
            try:
                return self._insert_reserved(
                    key,
                    size,
                    produce,
                    evict=evict,
                    deadline=deadline,
                    sha256=sha256,
                    waiting=waiting,
                    room=room,
                )
            except OSError as exc:
                if exc.errno not in _no_space.ERRNOS:
                    raise
                self._after_no_space(
                    key, size, exc, evict=evict, deadline=deadline, room=room, waiting=waiting
                )

    def _insert_reserved(
        self,
        key: str,
        size: int,
        produce: Callable[[Path], object],
        *,
        evict: bool,
        deadline: float,
        sha256: str | None,
        waiting: Callable[[], None] | None = None,
        room: _no_space.NoSpace | None = None,
    ) -> _entries.Entry:
        """One attempt of `insert`: reserve, produce, commit; the reservation goes on error."""
        tmp_path, tmp_fd = self._reserve(
            key, size, evict=evict, deadline=deadline, waiting=waiting, room=room
        )
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
            if sha256 is None and self.hashed:
                sha256 = _entries.sha256_file(tmp_path, fsync=self.fsync)
            elif self.fsync:
                os.fsync(tmp_fd)  # the reservation's descriptor: produce wrote in place
            meta = _entries.EntryMeta(key=key, size=size, sha256=sha256)
            self._files.write_file(meta_tmp, meta.to_json(), fsync=self.fsync)
            lease_fd = self._take_lease(key, create=True)
            try:
                with self._files.tier_locked(_locks.EXCLUSIVE):
                    # Data first, meta last: the meta rename is the commit point, and a
                    # crash in between leaves data without meta, which is never served
                    # (and, with the lease lock file taken above, is known as an orphan
                    # of the tier's own and reclaimed: `Listing.orphans`). Whatever
                    # someone put in their place, a directory too, goes.
                    _directory.replace(tmp_path, self._files.data(key), tier=self.name)
                    faultpoints.reach("cache.insert")
                    _directory.replace(meta_tmp, self._files.meta(key), tier=self.name)
                    if self._members is not None:
                        self._members.keys.add(key)
                        # `hold` takes the meta from a lookup of this commit's files.
                        self._metas.pop(key, None)
                    with self._pins_lock:
                        self._unremovable.pop(key, None)  # this process's own now
                    _entries.mark_used(
                        self._files.data(key)
                    )  # the newest entry is the last to evict
                committed = True
            finally:
                if not committed:
                    _locks.close(lease_fd)
        finally:
            try:
                if not committed:
                    with self._files.tier_locked(_locks.EXCLUSIVE):
                        _directory.unlink(tmp_path)
                        _directory.unlink(meta_tmp)
            except _locks.LockTimeout as exc:
                # Not raised over the error that got here: the reservation is
                # unlocked below, so the next reclaim under the tier lock removes it as
                # a dead writer's.
                logger.warning("%s tier: left the reservation %s: %s", self.name, tmp_path, exc)
            finally:
                _locks.close(tmp_fd)
        if self.fsync:
            self._files.fsync()
        return _entries.Entry(
            key=key, path=self._files.data(key), size=size, sha256=sha256, lease_fd=lease_fd
        )

    def get_or_insert(
        self,
        key: str,
        size: int,
        produce: Callable[[Path], object],
        *,
        evict: bool = True,
        held: int = 0,
        sha256: str | None = None,
        waiting: Callable[[], None] | None = None,
        count: bool = True,
    ) -> tuple[_entries.Entry, bool]:
        """lookup, else insert; one producer per key across threads and processes.

        Returns (entry, hit). A caller that finds another one producing the key waits
        for it (on the per-key fill lock) and then gets its entry. `evict`, `held`,
        `sha256` and `waiting` as in insert. `count=False` leaves the hit or miss
        uncounted, as in `lookup`: for an insert that is no reader's lookup (the node
        cache's memory tier counts its readers' lookups itself).
        """
        _entries.check_key(key)
        entry, _ = self._lookup(key, touch=True)
        if entry is None:
            fill_fd = self._fill_lock(key)
            try:
                entry, _ = self._lookup(key, touch=True)
                if entry is None:
                    if count:
                        self._count_lookup(None)
                    entry = self.insert(
                        key, size, produce, evict=evict, held=held, sha256=sha256, waiting=waiting
                    )
                    return entry, False
            finally:
                if fill_fd is not None:
                    _locks.unlink_held(fill_fd, self._files.fill(key))
                    _locks.close(fill_fd)
        if count:
            self._count_lookup(entry)
        return entry, True

    def _fill_lock(self, key: str) -> int | None:
        """The fill lock of `key`; None to produce it without one.

        A holder in another process that keeps it for `wait_timeout` is taken for
        stopped or stuck (it may only be slow): its lock file is unlinked, so the
        waiters of every process agree on a new one and one of them produces the key
        again, which is safe (entries are immutable and committed by rename; a hit is
        checked by its reader), where waiting for it forever was not. If the file cannot
        be unlinked (another user's, in a directory with the sticky bit), this waiter
        produces it without a fill lock. A thread of this process holding it is running,
        and is waited for as long as it takes."""
        path = self._files.fill(key)
        while True:
            try:
                fd = self._lock(path, _locks.EXCLUSIVE, create=True, timeout=self.wait_timeout)
            except _locks.LockTimeout as exc:
                if os.getpid() in exc.pids:
                    continue
                took_over = _locks.unlink_waited_on(exc)
                logger.warning(
                    "%s tier: producing %s %s: %s",
                    self.name,
                    key,
                    "under a new fill lock" if took_over else "without its fill lock",
                    exc,
                )
                if took_over:
                    continue
                return None
            assert fd is not None  # blocking acquire with create never returns None
            return fd

    def size(self, key: str) -> int | None:
        """Bytes of the entry's data file if there is one (no lease, no check): what a
        caller that only counts room may take it to hold."""
        _entries.check_key(key)
        try:
            st = os.lstat(self._files.data(key))
        except FileNotFoundError:
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def contains(self, key: str) -> bool:
        """Whether a committed entry exists (no lease, no verification). From memory,
        without a system call, for a `sole_writer` tier."""
        _entries.check_key(key)
        if self._members is not None:
            return key in self._members.keys
        return self._files.committed(key)

    @property
    def removals(self) -> int | None:
        """For a sole writer, a count that changes whenever a committed key is taken
        out of its set (an eviction, a bad entry, one lost behind its back, a listing
        without it); while it stays the same, every key `contains` said yes to still
        is. None for a tier that is not the sole writer: nothing is known without
        looking."""
        return None if self._members is None else self._members.removals

    def keys(self) -> list[str]:
        """Keys of the committed entries, sorted."""
        return sorted(self._files.listing().committed())

    def resident_bytes(self, *, timeout: float | None = None) -> int:
        """Bytes of committed entries in this tier, written by any process. `timeout`:
        the longest wait for the tier lock, if not `lock_timeout` (a metrics scrape's
        is shorter than a scraper waits)."""
        with self._files.tier_locked(_locks.SHARED, timeout=timeout):
            committed = self._files.listing().committed()
            self._saw(committed)
            return sum(st.st_size for st in committed.values())

    def bound_bytes(self) -> int:
        """The byte limit that bounds the tier's directory now: the largest of the live
        processes inserting into it (`_limits`), this one's `limit_bytes` included;
        `limit_bytes` for a sole writer. What a status reports beside the resident
        bytes, which are the directory's, not this process's."""
        return self.limit_bytes if self._limits is None else self._limits.bound()

    def used_bytes(self) -> int:
        """What counts against the limit: the tier's own data files (committed entries,
        and orphans a crash left) plus every live reservation (`Listing.used`)."""
        with self._files.tier_locked(_locks.SHARED):
            listing = self._files.listing()
            self._saw(listing.committed())
            return listing.used

    def _saw(self, committed: dict[str, os.stat_result]) -> None:
        """A listing made under the tier lock is the committed entries exactly: a sole
        writer's set takes it (`_membership`: what another writer changed, broken
        promise or not, is seen here at the latest, e.g. at each metrics scrape)."""
        if self._members is not None:
            self._members.replace(committed)

    def leased_bytes(self) -> int:
        """Bytes of entries some process holds a lease on (a snapshot, best effort)."""
        leased = 0
        with self._files.tier_locked(_locks.EXCLUSIVE):
            for key, st in self._files.listing().committed().items():
                if key in self._pins:  # held in this process's memory (`hold`)
                    leased += st.st_size
                    continue
                fd = self._lock(
                    self._files.lease(key),
                    _locks.EXCLUSIVE | _locks.NONBLOCKING,
                    create=False,
                    tier_locked=True,
                )
                if fd is None:
                    leased += st.st_size if self._files.lease(key).exists() else 0
                else:
                    _locks.close(fd)
        return leased

    def evict(self, key: str) -> bool:
        """Remove the entry unless it is leased; return whether it was removed."""
        _entries.check_key(key)
        with self._files.tier_locked(_locks.EXCLUSIVE):
            try:
                size: int | None = os.lstat(self._files.data(key)).st_size
            except FileNotFoundError:
                size = None
            if size is None and not os.path.lexists(self._files.meta(key)):
                return False
            return self._remove_unleased(key, size or 0)

    def reclaim(self) -> tuple[int, int]:
        """What a start needs (the node cache calls it when it opens its tiers): remove
        temp files of dead writers and orphans (data files a crash left without their
        meta file, `Listing.orphans`), which count against the limit and which no
        eviction takes. Returns (files removed, bytes freed). Cheap: one listing under
        the tier lock, no entry read. `scan` does this and checks every entry too."""
        with self._files.tier_locked(_locks.EXCLUSIVE):
            listing = self._files.listing()
            before = listing.used
            removed = self._files.reclaim_tmp(listing)
            removed += self._reclaim_orphans(listing)[0]
            return removed, before - listing.used

    def scan(self) -> ScanReport:
        """Repair the directory at start-up and report what was found.

        Removes temp files of dead writers, orphans (data without meta, with the lease
        lock file a commit or eviction takes first: `Listing.orphans`), meta without
        data and lease lock files of no entry (unless a live process holds the lease),
        then checks every entry like lookup does (sha256 too when verify == "always")
        without touching LRU times. A data file without either is not the tier's: it
        is left alone.
        """
        with self._files.tier_locked(_locks.EXCLUSIVE):
            listing = self._files.listing()
            removed_tmp = self._files.reclaim_tmp(listing)
            removed_incomplete = self._reclaim_orphans(listing)[0]
            for key in (listing.meta | listing.leases) - set(listing.data):
                lock = self._lock(
                    self._files.lease(key),
                    _locks.EXCLUSIVE | _locks.NONBLOCKING,
                    create=True,
                    tier_locked=True,
                )
                if lock is None:
                    continue  # a live process is committing it or leases it: leave it
                try:
                    removed = _directory.unlink(self._files.data(key)) | _directory.unlink(
                        self._files.meta(key)
                    )
                    removed_incomplete += removed
                    if removed:
                        logger.warning(
                            "%s tier: removed incomplete entry %s (data or meta file missing)",
                            self.name,
                            key,
                        )
                    _locks.unlink_held(lock, self._files.lease(key))
                finally:
                    _locks.close(lock)
            for key in listing.fills:
                fill = self._lock(
                    self._files.fill(key),
                    _locks.EXCLUSIVE | _locks.NONBLOCKING,
                    create=False,
                    tier_locked=True,
                )
                if fill is not None:
                    _locks.unlink_held(fill, self._files.fill(key))
                    _locks.close(fill)
            complete = sorted(listing.committed())
            if self._members is not None:
                self._members.replace(complete)
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
    def _after_no_space(
        self,
        key: str,
        size: int,
        exc: OSError,
        *,
        evict: bool,
        deadline: float,
        room: _no_space.NoSpace,
        waiting: Callable[[], None] | None,
    ) -> None:
        """The volume ran out of room below the tier's limit (ENOSPC while producing):
        return once a retry may fit, or raise at `deadline`.

        The limit counts the tier's files, but a reader may still map files eviction
        already unlinked, whose pages stay in the volume until unmapped (`_no_space`
        says what follows). That is "no room yet", like a full tier: readahead
        (evict=False) backs off with TierFullError; an insert that may evict removes
        unleased entries while that brings room back, and no more once the evicted
        files still mapped would cover it: then it waits for readers to unmap (the
        trainer drops its mappings of evicted files while it waits on an acquire,
        `datasets._Mappings`). `room` is this insert's across its tries: its WARNING is
        logged once. The node disk tier's volume also holds the tiers of other
        namespaces, which this one cannot evict: when their bytes are what keeps the
        room, the error says so.
        """
        if not evict:
            raise _errors.TierFullError(
                f"{self.name} volume {self.root} is out of space for {key} ({size} bytes) "
                f"below the tier's limit of {self.limit_bytes} bytes; not evicting (evict=False)"
            ) from exc
        need = _no_space.needed(size)
        delay = _WAIT_FIRST_S
        evicted_at: float | None = None
        own = 0
        # The volume said there was room and the write failed all the same (no inode
        # left, a quota): its free bytes are not believed before a wait, or this would
        # retry at once, for good.
        believe, room.promised = not room.promised, False
        while True:
            found = _no_space.volume(self.root)
            if found is not None:
                room.saw(found.free)
                if found.free >= need and believe:
                    room.promised = True
                    return
            now = time.monotonic()
            if evicted_at is None or now - evicted_at >= _WAIT_MAX_S:
                # Entries may have been released since: try them again now and then,
                # not at every poll (each lists the directory under the tier lock).
                evicted_at = now
                with self._files.tier_locked(_locks.EXCLUSIVE):
                    listing = self._files.listing()
                    self._reclaim_orphans(listing)
                    if self._evict_for_room(key, listing, need, room):
                        room.promised = True
                        return
                    own = listing.used
                found = _no_space.volume(self.root)
            # The node disk tier's volume holds every namespace's tier: bytes that are
            # not this tier's, enough to make the room, are why it is full.
            outside = _no_space.others(found, own=own)
            crowded = self.name == "disk" and found is not None and outside >= size
            holders = _no_space.holders(found, own=own, unfreed=room.unfreed)
            if now >= deadline:
                if found is not None and crowded:
                    raise errors.CacheError(
                        f"{self.name} volume of {self.root} stayed out of space for {key} "
                        f"({size} bytes) for {self.wait_timeout:g} s while this tier holds "
                        f"only {own} of its {self.limit_bytes} bytes and has no unleased entry "
                        f"left to evict: {outside} of the volume's {found.total} bytes "
                        f"({found.free} free) are not this tier's. The node volume is full "
                        "because of other "
                        "namespaces' disk tiers (each namespace's lies below the same "
                        "nodePath on the node) or other files there, which this tier cannot "
                        "evict. The platform keeps what the namespaces on a node may cache "
                        "under its volume (chart value policy.maxCacheDisk, docs/operator.md "
                        '"Sizing the node disk"); until then, free the node\'s volume, run '
                        "the pod on another node, or lower this tier's limit "
                        f"({self._limit_setting()}, the mount's cache.disk) to what the "
                        "volume can hold beside them"
                    ) from exc
                raise errors.CacheError(
                    f"{self.name} volume {self.root} stayed out of space for {key} ({size} "
                    f"bytes) for {self.wait_timeout:g} s although the tier holds at most "
                    f"{self.limit_bytes} bytes: {holders}. Readers keep evicted files mapped "
                    "(a reader holding batches of shards it released, or a reader of an older "
                    "shardcache that kept its mappings while it waited), or something "
                    f"else fills the volume; give the volume more room than "
                    f"{self._limit_setting()}"
                ) from exc
            if waiting is not None:
                waiting()
            if not room.warned:
                room.warned = True
                logger.warning(
                    "%s volume %s is out of space for %s (%d bytes) below the tier limit of "
                    "%d bytes and evicting more would free nothing now: %s. Waiting up to "
                    "%g s for readers to unmap or release%s",
                    self.name, self.root, key, size, self.limit_bytes, holders,
                    self.wait_timeout,
                    f", or for other namespaces' tiers, which hold {outside} bytes of the "
                    "volume" if crowded else "",
                )  # fmt: skip
            time.sleep(min(delay, max(0.0, deadline - now)))
            delay = min(delay * 2, _NO_SPACE_POLL_MAX_S)
            believe = True

    def _evict_for_room(
        self, key: str, listing: _directory.Listing, need: int, room: _no_space.NoSpace
    ) -> bool:
        """Evict unleased entries, least recently used first, until the volume has
        `need` free bytes (True) or the evicted files a reader still maps would give
        them once unmapped (False: waiting is enough); call under the tier lock."""
        found = _no_space.volume(self.root)
        for victim, st in _eviction.least_recently_used(listing.committed()):
            if found is not None and room.waiting_is_enough(need, found.free, time.monotonic()):
                return False
            if not self._remove_unleased(victim, st.st_size):
                continue
            del listing.data[victim]
            after = _no_space.volume(self.root)
            logger.info(
                "%s volume %s is out of space below the tier limit: evicted %s (%d bytes) "
                "to make room for %s",
                self.name, self.root, victim, st.st_size, key,
            )  # fmt: skip
            if found is None or after is None:
                return True  # cannot tell what came back: one entry a try
            room.evicted(st.st_size, before=found.free, after=after.free)
            found = after
            if found.free >= need:
                return True
        return False

    def _remover(self, room: _no_space.NoSpace) -> Callable[[str, int], bool]:
        """`_remove_unleased` that tells `room` whether each eviction freed its bytes
        in the volume (two statvfs calls, no more)."""

        def remove(key: str, size: int) -> bool:
            before = _no_space.volume(self.root)
            if not self._remove_unleased(key, size):
                return False
            after = _no_space.volume(self.root)
            if before is not None and after is not None:
                room.evicted(size, before=before.free, after=after.free)
            return True

        return remove

    def _reclaim_orphans(self, listing: _directory.Listing) -> tuple[int, int]:
        """Remove the orphans of `listing` (`Listing.orphans`: data files a process
        killed between a commit's or an eviction's two steps left without a meta file)
        and take them out of it; (files removed, bytes freed). Call under the tier lock
        held exclusively: every commit and eviction renames or unlinks both files under
        it, so none is half done by a live process. An orphan whose lease lock is held
        (a bad entry being removed by a lookup that leases it) is left for later."""
        removed = freed = 0
        for key, st in list(listing.orphans().items()):
            lock = self._lock(
                self._files.lease(key),
                _locks.EXCLUSIVE | _locks.NONBLOCKING,
                create=True,
                tier_locked=True,
            )
            if lock is None:
                continue
            try:
                if os.path.lexists(self._files.meta(key)):
                    continue  # committed after all (only a writer ignoring the tier lock)
                _directory.unlink(self._files.data(key))
                _locks.unlink_held(lock, self._files.lease(key))
            finally:
                _locks.close(lock)
            del listing.data[key]
            listing.leases.discard(key)
            removed += 1
            freed += st.st_size
            logger.warning(
                "%s tier: removed %s from %s (%d bytes), a data file without its meta file "
                "that a process killed while committing or evicting it left",
                self.name, key, self.root, st.st_size,
            )  # fmt: skip
        return removed, freed

    def _limit_setting(self) -> str:
        return _LIMIT_SETTINGS.get(self.name, f"the {self.name} tier's limit_bytes")

    def _count_lookup(self, entry: _entries.Entry | None) -> None:
        if self.observer is not None:
            if entry is None:
                self.observer.miss(self.name)
            else:
                self.observer.hit(self.name)

    def _lock(
        self,
        path: Path,
        operation: int,
        *,
        create: bool,
        tier_locked: bool = False,
        timeout: float | None = None,
    ) -> int | None:
        """`_locks.acquire` of an entry's lock file, a blocking one waited for at most
        `timeout` s (`lock_timeout` if None); one this process may not open (a
        process of another user made it, with a restrictive umask) is replaced first
        (`_other_users`), under the tier lock (`tier_locked`: the caller holds it)."""
        wait = self.lock_timeout if timeout is None else timeout
        try:
            return _locks.acquire(path, operation, create=create, timeout=wait)
        except PermissionError:
            if tier_locked:
                _other_users.replace_lock(path, tier=self.name)
            else:
                with self._files.tier_locked(_locks.EXCLUSIVE):
                    _other_users.replace_lock(path, tier=self.name)
        return _locks.acquire(path, operation, create=create, timeout=wait)

    def _take_lease(self, key: str, *, create: bool) -> int:
        fd = self._lock(self._files.lease(key), _locks.SHARED, create=create)
        if fd is None:
            raise FileNotFoundError(self._files.lease(key))
        return fd

    def _lookup(self, key: str, *, touch: bool) -> tuple[_entries.Entry | None, _Outcome]:
        entry, outcome = self._lookup_files(key, touch=touch)
        if self._members is not None and outcome != "hit" and key in self._members.keys:
            self._members.lost(key)  # removed behind our back: see `_membership`
        return entry, outcome

    def _lookup_files(self, key: str, *, touch: bool) -> tuple[_entries.Entry | None, _Outcome]:
        if self._members is not None:
            if key not in self._members.keys:  # a miss without a system call
                return None, "missing"
        elif not self._files.meta(key).exists():  # cheap miss without creating a lock file
            return None, "missing"
        lease_fd = self._lock(self._files.lease(key), _locks.SHARED, create=False)
        if lease_fd is None:
            return None, "missing"  # evicted since we looked
        try:
            try:
                meta: _entries.EntryMeta | None = self._read_meta(key)
                problem = ""
            except FileNotFoundError:
                _locks.close(lease_fd)
                return None, "missing"
            except errors.CacheError as exc:
                meta, problem = None, str(exc)
            except PermissionError:
                meta = None
                problem = _other_users.unreadable_why(self._files.meta(key), "meta file")
            try:
                # Not through a link: a link is not the entry, wherever it points.
                st = os.lstat(self._files.data(key))
                data_id: tuple[int, int] | None = (st.st_dev, st.st_ino)
            except FileNotFoundError:
                data_id = None
            if meta is None:
                self._discard(key, lease_fd, data_id, problem, corrupted=False)
                return None, "incompatible"
            if data_id is None:
                self._discard(key, lease_fd, None, "its data file is missing", corrupted=True)
                return None, "corrupted"
            if not stat.S_ISREG(st.st_mode):
                why = f"its data file is {regular_files.kind(st.st_mode)}, expected a regular file"
                self._discard(key, lease_fd, data_id, why, corrupted=True)
                return None, "corrupted"
            if not _other_users.readable(st):
                why = _other_users.unreadable_why(self._files.data(key), "data file")
                self._discard(key, lease_fd, data_id, why, corrupted=False)
                return None, "incompatible"
            if st.st_size != meta.size:
                why = f"size {st.st_size} bytes, expected {meta.size} (truncated or overwritten)"
                self._discard(key, lease_fd, data_id, why, corrupted=True)
                return None, "corrupted"
            if self.verify == "always" and meta.sha256 is None:
                why = "no sha256 to verify it against (written by a tier that does not hash)"
                self._discard(key, lease_fd, data_id, why, corrupted=False)
                return None, "incompatible"
            if self.verify == "always":
                found = _entries.sha256_file(self._files.data(key))
                if found != meta.sha256:
                    why = f"sha256 {found}, expected {meta.sha256} (corrupted)"
                    self._discard(key, lease_fd, data_id, why, corrupted=True)
                    return None, "corrupted"
            if touch:
                try:
                    _entries.mark_used(self._files.data(key))
                except FileNotFoundError:  # another process found it corrupted meanwhile
                    _locks.close(lease_fd)
                    return None, "missing"
        except BaseException:
            with contextlib.suppress(OSError):
                _locks.close(lease_fd)
            raise
        entry = _entries.Entry(
            key=key,
            path=self._files.data(key),
            size=meta.size,
            sha256=meta.sha256,
            lease_fd=lease_fd,
        )
        return entry, "hit"

    def _read_meta(self, key: str) -> _entries.EntryMeta:
        """`read_meta` of the entry's meta file, from memory while the file is the one
        read before (same inode, mtime and size).

        A lookup of a resident shard opened, read, parsed and checked its meta file
        each time: about a quarter of a lookup, and an acquire with grants makes five.
        A meta file is only ever replaced by rename (a new inode) or removed, never
        written in place, so the same inode, mtime and size is the same content. The
        caller holds the entry's lease, so it cannot be replaced meanwhile. (A file
        damaged in place by hand within one clock tick would be missed until it is read
        again; the remembered meta is the one the entry was committed with, and the data
        file's size is checked against it on every lookup all the same.)
        """
        path = self._files.meta(key)
        st = os.lstat(path)  # FileNotFoundError, as read_meta would raise
        if not stat.S_ISREG(st.st_mode):  # a FIFO, a link, a directory: never opened
            raise regular_files.NotRegularFile(
                path, regular_files.kind(st.st_mode), (st.st_dev, st.st_ino)
            )
        seen = (st.st_ino, st.st_mtime_ns, st.st_size)
        known = self._metas.get(key)
        if known is not None and known[0] == seen:
            return known[1]
        meta, read = _entries.read_meta_file(path, key)
        seen = (read.st_ino, read.st_mtime_ns, read.st_size)  # the file read, if replaced
        if len(self._metas) >= _METAS_KEPT:
            self._metas.clear()  # keys of long-evicted entries: start again
        self._metas[key] = (seen, meta)
        return meta

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
            with self._files.tier_locked(_locks.EXCLUSIVE):
                try:
                    st = os.lstat(self._files.data(key))
                    current: tuple[int, int] | None = (st.st_dev, st.st_ino)
                except FileNotFoundError:
                    current = None
                if current == data_id:
                    _directory.unlink(self._files.meta(key))
                    if self._members is not None:
                        self._members.discard(key)
                        self._metas.pop(key, None)
                    if current is not None:
                        _directory.unlink(self._files.data(key))
        finally:
            _locks.close(lease_fd)

    def _remove_unleased(self, key: str, size: int) -> bool:
        """Remove an entry if no lease is held, on disk or in this process's memory
        (`hold`); call with the tier lock held exclusively."""
        with self._pins_lock:
            if key in self._pins:
                return False
            self._removing.add(key)
        try:
            try:
                lock = self._lock(
                    self._files.lease(key),
                    _locks.EXCLUSIVE | _locks.NONBLOCKING,
                    create=True,
                    tier_locked=True,
                )
            except _other_users.Unremovable as exc:
                self._cannot_remove(key, str(exc))
                return False
            if lock is None:
                return False
            try:
                try:
                    # Uncommit first: a reader never sees data without meta.
                    _directory.unlink(self._files.meta(key))
                except PermissionError as exc:
                    self._cannot_remove(key, f"{exc.strerror}: {exc.filename}")
                    return False
                if self._members is not None:
                    self._members.discard(key)
                    self._metas.pop(key, None)
                faultpoints.reach("cache.evict")
                _directory.unlink(self._files.data(key))
                _locks.unlink_held(lock, self._files.lease(key))
            finally:
                _locks.close(lock)
        finally:
            with self._pins_lock:
                self._removing.discard(key)
        with self._pins_lock:
            self._unremovable.pop(key, None)
        if self.observer is not None:
            self.observer.evicted(self.name, size)
        logger.debug("%s tier: evicted %s (%d bytes)", self.name, key, size)
        return True

    def _cannot_remove(self, key: str, why: str) -> None:
        """An entry this process may not remove (another user's, in a directory with
        the sticky bit): skipped by eviction, like a leased one, and said once."""
        told = (
            f"{self.name} tier: cannot evict {key} from {self.root} "
            f"({_other_users.directory(self.root)}): {why}"
        )
        with contextlib.suppress(OSError):
            told += f" (its data file is {_other_users.describe(os.lstat(self._files.data(key)))})"
        with self._pins_lock:
            first = key not in self._unremovable
            self._unremovable[key] = told
        if first:
            logger.warning(
                "%s. Its bytes count against the limit until it is removed; %s",
                told, _other_users.removal_fix(self.root),
            )  # fmt: skip

    def unremovable(self, key: str) -> str | None:
        """Why the entry `key` could not be removed when this process last tried (an
        eviction's: another user's, in a directory with the sticky bit), with the fix
        (`_other_users.removal_fix`); None if nothing kept it (it was removed, or a
        lease kept it: a lease ends)."""
        with self._pins_lock:
            told = self._unremovable.get(key)
        if told is None:
            return None
        return f"{told}; {_other_users.removal_fix(self.root)}"

    def uncommitted(
        self,
        key: str,
        size: int,
        produce: Callable[[Path], object],
        *,
        sha256: str | None = None,
    ) -> _entries.Entry:
        """`produce(tmp_path)` into a reservation of `size` bytes, as `insert` does,
        and hand it over uncommitted: the returned Entry's path is the reservation, which
        its release removes (a dead process's is reclaimed as any dead writer's). For a
        key whose entry cannot be committed or replaced here (`unremovable`): its bytes
        are counted while used, and never served to anyone else.

        Evicts as `insert` does, and raises what it raises; no retry after ENOSPC."""
        self._check_entry(key, size, sha256)
        deadline = time.monotonic() + self.wait_timeout
        tmp_path, tmp_fd = self._reserve(key, size, evict=True, deadline=deadline)

        def remove() -> None:
            try:
                with self._files.tier_locked(_locks.EXCLUSIVE):
                    _directory.unlink(tmp_path)
            except _locks.LockTimeout as exc:
                # Unlocked below: the next reclaim removes it as a dead writer's.
                logger.warning("%s tier: left the reservation %s: %s", self.name, tmp_path, exc)
            finally:
                _locks.close(tmp_fd)

        try:
            produce(tmp_path)
            written = os.stat(tmp_path).st_size
            if written != size:
                raise errors.CacheError(
                    f"producing {key} for the {self.name} tier wrote {written} bytes, "
                    f"expected the declared size {size}"
                )
        except BaseException:
            remove()
            raise
        return _entries.Entry(key=key, path=tmp_path, size=size, sha256=sha256, unpin=remove)

    def _check_entry(self, key: str, size: int, sha256: str | None) -> None:
        """What an insert of `key` (committed or not) refuses before it reserves."""
        _entries.check_key(key)
        if sha256 is not None and not _SHA256_HEX.fullmatch(sha256):
            raise errors.InputError(f"sha256 must be 64 lowercase hex digits, found {sha256!r}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise errors.InputError(f"entry size must be an int >= 0, found {size!r}")
        if size > self.limit_bytes:
            raise _errors.EntryTooLargeError(
                f"entry {key} is {size} bytes but the {self.name} tier holds at most "
                f"{self.limit_bytes} bytes; raise {self._limit_setting()} above {size}",
                size=size,
                limit=self.limit_bytes,
            )

    def _reserve(
        self,
        key: str,
        size: int,
        *,
        evict: bool,
        deadline: float,
        waiting: Callable[[], None] | None = None,
        room: _no_space.NoSpace | None = None,
    ) -> tuple[Path, int]:
        """Make room for `size` bytes and reserve them as a locked temp file. `room`:
        the insert's, told which evictions freed nothing in the volume (files a reader
        still maps), should the volume fill up below the limit (`_after_no_space`)."""
        remove = self._remove_unleased if room is None else self._remover(room)
        delay = _WAIT_FIRST_S
        warned = False
        while True:
            with self._files.tier_locked(_locks.EXCLUSIVE):
                listing = self._files.listing()
                self._files.reclaim_tmp(listing)
                # Each inserting process's limit bounds the directory it shares: the
                # largest live one is what every insert counts against (`_limits`).
                limit = self.limit_bytes if self._limits is None else self._limits.effective()
                if listing.used + size > limit:
                    # What a crash left never serves anyone: it goes before any entry.
                    self._reclaim_orphans(listing)
                used = listing.used
                leased = 0
                if used + size > limit and not evict:
                    raise _errors.TierFullError(
                        f"{self.name} tier has {limit - used} of {limit} "
                        f"bytes free, {key} needs {size}; not evicting (evict=False)"
                    )
                if used + size > limit:
                    # Only entries this tier committed (data and meta): a file it did
                    # not create in a shared directory is never deleted (docs/security.md).
                    used, leased = _eviction.evict_for(
                        listing.committed(),
                        used=used,
                        size=size,
                        limit=limit,
                        remove=remove,
                    )
                if used + size <= limit:
                    return self._files.create_reservation(key, size)
                reserved = listing.reserved
                with self._pins_lock:
                    stranded = sum(
                        st.st_size
                        for k, st in listing.committed().items()
                        if k in self._unremovable
                    )
                leased = max(0, leased - stranded)  # eviction skipped them as if leased
                # Orphans a lease still holds (a lookup removing a bad entry): neither
                # leased entries nor reservations, and said apart from them.
                stuck = sum(st.st_size for st in listing.orphans().values())
            remaining = deadline - time.monotonic()
            bound = f"limit {limit} bytes" + (
                f" (the largest limit of the processes sharing the directory; this one's "
                f"is {self.limit_bytes})"
                if limit != self.limit_bytes
                else ""
            )
            held_by = (
                f"{reserved} bytes reserved by inserts in progress"
                + (f", {stuck} bytes of incomplete entries still locked" if stuck else "")
                + (
                    f", {stranded} bytes of other users' entries this process may not "
                    f"remove ({_other_users.directory(self.root)})"
                    if stranded
                    else ""
                )
            )
            if remaining <= 0:
                raise errors.CacheError(
                    f"{self.name} tier cannot make room for {key} ({size} bytes) within "
                    f"{self.wait_timeout:g} s: {bound}, {leased} bytes "
                    f"held by leases, {held_by}; readers must release entries, or raise "
                    f"{self._limit_setting()}"
                )
            if waiting is not None:
                waiting()
            if not warned:
                warned = True
                logger.warning(
                    "%s tier is full: %s, %d bytes leased, %s; waiting up to %g "
                    "s for leases to be released to insert %s (%d bytes). Raise %s if this "
                    "persists.",
                    self.name,
                    bound,
                    leased,
                    held_by,
                    self.wait_timeout,
                    key,
                    size,
                    self._limit_setting(),
                )
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, _WAIT_MAX_S)
