"""A second sidecar on the node starts and serves a whole epoch without one object-store
request: the pinned manifest and every shard come from the node disk tier.

Two real sidecars share one disk directory, with a pinned digest, against MinIO behind
the counting proxy (`FaultProxy.requests_seen`: every request that reaches the store).
A forged manifest in the disk tier (a valid entry whose shard list does not hash to the
pin) is never used: that sidecar resolves from the store and serves the real dataset.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pytest

import shardcache
from shardcache import contract, manifests, plans, sidecar_client, source
from shardcache.node import handed_manifests, pinned_manifests, tiers
from tests.support import datasets
from tests.support.faultproxy import FaultProxy
from tests.support.s3server import S3Server
from tests.support.sidecar import SidecarProcess

pytestmark = pytest.mark.integration

SHARDS = [200, 150, 220, 90]
Factory = Callable[..., SidecarProcess]


@pytest.fixture
def s3_dataset(s3_server: S3Server, s3_bucket: str) -> tuple[str, pa.Table]:
    table = datasets.write_dataset(s3_server.filesystem(), f"{s3_bucket}/ds", SHARDS)
    return f"s3://{s3_bucket}/ds", table


@pytest.fixture
def real(
    s3_server: S3Server, s3_dataset: tuple[str, pa.Table], monkeypatch: pytest.MonkeyPatch
) -> manifests.Manifest:
    """The dataset's manifest, resolved straight from MinIO (not through the proxy)."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    return manifests.resolve(s3_dataset[0], format="parquet")


def pinned(digest: str, s3_server: S3Server, proxy: FaultProxy) -> dict[str, str]:
    """The env of a sidecar pinned to `digest` like the webhook pins it."""
    return {
        **s3_server.env(),
        "AWS_ENDPOINT_URL": proxy.endpoint_url,
        source.ENV_S3_CONNECT_TIMEOUT: "1",
        source.ENV_S3_REQUEST_TIMEOUT: "2",
        contract.ENV_MANIFEST_DIGEST: digest,
        contract.ENV_SOURCE_FORMAT: "parquet",
    }


def read_all(proc: SidecarProcess) -> list[int]:
    shards = sidecar_client.SidecarProvider.from_env(
        environ=proc.client_env(), reconnect_timeout=10.0
    )
    ds = shardcache.Dataset(shards, plans.PlanParams(seed=1))
    try:
        return sorted(u for b in ds.batches(64) for u in b.column("uid").to_pylist())
    finally:
        ds.close()


def loads(proc: SidecarProcess, origin: str) -> int:
    _, text = proc.http_get("/metrics")
    for line in text.splitlines():
        if line.startswith(f'shardcache_manifest_loads_total{{origin="{origin}"}}'):
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


def test_a_second_sidecar_on_the_node_makes_no_object_store_request(
    s3_server: S3Server,
    s3_dataset: tuple[str, pa.Table],
    real: manifests.Manifest,
    fault_proxy: FaultProxy,
    sidecar_factory: Factory,
    tmp_path: Path,
) -> None:
    uri, table = s3_dataset
    env = pinned(real.digest, s3_server, fault_proxy)
    disk = tmp_path / "node-disk"
    first = sidecar_factory(uri, env={**env, contract.ENV_DISK_DIR: str(disk)})
    first.start(wait="ready")
    assert read_all(first) == list(range(table.num_rows))
    assert loads(first, "source") == 1 and loads(first, "node") == 0
    first.stop()
    before = fault_proxy.requests_seen
    assert before > 0  # the first sidecar did go to the store

    second = sidecar_factory(uri, env={**env, contract.ENV_DISK_DIR: str(disk)})
    second.start(wait="ready")
    assert read_all(second) == list(range(table.num_rows))
    assert fault_proxy.requests_seen == before  # not one request: no LIST, no GET
    assert loads(second, "node") == 1 and loads(second, "source") == 0


