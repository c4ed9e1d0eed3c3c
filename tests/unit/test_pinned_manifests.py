"""The pinned manifest a sidecar keeps in the node disk tier: found only for its own pin
and source, never when its content does not hash to the pin."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from shardcache import manifests
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
