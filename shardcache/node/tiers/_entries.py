"""One entry of a tier: its key, its meta file, and the lease a reader holds on it.

An entry is a data file `<key>` plus a meta file `<key>.meta.json` (size, sha256,
format version); `Entry` is a lease on a committed one (docs/cache-format.md).
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
from pathlib import Path
from types import TracebackType

from shardcache import errors
from shardcache.node.tiers import _errors

#: Version of the tier directory format (docs/cache-format.md); stored in every meta file.
FORMAT_VERSION = 1

# Keys become file names; dots are excluded so that `<key>.lock` and friends can never
# collide with another key's data file.
KEY_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,200}")
# sha256 is streamed in chunks this big: large enough that the per-call overhead is
# negligible, small enough not to matter for memory. hashlib releases the GIL per chunk.
_HASH_CHUNK = 4 * 1024 * 1024


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
        raise _errors.IncompatibleFormatError(
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
    if not isinstance(key, str) or not KEY_PATTERN.fullmatch(key):
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
