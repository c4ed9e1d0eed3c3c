"""Pinned manifests the operator hands to sidecars, so no node reads a dataset to start.

Format version 1 (docs/wire-format.md, "Handed manifests, format version 1"). A sidecar with a pinned
digest and no copy of that manifest on its node (`pinned_manifests`) would resolve the
manifest from the store: list the source and read every shard whole to hash it, once
per pin and node, before it is ready. The operator has just done that work when it
pinned the digest; it writes the manifest's JSON, gzipped, into the mount's namespace
as at most `MAX_PARTS` ConfigMaps of at most `PART_BYTES` each (the parts of one gzip
stream, in order), and the webhook projects them into the sidecar, read-only, as
`<directory>/<file_stem(digest, uri)>.<part>.json.gz`. The sidecar joins the parts it
finds from 0 on, and uses the manifest only when its digest, recomputed from its own
shard list, is the pin and its root is the one the source URI resolves to: the same
trust as a node copy. Whoever can write a ConfigMap in the namespace can make a sidecar
resolve from the store (a forged or stale manifest is refused with a warning), never
read other data: that would take a sha256 preimage.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import zlib
from pathlib import Path

from shardcache import errors, manifests, source
from shardcache.node import pinned_manifests, regular_files

log = logging.getLogger(__name__)

#: The version of this format: the file names, the parts and their encoding.
FORMAT_VERSION = 1
#: Bytes of one part at most: a ConfigMap holds 1 MiB in all, names and metadata included.
PART_BYTES = 768 << 10
#: Parts of one manifest at most (3 MiB gzipped: about 40,000 shards). A larger manifest
#: is not handed, and each node's first sidecar resolves it from the store as before.
MAX_PARTS = 4
#: Bytes a handed manifest's JSON may take once decompressed: a gzip stream of a few
#: MiB could otherwise expand to gigabytes in the sidecar.
MAX_JSON_BYTES = 256 << 20
#: The ConfigMap key each part is stored under. The version is in it and in the file
#: names, so a sidecar never reads a format it does not know: it finds nothing.
DATA_KEY = f"manifest-v{FORMAT_VERSION}.json.gz"


def file_stem(digest: str, uri: str) -> str:
    """The name, without part and suffix, of the files that hand the manifest pinned as
    `digest` for source `uri`. The source is part of it (a mixture's sources may share a
    digest under two roots). Raises `InputError` for a URI that names no source."""
    identity = f"{digest}|{source.identity(uri)}"
    return f"manifest-v{FORMAT_VERSION}-{hashlib.sha256(identity.encode()).hexdigest()[:40]}"


def file_name(digest: str, uri: str, part: int) -> str:
    return part_name(file_stem(digest, uri), part)


def part_name(stem: str, part: int) -> str:
    """The file of `part` of the manifest whose files are named `stem` (`file_stem`)."""
    return f"{stem}.{part}.json.gz"


def encode(manifest: manifests.Manifest) -> list[bytes] | None:
    """The parts that hand `manifest`, or None when its gzipped JSON needs more than
    `MAX_PARTS` parts or expands beyond `MAX_JSON_BYTES`. Compressed as it is encoded,
    a few hundred shards at a time, and given up as soon as it is over: a resolve's
    child does this within its memory limit, beside the manifest itself."""
    deflater = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    packed = bytearray()
    inflated = 0
    for piece in pinned_manifests.pieces(manifest):
        inflated += len(piece)
        packed += deflater.compress(piece)
        if inflated > MAX_JSON_BYTES or len(packed) > PART_BYTES * MAX_PARTS:
            return None
    packed += deflater.flush()
    if len(packed) > PART_BYTES * MAX_PARTS:
        return None
    return [bytes(packed[i : i + PART_BYTES]) for i in range(0, len(packed), PART_BYTES)]


def _joined(directory: Path, stem: str) -> bytes | None:
    """The parts found under `directory`, joined from part 0 until the first missing;
    None when there is no part 0."""
    parts: list[bytes] = []
    for part in range(MAX_PARTS):
        try:
            parts.append(_part(directory / part_name(stem, part)))
        except FileNotFoundError:
            break
    return b"".join(parts) if parts else None


def _part(path: Path) -> bytes:
    """One part's bytes. Through a symbolic link (the kubelet projects each file as a
    link into its `..data` directory), but only of a regular file of at most
    `PART_BYTES`: never waiting on a FIFO, never reading a device or a large file."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode):
            what = regular_files.kind(found.st_mode)
            raise errors.CacheError(f"expected a regular file, found {what} at {path}")
        if found.st_size > PART_BYTES:
            raise errors.CacheError(
                f"expected a part of at most {PART_BYTES} bytes, found {found.st_size} in {path}"
            )
        data = bytearray()
        while len(data) <= PART_BYTES and (chunk := os.read(fd, PART_BYTES + 1 - len(data))):
            data += chunk
        return bytes(data)
    finally:
        os.close(fd)


def _inflated(packed: bytes) -> bytes:
    inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    body = inflater.decompress(packed, MAX_JSON_BYTES + 1)
    if len(body) > MAX_JSON_BYTES:
        raise errors.CacheError(
            f"expected at most {MAX_JSON_BYTES} bytes of manifest JSON, found more"
        )
    if not inflater.eof or inflater.unused_data:
        raise errors.CacheError(
            "expected one whole gzip stream: "
            + ("it stops early (a part is missing)" if not inflater.eof else "bytes follow it")
        )
    return body


def load(directory: Path, *, digest: str, uri: str) -> manifests.Manifest | None:
    """The manifest handed for (`digest`, `uri`) under `directory`, or None: none handed,
    or not usable (said in a warning: the caller resolves from the store)."""
    try:
        stem = file_stem(digest, uri)
    except errors.InputError:
        return None
    try:
        packed = _joined(directory, stem)
        if packed is None:
            return None
        return pinned_manifests.checked(_inflated(packed), digest=digest, uri=uri)
    except (OSError, ValueError, zlib.error, errors.ShardcacheError) as exc:
        log.warning(
            "the manifest handed for %s (%s, from the operator's ConfigMaps) is not "
            "usable (%s); resolving from the source",
            digest,
            directory / f"{stem}.*.json.gz",
            exc,
        )
        return None
