"""The `Tier` class: lookups, inserts, eviction and start-up repair of one directory.

The package docstring (`shardcache.node.tiers`) says how processes share a tier; the
files are `_directory`, the entry and lease types `_entries`, the eviction order
`_eviction`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal, Protocol

from shardcache import contract, errors, faultpoints
from shardcache.node import _locks, names
from shardcache.node.tiers import _directory, _entries, _errors, _eviction, _membership

# Backoff while waiting for leases to be released: first poll soon, then settle at a rate
# that costs nothing (each poll lists the directory under the tier lock).
_WAIT_FIRST_S = 0.01
_WAIT_MAX_S = 0.5
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
    ) -> None:
        """`hashed=False`: meta files carry no sha256 (null, format version 2) unless the
        producer's caller gives one, and an insert never reads its entry back to hash
        it. Only for a tier that never verifies (verify="never"): the memory tier,
        whose files are decoded from bytes already checked against the manifest.

        `sole_writer=True`: this object is the only one that commits or removes
        entries in `root` (other processes may lease and read them); membership is
        then answered from memory (`contains`, and a lookup's miss) instead of with
        system calls. `_membership` says why that stays exact."""
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
        self.root = Path(root)
        self.limit_bytes = limit_bytes
        self.name = name
        self.fsync = fsync
        self.verify = verify
        self.hashed = hashed
        self.observer = observer
        self.wait_timeout = wait_timeout
        self.root.mkdir(parents=True, exist_ok=True)
        self._files = _directory.Directory(self.root, name=name)
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
            intact = os.stat(data).st_size == meta.size
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
        ENOSPC while producing (the volume is fuller than the tier's files: a reader
        still maps evicted ones) is "no room yet" too: see `_after_no_space`.

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
        delay = _WAIT_FIRST_S
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
                )
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                if self._after_no_space(key, size, exc, evict=evict, deadline=deadline):
                    continue
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, _WAIT_MAX_S)

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
    ) -> _entries.Entry:
        """One attempt of `insert`: reserve, produce, commit; the reservation goes on error."""
        tmp_path, tmp_fd = self._reserve(key, size, evict=evict, deadline=deadline, waiting=waiting)
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
                with _locks.held(self._files.tier_lock, _locks.EXCLUSIVE):
                    # Data first, meta last: the meta rename is the commit point, and a
                    # crash in between leaves data without meta, which is never served.
                    os.replace(tmp_path, self._files.data(key))
                    faultpoints.reach("cache.insert")
                    os.replace(meta_tmp, self._files.meta(key))
                    if self._members is not None:
                        self._members.keys.add(key)
                        # `hold` takes the meta from a lookup of this commit's files.
                        self._metas.pop(key, None)
                    _entries.mark_used(
                        self._files.data(key)
                    )  # the newest entry is the last to evict
                committed = True
            finally:
                if not committed:
                    _locks.close(lease_fd)
        finally:
            if not committed:
                with _locks.held(self._files.tier_lock, _locks.EXCLUSIVE):
                    _directory.unlink(tmp_path)
                    _directory.unlink(meta_tmp)
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
            fill_fd = _locks.acquire(self._files.fill(key), _locks.EXCLUSIVE, create=True)
            assert fill_fd is not None  # blocking acquire with create never returns None
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
                _locks.unlink_held(fill_fd, self._files.fill(key))
                _locks.close(fill_fd)
        if count:
            self._count_lookup(entry)
        return entry, True

    def size(self, key: str) -> int | None:
        """Bytes of the entry's data file if there is one (no lease, no check): what a
        caller that only counts room may take it to hold."""
        _entries.check_key(key)
        try:
            return os.stat(self._files.data(key)).st_size
        except FileNotFoundError:
            return None

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

    def resident_bytes(self) -> int:
        """Bytes of committed entries in this tier, written by any process."""
        with _locks.held(self._files.tier_lock, _locks.SHARED):
            committed = self._files.listing().committed()
            self._saw(committed)
            return sum(st.st_size for st in committed.values())

    def used_bytes(self) -> int:
        """What counts against the limit: every data file plus every live reservation."""
        with _locks.held(self._files.tier_lock, _locks.SHARED):
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
        with _locks.held(self._files.tier_lock, _locks.EXCLUSIVE):
            for key, st in self._files.listing().committed().items():
                if key in self._pins:  # held in this process's memory (`hold`)
                    leased += st.st_size
                    continue
                fd = _locks.acquire(
                    self._files.lease(key), _locks.EXCLUSIVE | _locks.NONBLOCKING, create=False
                )
                if fd is None:
                    leased += st.st_size if self._files.lease(key).exists() else 0
                else:
                    _locks.close(fd)
        return leased

    def evict(self, key: str) -> bool:
        """Remove the entry unless it is leased; return whether it was removed."""
        _entries.check_key(key)
        with _locks.held(self._files.tier_lock, _locks.EXCLUSIVE):
            try:
                size = os.stat(self._files.data(key)).st_size
            except FileNotFoundError:
                size = None
            if size is None and not self._files.meta(key).exists():
                return False
            return self._remove_unleased(key, size or 0)

    def scan(self) -> ScanReport:
        """Repair the directory at start-up and report what was found.

        Removes temp files of dead writers, data without meta and meta without data
        (unless a live process holds their lease), then checks every entry like lookup
        does (sha256 too when verify == "always") without touching LRU times.
        """
        removed_incomplete = 0
        with _locks.held(self._files.tier_lock, _locks.EXCLUSIVE):
            listing = self._files.listing()
            removed_tmp = self._files.reclaim_tmp(listing)
            for key in set(listing.data) | listing.meta | listing.leases:
                if key in listing.data and key in listing.meta:
                    continue
                lock = _locks.acquire(
                    self._files.lease(key), _locks.EXCLUSIVE | _locks.NONBLOCKING, create=True
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
                fill = _locks.acquire(
                    self._files.fill(key), _locks.EXCLUSIVE | _locks.NONBLOCKING, create=False
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
        self, key: str, size: int, exc: OSError, *, evict: bool, deadline: float
    ) -> bool:
        """The volume ran out of room below the tier's limit (ENOSPC while producing).

        The limit counts the tier's files, but a reader may still map a file eviction
        already unlinked (a released shard whose batch it is still slicing), and its
        pages stay in the volume until unmapped. That is "no room yet", like a full
        tier: readahead (evict=False) backs off with TierFullError; an insert that may
        evict removes one more unleased entry than the limit asked for, or, when none
        is left, waits for readers to unmap, until `deadline`. Returns whether it evicted.
        The node disk tier's volume also holds the tiers of other namespaces, which this
        one cannot evict: when their bytes are what keeps the room, the error says so.
        """
        if not evict:
            raise _errors.TierFullError(
                f"{self.name} volume {self.root} is out of space for {key} ({size} bytes) "
                f"below the tier's limit of {self.limit_bytes} bytes; not evicting (evict=False)"
            ) from exc
        with _locks.held(self._files.tier_lock, _locks.EXCLUSIVE):
            listing = self._files.listing()
            for victim, st in _eviction.least_recently_used(listing.data):
                if self._remove_unleased(victim, st.st_size):
                    logger.info(
                        "%s volume %s is out of space below the tier limit: evicted %s to "
                        "make room for %s (a reader still maps files evicted before)",
                        self.name, self.root, victim, key,
                    )  # fmt: skip
                    return True
            own = listing.used
        # The node disk tier's volume holds every namespace's tier: bytes that are not
        # this tier's, enough to make the room, are why it is full.
        others = self._foreign_bytes(own) if self.name == "disk" else None
        crowded = others is not None and others[0] >= size
        if time.monotonic() >= deadline:
            if others is not None and crowded:
                foreign, total, free = others
                raise errors.CacheError(
                    f"{self.name} volume of {self.root} stayed out of space for {key} "
                    f"({size} bytes) for {self.wait_timeout:g} s while this tier holds only "
                    f"{own} of its {self.limit_bytes} bytes and has no unleased entry left "
                    f"to evict: {foreign} of the volume's {total} bytes ({free} free) are not "
                    "this tier's. The node volume is full because of other namespaces' disk "
                    "tiers (each namespace's lies below the same nodePath on the node) or "
                    "other files there, which this tier cannot evict. The platform keeps "
                    "what the namespaces on a node may cache under its volume (chart value "
                    'policy.maxCacheDisk, docs/operator.md "Sizing the node disk"); until '
                    "then, free the node's volume or run the pod on another node"
                ) from exc
            raise errors.CacheError(
                f"{self.name} volume {self.root} stayed out of space for {key} ({size} "
                f"bytes) for {self.wait_timeout:g} s although the tier holds at most "
                f"{self.limit_bytes} bytes: readers keep evicted files mapped, or something "
                f"else fills the volume; give the volume more room than "
                f"{self._limit_setting()}"
            ) from exc
        logger.warning(
            "%s volume %s is out of space for %s (%d bytes) below the tier limit (the tier "
            "holds %d bytes) and no entry of the tier can be evicted: waiting for readers "
            "to release or unmap%s",
            self.name, self.root, key, size, own,
            f" or for other namespaces' tiers, which hold {others[0]} bytes of the volume"
            if others is not None and crowded else "",
        )  # fmt: skip
        return False

    def _foreign_bytes(self, own: int) -> tuple[int, int, int] | None:
        """(bytes of the volume that are not this tier's `own`, the volume's size, its
        free bytes), by statvfs; None when it cannot be read."""
        try:
            st = os.statvfs(self.root)
        except OSError:
            return None
        total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
        return max(0, total - free - own), total, free

    def _limit_setting(self) -> str:
        return _LIMIT_SETTINGS.get(self.name, f"the {self.name} tier's limit_bytes")

    def _count_lookup(self, entry: _entries.Entry | None) -> None:
        if self.observer is not None:
            if entry is None:
                self.observer.miss(self.name)
            else:
                self.observer.hit(self.name)

    def _take_lease(self, key: str, *, create: bool) -> int:
        fd = _locks.acquire(self._files.lease(key), _locks.SHARED, create=create)
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
        lease_fd = _locks.acquire(self._files.lease(key), _locks.SHARED, create=False)
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
            try:
                st = os.stat(self._files.data(key))
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
        st = os.stat(path)  # FileNotFoundError, as read_meta would raise
        seen = (st.st_ino, st.st_mtime_ns, st.st_size)
        known = self._metas.get(key)
        if known is not None and known[0] == seen:
            return known[1]
        meta = _entries.read_meta(path, key)
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
            with _locks.held(self._files.tier_lock, _locks.EXCLUSIVE):
                try:
                    st = os.stat(self._files.data(key))
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
            lock = _locks.acquire(
                self._files.lease(key), _locks.EXCLUSIVE | _locks.NONBLOCKING, create=True
            )
            if lock is None:
                return False
            try:
                _directory.unlink(
                    self._files.meta(key)
                )  # uncommit first: a reader never sees data without meta
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
        if self.observer is not None:
            self.observer.evicted(self.name, size)
        logger.debug("%s tier: evicted %s (%d bytes)", self.name, key, size)
        return True

    def _reserve(
        self,
        key: str,
        size: int,
        *,
        evict: bool,
        deadline: float,
        waiting: Callable[[], None] | None = None,
    ) -> tuple[Path, int]:
        """Make room for `size` bytes and reserve them as a locked temp file."""
        delay = _WAIT_FIRST_S
        warned = False
        while True:
            with _locks.held(self._files.tier_lock, _locks.EXCLUSIVE):
                listing = self._files.listing()
                self._files.reclaim_tmp(listing)
                used = listing.used
                leased = 0
                if used + size > self.limit_bytes and not evict:
                    raise _errors.TierFullError(
                        f"{self.name} tier has {self.limit_bytes - used} of {self.limit_bytes} "
                        f"bytes free, {key} needs {size}; not evicting (evict=False)"
                    )
                if used + size > self.limit_bytes:
                    # Only entries this tier committed (data and meta): a file it did
                    # not create in a shared directory is never deleted (docs/security.md).
                    used, leased = _eviction.evict_for(
                        listing.committed(),
                        used=used,
                        size=size,
                        limit=self.limit_bytes,
                        remove=self._remove_unleased,
                    )
                if used + size <= self.limit_bytes:
                    return self._files.create_reservation(key, size)
                reserved = listing.reserved
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise errors.CacheError(
                    f"{self.name} tier cannot make room for {key} ({size} bytes) within "
                    f"{self.wait_timeout:g} s: limit {self.limit_bytes} bytes, {leased} bytes "
                    f"held by leases, {reserved} bytes reserved by inserts in progress; "
                    f"readers must release entries, or raise {self._limit_setting()}"
                )
            if waiting is not None:
                waiting()
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
