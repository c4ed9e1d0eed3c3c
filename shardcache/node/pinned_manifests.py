"""Pinned manifests kept in the node disk tier, so a second pod starts without the store.

Resolving a manifest lists the source and reads every shard's footer: requests to the
object store on every sidecar start, although a pinned digest
(`SHARDCACHE_MANIFEST_DIGEST`) already fixes the answer. The first sidecar on a node
that resolves a manifest matching its pin keeps the manifest's JSON as a disk-tier
entry (docs/cache-format.md, "Entry kinds"); the next one with the same pin and source
reads it from there and, with every shard on the node too, never asks the store.

Trust: the entry is used only when the manifest's digest, recomputed from its own shard
list, is the pin, and its root is the one the source URI resolves to. A damaged or
forged file cannot match (it would need a sha256 preimage); it is removed, and the
sidecar resolves from the store as before.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path

from shardcache import errors, manifests, source
from shardcache.node import nested_json, tiers

log = logging.getLogger(__name__)

#: The key prefix of this entry kind, then the manifest's own version (`key`): a sidecar
#: of a release that does not read that version never finds the entry (it would take it
#: for damage, remove it, and the node's next sidecar would resolve from the store).
KEY_PREFIX = "manifest-v"


#: How deep a kept manifest's JSON nests: the manifest, its shard list, a shard.
MAX_DEPTH = 3


def key(digest: str, uri: str, version: int = manifests.MANIFEST_VERSION) -> str:
    """The disk-tier key of the manifest of `version` pinned as `digest` for source
    `uri`. The digest covers the version, so the pin alone does not say it: a reader
    looks under each version it reads (`load`).

    The digest leaves the root out (a copy under another prefix is the same dataset),
    but a manifest names its root, so the source is part of the key: its identity
    (`source.identity`), so that "data.parquet", "file:///cwd/data.parquet" and
    "s3://b/ds/" find what "s3://b/ds" kept. Raises `InputError` for a URI that names
    no source."""
    identity = f"{digest}|{source.identity(uri)}"
    return f"{KEY_PREFIX}{version}-" + hashlib.sha256(identity.encode()).hexdigest()[:40]


def _resolves_from(manifest: manifests.Manifest, uri: str) -> bool:
    """Whether `manifests.resolve(uri)` gives `manifest.root`: the prefix itself, or for
    a single-object dataset the object's parent (its one shard named by the object).
    Compared as identities: the root is cut from the URI as written, the shard's name
    is decoded."""
    wanted = source.identity(uri)
    root = source.identity(manifest.root)
    if root == wanted:
        return True
    return len(manifest.shards) == 1 and f"{root.rstrip('/')}/{manifest.shards[0].path}" == wanted


def load(tier: tiers.Tier, *, digest: str, uri: str) -> manifests.Manifest | None:
    """The manifest kept for (`digest`, `uri`), or None: not kept, or not trustworthy
    (then removed, so the caller's `keep` replaces it), or `uri` names no source (the
    resolve that follows says why)."""
    try:
        # Under each version this release reads: releases before versioned keys kept a
        # version-4 manifest under version 3's.
        keys = [key(digest, uri, version) for version in manifests.READABLE]
    except errors.InputError:
        return None
    for entry_key in keys:
        entry = tier.lookup(entry_key, count=False)
        if entry is not None:
            break
    else:
        return None
    with entry:
        raw = Path(entry.path).read_bytes()
    try:
        manifest = checked(raw, digest=digest, uri=uri)
    except (ValueError, errors.ShardcacheError) as exc:
        log.warning(
            "the node's copy of manifest %s for %s is not usable (%s); removing it and "
            "resolving from the source",
            digest,
            uri,
            exc,
        )
        tier.evict(entry_key)
        return None
    return manifest


def checked(raw: bytes, *, digest: str, uri: str) -> manifests.Manifest:
    """The manifest whose JSON is `raw`, when it is the one pinned as `digest` for
    `uri`; else `ValueError` or a `ShardcacheError` saying what it is instead."""
    found = nested_json.depth(raw)
    if found > MAX_DEPTH:
        raise errors.CacheError(
            f"expected JSON nested at most {MAX_DEPTH} deep (a manifest, its shard "
            f"list, a shard), found {found} deep"
        )
    try:
        manifest = manifests.Manifest.from_json(json.loads(raw))
    except (KeyError, TypeError, AttributeError) as exc:
        raise errors.InputError(f"malformed manifest: {exc!r}") from exc
    if manifest.digest != digest:
        raise errors.ManifestMismatchError(f"it is manifest {manifest.digest}")
    if not _resolves_from(manifest, uri):
        raise errors.ManifestMismatchError(f"its root {manifest.root} is not {uri}")
    return manifest


def encode(manifest: manifests.Manifest) -> bytes:
    """`manifest`'s JSON as it is kept and handed: `Manifest.to_json`, keys sorted and
    no spaces."""
    return b"".join(pieces(manifest))


def pieces(manifest: manifests.Manifest, shards_per_piece: int = 256) -> Iterator[bytes]:
    """`encode(manifest)` in pieces of `shards_per_piece` shards: the same bytes, never
    the whole document (nor a dict per shard) in memory at once, so that a resolve's
    child hands a manifest of many shards within its memory limit."""
    head = manifest.to_json_head()
    version = head.pop("version")
    # Sorted keys: every other field comes before "shards", and "version" after it.
    assert all(key < "shards" for key in head)
    yield _compact(head)[:-1] + b',"shards":['
    shards = manifest.shards
    for start in range(0, len(shards), shards_per_piece):
        chunk = shards[start : start + shards_per_piece]
        yield (b"," if start else b"") + b",".join(_compact(dataclasses.asdict(s)) for s in chunk)
    yield b'],"version":' + _compact(version) + b"}"


def _compact(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def keep(tier: tiers.Tier, manifest: manifests.Manifest, *, uri: str) -> None:
    """Keep `manifest` (resolved from `uri` and matching its pin) for the node's next
    sidecars. Best effort: a full or failing disk tier only costs them a resolve."""
    body = encode(manifest)

    def write(path: Path) -> None:
        with path.open("r+b") as f:
            f.write(body)

    try:
        entry, _ = tier.get_or_insert(key(manifest.digest, uri, manifest.version), len(body), write)
    except (OSError, errors.CacheError, errors.InputError) as exc:
        log.warning("could not keep manifest %s in the node disk tier: %s", manifest.digest, exc)
        return
    entry.release()
