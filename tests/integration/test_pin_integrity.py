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
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

import shardcache
from shardcache import contract, errors, manifests, plans, sidecar_client, source
from shardcache.node import tiers
from tests.support.faultproxy import FaultProxy
from tests.support.s3server import S3Server
from tests.support.sidecar import SidecarProcess

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
    assert [s.sha256 for s in before.shards] == [
        source.content_sha256(pafs.LocalFileSystem(), str(dataset / name))
        for name in ("a.parquet", "b.parquet")
    ]
    change_in_place(dataset / "a.parquet", list(range(1000, 1100)))
    after = manifests.resolve(dataset.as_uri())
    assert after.digest != before.digest


def fetch_first_shard(
    fs: pafs.FileSystem, pinned: manifests.Manifest, dest: Path, *, sha256: str | None = None
) -> None:
    """Fetch shard 0 (a.parquet) of `pinned` as the cache does: held to its pinned size
    and store identity, and to `sha256` where given."""
    source.download(
        fs,
        pinned.shard_uri_path(0),
        dest,
        expected_size=pinned.shards[0].size,
        what="fetching shard 0 (a.parquet)",
        identity=pinned.shards[0].version,
        sha256=sha256,
    )


def test_a_fetch_of_a_changed_shard_is_refused_naming_both_identities(
    dataset: Path, tmp_path: Path
) -> None:
    pinned = manifests.resolve(dataset.as_uri())
    change_in_place(dataset / "a.parquet", list(range(1000, 1100)))
    fs, _ = source.filesystem(dataset.as_uri())
    with pytest.raises(errors.ManifestMismatchError) as caught:
        fetch_first_shard(fs, pinned, tmp_path / "fetched", sha256=pinned.shards[0].sha256)
    message = str(caught.value)
    assert "a.parquet" in message and f"sha256:{pinned.shards[0].sha256}" in message
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
        fetch_first_shard(s3, pinned, tmp_path / "fetched")


def _disk_entries(disk: Path) -> dict[str, Path]:
    return {
        m.name[: -len(".meta.json")]: m.with_name(m.name[: -len(".meta.json")])
        for m in disk.glob("*.meta.json")
        if not m.name.startswith("manifest-")
    }


def test_a_forged_s3_shard_in_the_node_tier_is_refused_for_the_second_reader(
    s3_server: S3Server,
    s3_bucket: str,
    fault_proxy: FaultProxy,
    sidecar_factory: Callable[..., SidecarProcess],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The gap manifest version 2 left: an s3:// shard's disk-tier hit was checked
    against the tier's own sha256 (an ETag is no content hash). Two sidecars share one
    node disk tier; between them its shard entries are overwritten with one shard's
    bytes (valid Parquet of the same size, other rows) and self-consistent meta files,
    which the tier's own check passes. The second sidecar serves the pinned rows."""
    fs = s3_server.filesystem()
    fs.create_dir(f"{s3_bucket}/ds")
    for name, first in (("a", 0), ("b", 100), ("c", 200)):
        local = tmp_path / f"{name}.parquet"
        write_shard(local, list(range(first, first + 100)))
        with fs.open_output_stream(f"{s3_bucket}/ds/{name}.parquet") as out:
            out.write(local.read_bytes())
    uri = f"s3://{s3_bucket}/ds"
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    pinned = manifests.resolve(uri, format="parquet")
    assert len({s.size for s in pinned.shards}) == 1  # equal sizes: swaps go unnoticed
    env = {
        **s3_server.env(),
        "AWS_ENDPOINT_URL": fault_proxy.endpoint_url,
        contract.ENV_MANIFEST_DIGEST: pinned.digest,
        contract.ENV_SOURCE_FORMAT: "parquet",
        contract.ENV_DISK_DIR: str(tmp_path / "node-disk"),
    }

    def read_all(proc: SidecarProcess) -> list[int]:
        provider = sidecar_client.SidecarProvider.from_env(
            environ=proc.client_env(), reconnect_timeout=10.0
        )
        ds = shardcache.Dataset(provider, plans.PlanParams(seed=1))
        try:
            return sorted(int(v) for b in ds.batches(64) for v in b.column("x").to_pylist())
        finally:
            ds.close()

    first = sidecar_factory(uri, env=env)
    first.start(wait="ready")
    assert read_all(first) == list(range(300))
    first.stop()

    entries = _disk_entries(tmp_path / "node-disk")
    assert len(entries) == 3
    contents = {key: path.read_bytes() for key, path in entries.items()}
    keys = sorted(contents)
    # Every shard entry gets the first one's bytes: its rows, three times over.
    forged = {key: contents[keys[0]] for key in keys}
    # Every entry's meta file is rewritten to match (the kept manifest's bytes stay).
    assert _forge(tmp_path / "node-disk", lambda old: forged.get(_key_of(contents, old), old)) == 4
    tier = tiers.Tier(tmp_path / "node-disk", limit_bytes=1 << 30, name="disk")
    assert tier.scan().corrupted == 0  # the tier's own record vouches for the forgery
    before = fault_proxy.requests_seen

    second = sidecar_factory(uri, env=env)
    second.start(wait="ready")
    assert read_all(second) == list(range(300))
    assert fault_proxy.requests_seen > before  # fetched again from the store
    _, metrics = second.http_get("/metrics")
    corrupted = [
        line
        for line in metrics.splitlines()
        if line.startswith('shardcache_cache_corrupted_entries_total{tier="disk"}')
    ]
    assert corrupted and float(corrupted[0].rsplit(" ", 1)[1]) == 2
    assert "the manifest pinned" in second.log_tail()


def _key_of(contents: dict[str, bytes], data: bytes) -> str:
    return next((key for key, value in contents.items() if value == data), "")
