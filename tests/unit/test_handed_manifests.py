"""The pinned manifest the operator hands to a sidecar in ConfigMap parts: used only when
it is whole, its own content hashes to the pin and its root is the sidecar's source."""

from __future__ import annotations

import dataclasses
import gzip
import json
import logging
import os
from pathlib import Path

import pytest

from shardcache import manifests
from shardcache.node import handed_manifests, pinned_manifests
from tests.support import datasets


@pytest.fixture
def resolved(tmp_path: Path) -> tuple[str, manifests.Manifest]:
    uri, _ = datasets.write_local(tmp_path / "ds", [30, 20, 7])
    return uri, manifests.resolve(uri)


def hand(directory: Path, digest: str, uri: str, parts: list[bytes]) -> None:
    directory.mkdir(exist_ok=True)
    for part, data in enumerate(parts):
        (directory / handed_manifests.file_name(digest, uri, part)).write_bytes(data)


def refused(
    directory: Path, manifest: manifests.Manifest, uri: str, caplog: pytest.LogCaptureFixture
) -> str:
    """What loading the manifest pinned as `manifest.digest` from `directory` warned,
    asserting that it was refused."""
    with caplog.at_level(logging.WARNING):
        assert handed_manifests.load(directory, digest=manifest.digest, uri=uri) is None
    return caplog.text


def test_a_handed_manifest_loads_for_its_own_pin_and_source(
    tmp_path: Path, resolved: tuple[str, manifests.Manifest]
) -> None:
    uri, manifest = resolved
    handed = tmp_path / "handed"
    assert handed_manifests.load(handed, digest=manifest.digest, uri=uri) is None
    parts = handed_manifests.encode(manifest)
    assert parts is not None and len(parts) == 1
    hand(handed, manifest.digest, uri, parts)
    assert handed_manifests.load(handed, digest=manifest.digest, uri=uri) == manifest
    # Another spelling of the same source finds it; another pin or source does not.
    assert handed_manifests.load(handed, digest=manifest.digest, uri=uri + "/") == manifest
    other = "sha256:" + "0" * 64
    assert handed_manifests.load(handed, digest=other, uri=uri) is None
    assert handed_manifests.load(handed, digest=manifest.digest, uri=uri + "-copy") is None


def test_a_manifest_over_one_part_is_split_and_joined_in_order(
    tmp_path: Path, resolved: tuple[str, manifests.Manifest], monkeypatch: pytest.MonkeyPatch
) -> None:
    uri, manifest = resolved
    monkeypatch.setattr(handed_manifests, "PART_BYTES", 200)
    parts = handed_manifests.encode(manifest)
    assert parts is not None and len(parts) == 3 and all(len(p) <= 200 for p in parts)
    assert gzip.decompress(b"".join(parts)) == pinned_manifests.encode(manifest)
    hand(tmp_path / "handed", manifest.digest, uri, parts)
    assert handed_manifests.load(tmp_path / "handed", digest=manifest.digest, uri=uri) == manifest


