"""The pinned manifest a sidecar keeps in the node disk tier: found only for its own pin
and source, never when its content does not hash to the pin."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pytest

from shardcache import manifests
from shardcache.formats import schemas
from shardcache.node import pinned_manifests, tiers
from tests.support import datasets


@pytest.fixture
def resolved(tmp_path: Path) -> tuple[str, manifests.Manifest]:
    root = tmp_path / "ds"
    datasets.write_dataset(pafs.LocalFileSystem(), str(root), [30, 20])
    uri = f"file://{root}"
    return uri, manifests.resolve(uri)


@pytest.fixture
def tier(tmp_path: Path) -> tiers.Tier:
    return tiers.Tier(tmp_path / "disk", limit_bytes=1 << 20, name="disk", fsync=False)


def test_a_kept_manifest_loads_for_the_same_pin_and_source(
    tier: tiers.Tier, resolved: tuple[str, manifests.Manifest]
) -> None:
    uri, manifest = resolved
    assert pinned_manifests.load(tier, digest=manifest.digest, uri=uri) is None
    pinned_manifests.keep(tier, manifest, uri=uri)
    assert pinned_manifests.load(tier, digest=manifest.digest, uri=uri) == manifest
    assert pinned_manifests.load(tier, digest=manifest.digest, uri=uri + "/") == manifest
    other = "sha256:" + "0" * 64
    assert pinned_manifests.load(tier, digest=other, uri=uri) is None
    assert pinned_manifests.load(tier, digest=manifest.digest, uri=uri + "-copy") is None


def test_an_entry_that_does_not_hash_to_the_pin_is_removed(
    tier: tiers.Tier, resolved: tuple[str, manifests.Manifest]
) -> None:
    uri, manifest = resolved
    body = manifest.to_json()
    body["shards"][0]["rows"] += 1  # claims the pinned digest, lists other rows
    forged = json.dumps(body).encode()
    key = pinned_manifests.key(manifest.digest, uri)
    tier.insert(key, len(forged), lambda path: path.write_bytes(forged)).release()
    assert pinned_manifests.load(tier, digest=manifest.digest, uri=uri) is None
    assert not tier.contains(key)


def test_an_entry_naming_another_root_is_not_used(
    tier: tiers.Tier, resolved: tuple[str, manifests.Manifest]
) -> None:
    uri, manifest = resolved
    elsewhere = manifests.Manifest.build("file:///elsewhere", manifest.format, manifest.shards)
    assert elsewhere.digest == manifest.digest  # the digest leaves the root out
    body = json.dumps(elsewhere.to_json()).encode()
    key = pinned_manifests.key(manifest.digest, uri)
    tier.insert(key, len(body), lambda path: path.write_bytes(body)).release()
    assert pinned_manifests.load(tier, digest=manifest.digest, uri=uri) is None


def test_keys_are_tier_keys_versioned_by_the_manifest_format() -> None:
    key = pinned_manifests.key("sha256:" + "a" * 64, "s3://b/ds")
    tiers.check_key(key)
    assert key.startswith(f"manifest-v{manifests.MANIFEST_VERSION}-")
    assert key == pinned_manifests.key("sha256:" + "a" * 64, "s3://b/ds/")
    assert pinned_manifests.key("sha256:" + "a" * 64, "s3://b/ds", 4).startswith("manifest-v4-")


def test_a_version_4_manifest_is_kept_under_its_own_version_and_found_under_either(
    tier: tiers.Tier, tmp_path: Path
) -> None:
    """A release that reads version 3 only looks under `manifest-v3-`: a version-4
    manifest kept there (as every release before versioned keys kept it) it took for
    damage and removed, and the node's next sidecar resolved from the store again."""
    root = tmp_path / "jsonl"
    root.mkdir()
    (root / "part-0.jsonl").write_bytes(b'{"a":1,"b":"x"}\n')
    (root / "part-1.jsonl").write_bytes(b'{"b":"y","a":2}\n')  # fields by name: version 4
    uri = f"file://{root}"
    manifest = manifests.resolve(uri)
    assert manifest.version == manifests.BY_NAME_VERSION == 4
    pinned_manifests.keep(tier, manifest, uri=uri)
    assert tier.contains(pinned_manifests.key(manifest.digest, uri, 4))
    assert not tier.contains(pinned_manifests.key(manifest.digest, uri, 3))
    assert pinned_manifests.load(tier, digest=manifest.digest, uri=uri) == manifest
    # As an earlier release kept it: under version 3's key. Still found, and kept there.
    tier.evict(pinned_manifests.key(manifest.digest, uri, 4))
    body = json.dumps(manifest.to_json()).encode()
    old = pinned_manifests.key(manifest.digest, uri, 3)
    tier.insert(old, len(body), lambda path: path.write_bytes(body)).release()
    assert pinned_manifests.load(tier, digest=manifest.digest, uri=uri) == manifest
    assert tier.contains(old)


