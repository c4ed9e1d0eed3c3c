"""One entry of a tier: its key, its meta file, and the lease a reader holds on it.

An entry is a data file `<key>` plus a meta file `<key>.meta.json` (size, sha256 or
null, format version); `Entry` is a lease on a committed one (docs/cache-format.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from shardcache import errors
from shardcache.node import _locks, nested_json, regular_files
from shardcache.node.tiers import _errors

#: Version of the tier directory format (docs/cache-format.md), the newest this code
#: reads and writes. Version 2 lets a meta file's sha256 be null (a tier that never
#: verifies its entries need not hash them: the memory tier). A meta file with a sha256
#: is written as version 1, which it also is, so sidecars of older versions sharing a
#: node's disk tier keep reading its entries; only a null sha256 needs version 2.
FORMAT_VERSION = 2
#: Versions a meta file may have; any other is IncompatibleFormatError.
READABLE_VERSIONS = (1, 2)

# Keys become file names; dots are excluded so that `<key>.lock` and friends can never
# collide with another key's data file.
KEY_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,200}")
#: A meta file is under 400 bytes (a 200-character key, a sha256, a size); one bigger
#: than this is not a meta file, and is not read whole to find that out.
META_MAX_BYTES = 4096
#: A meta file is one object of scalars: nesting 1 deep. Deeper is a corrupt file, not
#: a parse that recurses until `RecursionError` (`nested_json`).
META_MAX_DEPTH = 1
# sha256 is streamed in chunks this big: large enough that the per-call overhead is
# negligible, small enough not to matter for memory. hashlib releases the GIL per chunk.
_HASH_CHUNK = 4 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class EntryMeta:
    """Contents of `<key>.meta.json`."""

    key: str
    size: int
    #: Lowercase hex; None for an entry of a tier that does not hash (`Tier.hashed`).
    sha256: str | None

    @property
    def format_version(self) -> int:
        """The oldest version that describes this meta file (see FORMAT_VERSION)."""
        return 1 if self.sha256 is not None else 2

    def to_json(self) -> bytes:
        doc = {**dataclasses.asdict(self), "format_version": self.format_version}
        return json.dumps(doc, sort_keys=True).encode() + b"\n"


def read_meta(path: Path, key: str) -> EntryMeta:
    """Read and validate a meta file.

    Raises FileNotFoundError if it is missing, IncompatibleFormatError if it has another
    format_version, and CacheError if it is not a valid meta file for `key`: among them
    NotRegularFile for a link, a FIFO or a directory in its place, and one over
    `META_MAX_BYTES` (`regular_files`: read without following a link or waiting for a
    FIFO's writer, and capped).
    """
    return read_meta_file(path, key)[0]


def read_meta_file(path: Path, key: str) -> tuple[EntryMeta, os.stat_result]:
    """`read_meta`, and the `fstat` of the file it read."""
    raw, st = regular_files.read_capped(path, META_MAX_BYTES)
    return _parse_meta(path, key, raw), st


def _parse_meta(path: Path, key: str, raw: bytes) -> EntryMeta:
    found = nested_json.depth(raw)
    if found > META_MAX_DEPTH:
        raise errors.CacheError(
            f"meta file {path}: expected a JSON object of scalars (nested "
            f"{META_MAX_DEPTH} deep), found nesting {found} deep"
        )
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise errors.CacheError(f"meta file {path} is not JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise errors.CacheError(f"meta file {path}: expected a JSON object, found {raw[:80]!r}")
    version = doc.get("format_version")
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        expected = " or ".join(str(v) for v in READABLE_VERSIONS)
        raise _errors.IncompatibleFormatError(
            f"meta file {path} has format_version {version!r}, expected {expected}: it "
            "was written by another version of shardcache sharing this cache directory"
        )
    size, sha256 = doc.get("size"), doc.get("sha256")
    if doc.get("key") != key:
        raise errors.CacheError(f"meta file {path} is for key {doc.get('key')!r}, expected {key!r}")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise errors.CacheError(f"meta file {path}: expected a size >= 0, found {size!r}")
    if sha256 is None and version >= 2:
        return EntryMeta(key=key, size=size, sha256=None)
    if not isinstance(sha256, str) or not re.fullmatch(r"[0-9a-f]{64}", sha256):
        nullable = " or null" if version >= 2 else ""
        raise errors.CacheError(
            f"meta file {path}: expected a hex sha256{nullable}, found {sha256!r}"
        )
    return EntryMeta(key=key, size=size, sha256=sha256)


def check_key(key: str) -> None:
    """Raise InputError unless `key` can name an entry (it becomes a file name)."""
    if not isinstance(key, str) or not KEY_PATTERN.fullmatch(key):
        raise errors.InputError(
            f"cache key must be 1-200 characters of A-Z a-z 0-9 _ - (a content hash), found {key!r}"
        )


def sha256_file(path: Path, *, fsync: bool = False) -> str:
    """sha256 of a file, streamed; optionally fsync it through the same descriptor."""
    digest = hashlib.sha256()
    buffer = bytearray(_HASH_CHUNK)
    view = memoryview(buffer)
    # Never through a link, never waiting for a FIFO's writer (`regular_files`).
    with open(regular_files.open_regular(path, os.O_RDONLY), "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
        if fsync:
            os.fsync(f.fileno())
    return digest.hexdigest()


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
        os.utime(path, ns=(now, now), follow_symlinks=False)
    except PermissionError:
        with contextlib.suppress(PermissionError):
            os.utime(path, follow_symlinks=False)


class Entry:
    """A lease on one committed entry: while held, the entry is never evicted.

    A context manager; `release()` is idempotent and thread-safe. The lease is a shared
    flock held by this object's own descriptor, so leases are independent of each other
    even within one process, and the kernel drops them if the process dies. A sole
    writer's tier may hold one in its own memory instead (`unpin` instead of
    `lease_fd`: `Tier.hold`), where only that tier evicts.
    """

    def __init__(
        self,
        *,
        key: str,
        path: Path,
        size: int,
        sha256: str | None,
        lease_fd: int | None = None,
        unpin: Callable[[], None] | None = None,
    ) -> None:
        if (lease_fd is None) == (unpin is None):
            raise ValueError("an Entry is held by a lease descriptor or by an unpin, one of them")
        self.key = key
        self.path = path
        self.size = size
        self.sha256 = sha256
        # finalize runs at most once, on release() or when the Entry is collected.
        self._finalizer = (
            weakref.finalize(self, _locks.close, lease_fd)
            if lease_fd is not None
            else weakref.finalize(self, unpin)  # type: ignore[arg-type]
        )

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
