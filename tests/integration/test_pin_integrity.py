"""Every served byte is tied to the pinned manifest's per-shard content identity.

Issue 13, row 2: a shard changed in place (same size, mtime set back) re-resolved to
the same digest and was served; a forged disk-tier entry with its own meta file was
served. Now the digest covers a content identity, every fetch is checked against it,
and disk-tier hits are checked against the manifest, not the entry's meta file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import shardcache
from shardcache import errors, manifests, source
from shardcache.node import tiers
from tests.support.s3server import S3Server

pytestmark = pytest.mark.integration


def write_shard(path: Path, values: list[int]) -> None:
    pq.write_table(pa.table({"x": pa.array(values, pa.int64())}), path, compression="none")


def change_in_place(path: Path, values: list[int]) -> None:
    """Other content, same size, mtime set back: what an mtime pin cannot see."""
    before = path.stat()
    write_shard(path, values)
    assert path.stat().st_size == before.st_size
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    root = tmp_path / "ds"
    root.mkdir()
    write_shard(root / "a.parquet", list(range(100)))
    write_shard(root / "b.parquet", list(range(100, 200)))
    return root


def test_a_shard_changed_in_place_changes_the_digest(dataset: Path) -> None:
    before = manifests.resolve(dataset.as_uri())
    assert all(s.version.startswith(source.SHA256_PREFIX) for s in before.shards)
    change_in_place(dataset / "a.parquet", list(range(1000, 1100)))
    after = manifests.resolve(dataset.as_uri())
    assert after.digest != before.digest


def test_a_fetch_of_a_changed_shard_is_refused_naming_both_identities(
    dataset: Path, tmp_path: Path
) -> None:
    pinned = manifests.resolve(dataset.as_uri())
    change_in_place(dataset / "a.parquet", list(range(1000, 1100)))
    fs, _ = source.filesystem(dataset.as_uri())
    with pytest.raises(errors.ManifestMismatchError) as caught:
        source.download(
            fs,
            pinned.shard_uri_path(0),
            tmp_path / "fetched",
            expected_size=pinned.shards[0].size,
            what="fetching shard 0 (a.parquet)",
            identity=pinned.shards[0].version,
        )
    message = str(caught.value)
    assert "a.parquet" in message and pinned.shards[0].version in message
    assert "not served" in message


def _rows(ds_uri: str, cache: Path, memory: Path) -> list[int]:
    with shardcache.open(ds_uri, cache_dir=cache, memory_dir=memory, shuffle=False) as ds:
        return sorted(int(v) for b in ds.batches(50) for v in b.column("x").to_pylist())


def _forge(disk: Path, replacement: Callable[[bytes], bytes]) -> int:
    """Rewrite every disk-tier entry with other bytes and a matching meta file."""
    forged = 0
    for meta_path in disk.glob("*.meta.json"):
        data_path = meta_path.with_name(meta_path.name[: -len(".meta.json")])
        data = replacement(data_path.read_bytes())
        data_path.write_bytes(data)
        meta = json.loads(meta_path.read_text())
        meta["sha256"] = tiers.sha256_file(data_path)
        meta_path.write_text(json.dumps(meta, sort_keys=True) + "\n")
        forged += 1
    return forged


def test_a_forged_disk_tier_entry_is_never_served(dataset: Path, tmp_path: Path) -> None:
    uri = dataset.as_uri()
    cache = tmp_path / "cache"
    assert _rows(uri, cache, tmp_path / "mem1") == list(range(200))
    # Another writer of the node directory swaps shard a's bytes for a valid shard of
    # the same size with other rows, and writes the meta file to match.
    other = tmp_path / "other.parquet"
    write_shard(other, list(range(5000, 5100)))
    forged_bytes = other.read_bytes()
    assert _forge(
        cache / "disk", lambda old: forged_bytes if len(old) == len(forged_bytes) else old
    )
    assert _rows(uri, cache, tmp_path / "mem2") == list(range(200))


def test_s3_shards_are_pinned_by_etag_and_a_rewrite_is_refused_on_fetch(
    s3_server: S3Server, s3_bucket: str, tmp_path: Path
) -> None:
    fs = s3_server.filesystem()
    env = s3_server.env()
    local = tmp_path / "a.parquet"
    write_shard(local, list(range(100)))
    fs.create_dir(f"{s3_bucket}/ds")
    with fs.open_output_stream(f"{s3_bucket}/ds/a.parquet") as out:
        out.write(local.read_bytes())
    uri = f"s3://{s3_bucket}/ds/"
    pinned = manifests.resolve(uri, storage_options=env)
    assert pinned.shards[0].version.startswith(source.ETAG_PREFIX)
    # Rewritten with other rows of the same size: the ETag changes, the size does not.
    write_shard(local, list(range(1000, 1100)))
    with fs.open_output_stream(f"{s3_bucket}/ds/a.parquet") as out:
        out.write(local.read_bytes())
    assert manifests.resolve(uri, storage_options=env).digest != pinned.digest
    s3, _ = source.filesystem(uri, storage_options=env)
    with pytest.raises(errors.ManifestMismatchError, match="not served"):
        source.download(
            s3,
            pinned.shard_uri_path(0),
            tmp_path / "fetched",
            expected_size=pinned.shards[0].size,
            what="fetching shard 0 (a.parquet)",
            identity=pinned.shards[0].version,
        )