@pytest.mark.parametrize(
    "spelling",
    [
        "data.parquet",  # relative to the working directory
        "./sub/../data.parquet",
        "{cwd}/data.parquet",  # a bare absolute path
        "file://{cwd}/./data%2Eparquet",  # percent-encoded, not normalised
    ],
)
def test_a_single_file_source_finds_its_kept_manifest_however_it_is_spelled(
    tmp_path: Path, tier: tiers.Tier, monkeypatch: pytest.MonkeyPatch, spelling: str
) -> None:
    datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / "one"), [40])
    (tmp_path / "one" / "part-00000.parquet").rename(tmp_path / "data.parquet")
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    uri = spelling.format(cwd=tmp_path)
    manifest = manifests.resolve(uri)
    pinned_manifests.keep(tier, manifest, uri=uri)
    assert pinned_manifests.load(tier, digest=manifest.digest, uri=uri) == manifest
    # Every spelling names one source, so one kept copy serves them all.
    for other in ("data.parquet", f"file://{tmp_path}/data.parquet"):
        assert pinned_manifests.load(tier, digest=manifest.digest, uri=other) == manifest


def test_a_uri_that_names_no_source_finds_nothing_kept_and_keeps_nothing(
    tier: tiers.Tier, resolved: tuple[str, manifests.Manifest]
) -> None:
    _, manifest = resolved
    bad = "s3://bucket/a//b.parquet"  # refused by the resolve that follows
    assert pinned_manifests.load(tier, digest=manifest.digest, uri=bad) is None
    pinned_manifests.keep(tier, manifest, uri=bad)
    assert tier.keys() == []


@pytest.mark.parametrize("count", [0, 1, 255, 256, 257, 600])
@pytest.mark.parametrize("promoted", [False, True])
def test_the_json_encoded_in_pieces_is_the_manifests_json_byte_for_byte(
    count: int, promoted: bool
) -> None:
    """A resolve's child encodes the manifest a few hundred shards at a time (to hand
    it, `handed_manifests`) without ever holding the whole document: the same bytes as
    `Manifest.to_json` dumped whole, the promotion and the piece boundaries included."""
    shards = tuple(
        manifests.ShardEntry(
            path=f"part-{i:05d}.parquet",
            size=1000 + i,
            version=f"etag:{i:032x}",
            rows=10 + i,
            fingerprint="fp",
            sha256=f"{i:064x}",
        )
        for i in range(count)
    )
    schema = schemas.encode(pa.schema([pa.field("note", pa.string())])) if promoted else None
    manifest = manifests.Manifest.build("s3://b/ds", "parquet", shards, promoted=schema)
    whole = json.dumps(manifest.to_json(), sort_keys=True, separators=(",", ":")).encode()
    assert pinned_manifests.encode(manifest) == whole
    assert b"".join(pinned_manifests.pieces(manifest, shards_per_piece=7)) == whole
    assert manifests.Manifest.from_json(json.loads(whole)) == manifest