def test_a_manifest_over_every_part_is_not_handed(
    resolved: tuple[str, manifests.Manifest], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, manifest = resolved
    monkeypatch.setattr(handed_manifests, "PART_BYTES", 100)
    assert handed_manifests.encode(manifest) is None


def test_a_missing_part_is_refused_as_a_cut_stream(
    tmp_path: Path,
    resolved: tuple[str, manifests.Manifest],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    uri, manifest = resolved
    monkeypatch.setattr(handed_manifests, "PART_BYTES", 200)
    parts = handed_manifests.encode(manifest)
    assert parts is not None
    hand(tmp_path / "handed", manifest.digest, uri, parts[:2])  # the last ConfigMap missing
    assert "it stops early (a part is missing)" in refused(
        tmp_path / "handed", manifest, uri, caplog
    )


def test_a_forged_manifest_claiming_the_pin_is_refused(
    tmp_path: Path, resolved: tuple[str, manifests.Manifest], caplog: pytest.LogCaptureFixture
) -> None:
    """A ConfigMap anyone in the namespace may write: one shard fewer under the pin's
    name hashes to another digest."""
    uri, manifest = resolved
    body = manifest.to_json()
    forged = gzip.compress(json.dumps({**body, "shards": body["shards"][:-1]}).encode())
    hand(tmp_path / "handed", manifest.digest, uri, [forged])
    warned = refused(tmp_path / "handed", manifest, uri, caplog)
    assert "is not usable" in warned and "resolving from the source" in warned


def test_a_manifest_of_another_root_is_refused(
    tmp_path: Path, resolved: tuple[str, manifests.Manifest]
) -> None:
    """The digest leaves the root out: the same shards under another prefix are handed
    only to that prefix's sidecars."""
    uri, manifest = resolved
    moved = dataclasses.replace(manifest, root=manifest.root + "-elsewhere")
    parts = handed_manifests.encode(moved)
    assert parts is not None
    hand(tmp_path / "handed", manifest.digest, uri, parts)
    assert handed_manifests.load(tmp_path / "handed", digest=manifest.digest, uri=uri) is None


@pytest.mark.parametrize(
    "data",
    [b"not gzip at all", gzip.compress(b"[" * 5000), gzip.compress(b'{"version": 4}')],
    ids=["not-gzip", "nested-deep", "not-a-manifest"],
)
def test_damaged_parts_are_refused_with_a_warning_and_nothing_raised(
    tmp_path: Path,
    resolved: tuple[str, manifests.Manifest],
    data: bytes,
    caplog: pytest.LogCaptureFixture,
) -> None:
    uri, manifest = resolved
    hand(tmp_path / "handed", manifest.digest, uri, [data])
    assert "is not usable" in refused(tmp_path / "handed", manifest, uri, caplog)


def test_a_stream_that_expands_past_the_bound_is_refused_before_it_is_all_inflated(
    tmp_path: Path,
    resolved: tuple[str, manifests.Manifest],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    uri, manifest = resolved
    monkeypatch.setattr(handed_manifests, "MAX_JSON_BYTES", 1 << 16)
    bomb = gzip.compress(b" " * (1 << 22))  # 4 MiB of spaces in about 4 KiB
    hand(tmp_path / "handed", manifest.digest, uri, [bomb])
    assert f"expected at most {1 << 16} bytes of manifest JSON" in refused(
        tmp_path / "handed", manifest, uri, caplog
    )


def test_a_part_over_its_size_is_not_read(
    tmp_path: Path,
    resolved: tuple[str, manifests.Manifest],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    uri, manifest = resolved
    parts = handed_manifests.encode(manifest)
    assert parts is not None
    monkeypatch.setattr(handed_manifests, "PART_BYTES", len(parts[0]) - 1)
    hand(tmp_path / "handed", manifest.digest, uri, parts)
    assert f"expected a part of at most {len(parts[0]) - 1} bytes" in refused(
        tmp_path / "handed", manifest, uri, caplog
    )


def test_parts_projected_as_links_are_read_through_them(
    tmp_path: Path, resolved: tuple[str, manifests.Manifest]
) -> None:
    """As the kubelet projects a ConfigMap: each name a link into `..data/`."""
    uri, manifest = resolved
    parts = handed_manifests.encode(manifest)
    assert parts is not None
    handed = tmp_path / "handed"
    hand(tmp_path / "real", manifest.digest, uri, parts)
    handed.mkdir()
    (handed / "..data").symlink_to(tmp_path / "real")
    for part in range(len(parts)):
        name = handed_manifests.file_name(manifest.digest, uri, part)
        (handed / name).symlink_to(Path("..data") / name)
    assert handed_manifests.load(handed, digest=manifest.digest, uri=uri) == manifest


@pytest.mark.parametrize("kind", ["fifo", "device", "directory"])
def test_a_part_that_is_no_regular_file_is_refused_without_waiting_or_reading_it(
    tmp_path: Path,
    resolved: tuple[str, manifests.Manifest],
    kind: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A FIFO with no writer would block a plain read forever; /dev/zero would be read
    until memory ran out."""
    uri, manifest = resolved
    handed = tmp_path / "handed"
    handed.mkdir()
    name = handed / handed_manifests.file_name(manifest.digest, uri, 0)
    if kind == "fifo":
        os.mkfifo(name)
    elif kind == "device":
        name.symlink_to("/dev/zero")
    else:
        name.mkdir()
    assert "expected a regular file, found a" in refused(handed, manifest, uri, caplog)