def test_a_forged_manifest_in_the_disk_tier_is_not_used(
    s3_server: S3Server,
    s3_dataset: tuple[str, pa.Table],
    real: manifests.Manifest,
    fault_proxy: FaultProxy,
    sidecar_factory: Factory,
    tmp_path: Path,
) -> None:
    uri, table = s3_dataset
    digest = real.digest
    env = pinned(digest, s3_server, fault_proxy)
    disk = tmp_path / "node-disk"
    # A complete, checksummed entry under the right key claiming the pinned digest, but
    # listing one shard fewer: its own content hashes to another digest.
    body = real.to_json()
    forged = json.dumps({**body, "shards": body["shards"][:-1]}).encode()
    tier = tiers.Tier(disk, limit_bytes=1 << 30, name="disk")

    def write(path: Path) -> None:
        path.write_bytes(forged)

    tier.insert(pinned_manifests.key(digest, uri), len(forged), write).release()

    proc = sidecar_factory(uri, env={**env, contract.ENV_DISK_DIR: str(disk)})
    proc.start(wait="ready")
    assert read_all(proc) == list(range(table.num_rows))  # every shard, the last one too
    assert loads(proc, "source") == 1 and loads(proc, "node") == 0
    assert "is not usable" in proc.log_tail()
    # Replaced by the real one for the next sidecar.
    kept = pinned_manifests.load(tier, digest=digest, uri=uri)
    assert kept is not None and kept.shard_rows == SHARDS


def hand(directory: Path, manifest: manifests.Manifest, uri: str, pin: str | None = None) -> None:
    """Write the manifest's parts as the webhook projects the operator's ConfigMaps:
    under the names of `pin` (default: the manifest's own digest)."""
    parts = handed_manifests.encode(manifest)
    assert parts is not None
    directory.mkdir()
    for part, data in enumerate(parts):
        name = handed_manifests.file_name(pin or manifest.digest, uri, part)
        (directory / name).write_bytes(data)


def test_a_sidecar_handed_its_pinned_manifest_starts_with_the_store_unreachable(
    s3_server: S3Server,
    s3_dataset: tuple[str, pa.Table],
    real: manifests.Manifest,
    fault_proxy: FaultProxy,
    sidecar_factory: Factory,
    tmp_path: Path,
) -> None:
    """The first sidecar of a pin on a node: no listing and no read of every shard to
    hash it; its manifest gate opens while the store refuses every connection, it reads
    the shards once the store is back, and it keeps the manifest for the node's next."""
    uri, table = s3_dataset
    handed = tmp_path / "handed"
    hand(handed, real, uri)
    disk = tmp_path / "node-disk"
    env = {
        **pinned(real.digest, s3_server, fault_proxy),
        contract.ENV_DISK_DIR: str(disk),
        contract.ENV_HANDED_MANIFESTS_DIR: str(handed),
        contract.ENV_READY_SHARDS: "0",
    }
    fault_proxy.refuse_connections()
    proc = sidecar_factory(uri, env=env)
    proc.start(wait="ready")
    assert loads(proc, "operator") == 1 and loads(proc, "source") == 0
    assert fault_proxy.requests_seen == 0
    fault_proxy.accept_connections()
    assert read_all(proc) == list(range(table.num_rows))
    assert fault_proxy.requests_seen > 0  # the shards, fetched as they are read
    kept = pinned_manifests.load(
        tiers.Tier(disk, limit_bytes=1 << 30, name="disk"), digest=real.digest, uri=uri
    )
    assert kept == real


def test_a_stale_manifest_handed_for_another_pin_is_not_used(
    s3_server: S3Server,
    s3_dataset: tuple[str, pa.Table],
    real: manifests.Manifest,
    fault_proxy: FaultProxy,
    sidecar_factory: Factory,
    tmp_path: Path,
) -> None:
    """The ConfigMap of a mount pinned again since the pod was admitted (or one a tenant
    wrote) hands a manifest that is not the pin under the pin's name: refused, said in
    the log, and the sidecar resolves from the store as before."""
    uri, table = s3_dataset
    other = manifests.Manifest.build(real.root, real.format, real.shards[:-1])
    handed = tmp_path / "handed"
    hand(handed, other, uri, pin=real.digest)
    env = {
        **pinned(real.digest, s3_server, fault_proxy),
        contract.ENV_DISK_DIR: str(tmp_path / "node-disk"),
        contract.ENV_HANDED_MANIFESTS_DIR: str(handed),
    }
    proc = sidecar_factory(uri, env=env)
    proc.start(wait="ready")
    assert read_all(proc) == list(range(table.num_rows))  # every shard, the last one too
    assert loads(proc, "source") == 1 and loads(proc, "operator") == 0
    assert "from the operator's ConfigMaps) is not usable" in proc.log_tail()
    assert "nor handed by the operator" in proc.log_tail()  # why its start reads the data
