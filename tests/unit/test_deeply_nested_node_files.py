"""Files under the node's tiers that any process of the pod could write, nested deeper
than their format allows ("[" a few thousand times): each reader refuses them as it
refuses any corrupt file of that kind (a miss, a file skipped, a re-resolve) and never
raises RecursionError into the trainer or the sidecar."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from shardcache import errors, manifests
from shardcache.node import nested_json, pinned_manifests, tiers, window_claims
from tests.support import datasets

pytestmark = pytest.mark.unit

#: Past the interpreter's recursion limit, inside a meta file's 4 KiB cap.
DEEP = b"[" * 4000


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (b"1", 0),
        (b'{"a": 1}', 1),
        (b'{"a": [1, {"b": null}]}', 3),
        (b'{"a": "[[[{{{\\"[[["}', 1),  # brackets in a string, an escaped quote
        (b"]" + DEEP, 0),  # a parser refuses the first "]" before any "["
        (DEEP, 4000),
    ],
)
def test_depth_counts_nesting_outside_strings(text: bytes, expected: int) -> None:
    assert nested_json.depth(text) == expected


def test_a_deeply_nested_meta_file_is_a_corrupt_meta_file(tmp_path: Path) -> None:
    path = tmp_path / "k.meta"
    path.write_bytes(DEEP)
    with pytest.raises(errors.CacheError, match="expected a JSON object of scalars") as caught:
        tiers.read_meta(path, "k")
    assert str(path) in str(caught.value) and "4000 deep" in str(caught.value)


def test_a_tier_entry_whose_meta_is_deeply_nested_is_a_miss(tmp_path: Path) -> None:
    tier = tiers.Tier(tmp_path / "disk", limit_bytes=1 << 20, name="disk", fsync=False)
    tier.insert("k", 3, lambda path: path.write_bytes(b"abc")).release()
    meta = next(p for p in (tmp_path / "disk").rglob("*") if p.name.startswith("k.meta"))
    meta.write_bytes(DEEP)
    fresh = tiers.Tier(tmp_path / "disk", limit_bytes=1 << 20, name="disk", fsync=False)
    assert fresh.lookup("k") is None
    assert not fresh.contains("k")


def test_a_deeply_nested_claims_file_counts_nothing(tmp_path: Path) -> None:
    claims = tmp_path / window_claims.DIRECTORY
    claims.mkdir()
    (claims / "1-other.json").write_bytes(b'{"version": 1, "readers": ' + DEEP)
    lock = os.open(claims / "1-other.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # its writer is alive
        assert window_claims.Claims(tmp_path).others() == {}
        assert (claims / "1-other.json").exists()  # a live writer's file is left alone
    finally:
        os.close(lock)


def test_a_deeply_nested_pinned_manifest_is_removed_and_resolved_again(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ds"
    datasets.write_dataset(pafs.LocalFileSystem(), str(root), [30, 20])
    uri = f"file://{root}"
    manifest = manifests.resolve(uri)
    tier = tiers.Tier(tmp_path / "disk", limit_bytes=1 << 20, name="disk", fsync=False)
    key = pinned_manifests.key(manifest.digest, uri)
    body = b'{"version": 3, "shards": ' + b"[" * 100_000
    tier.insert(key, len(body), lambda path: path.write_bytes(body)).release()
    assert pinned_manifests.load(tier, digest=manifest.digest, uri=uri) is None
    assert not tier.contains(key)  # so the resolve that follows keeps the real one
    pinned_manifests.keep(tier, manifest, uri=uri)
    assert pinned_manifests.load(tier, digest=manifest.digest, uri=uri) == manifest
