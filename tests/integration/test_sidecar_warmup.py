"""The warm gate of a real sidecar: waiting for the first shards of the startup plan,
opening with fewer of them when the memory tier cannot hold them all, and staying shut
for a shard no memory tier of that size can ever hold."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pytest

import shardcache
from shardcache import contract, formats, plans, sidecar_client, source
from tests.support import datasets
from tests.support.faultproxy import FaultProxy
from tests.support.s3server import S3Server
from tests.support.sidecar import SidecarProcess

pytestmark = pytest.mark.integration

Factory = Callable[..., SidecarProcess]
# The memory tier's own wait for room is 300 s: readiness in far less shows the warm-up
# did not wait for room that only its own leases took.
READY_WITHIN_S = 60.0
NO_SHUFFLE = ["--no-shuffle"]


def local_dataset(tmp_path: Path, shard_rows: list[int]) -> tuple[str, pa.Table]:
    root = tmp_path / "ds"
    table = datasets.write_dataset(pafs.LocalFileSystem(), str(root), shard_rows)
    return f"file://{root}", table


def decoded_sizes(uri: str) -> list[int]:
    """Each shard's size in the memory tier (its decoded IPC file), as the sidecar makes it."""
    manifest = shardcache.resolve(uri)
    root = uri.removeprefix("file://")
    sizes = []
    for shard in manifest.shards:
        with pa.OSFile(f"{root}/{shard.path}", "rb") as f:
            sizes.append(formats.decode(manifest.format, f).size)
    return sizes


def warm_gate(body: Any) -> dict[str, Any]:
    gates = {check["name"]: check for check in body["checks"]}
    return gates["warm"]  # type: ignore[no-any-return]


def poll_readyz(
    proc: SidecarProcess, until: Callable[[int, Any], bool], timeout: float = READY_WITHIN_S
) -> tuple[int, Any]:
    deadline = time.monotonic() + timeout
    status, body = proc.http_get("/readyz")
    while not until(status, body):
        assert time.monotonic() < deadline, f"last /readyz: {status} {body}\n{proc.log_tail()}"
        time.sleep(0.02)
        status, body = proc.http_get("/readyz")
    return status, body


def test_first_shards_that_do_not_fit_in_memory_become_ready_with_the_ones_that_do(
    sidecar_factory: Factory, tmp_path: Path
) -> None:
    uri, table = local_dataset(tmp_path, [300] * 6)
    sizes = decoded_sizes(uri)
    # Shards 0 and 1 fit; shard 2 would need more than the half of it that is left.
    limit = sizes[0] + sizes[1] + sizes[2] // 2
    env = {contract.ENV_MEMORY_LIMIT: str(limit), contract.ENV_READY_SHARDS: "4"}
    proc = sidecar_factory(uri, env=env, args=NO_SHUFFLE)
    proc.start()
    # Far less than the memory tier's own 300 s wait for room: ready at all shows the
    # warm-up did not wait for room only its own leases took.
    body = proc.wait_for("/readyz", timeout=READY_WITHIN_S)
    assert warm_gate(body) == {
        "name": "warm",
        "ok": True,
        "reason": (
            f"first 2 of 4 startup shards [0, 1] resident; shard 2 ({sizes[2]} bytes "
            f"decoded) does not fit beside them ({sizes[0] + sizes[1]} bytes) in the memory "
            f"tier (limit {limit} bytes): raise spec.cache.memory ({contract.ENV_MEMORY_LIMIT}) "
            f"or lower spec.prefetch.readyShards ({contract.ENV_READY_SHARDS})"
        ),
    }
    status = proc.control("GET", "/v1/status")[1]
    assert status["startup"] == {"wanted": 4, "resident": 2, "shards": [0, 1]}
    said = [json.loads(line) for line in proc.log_tail().splitlines() if "first 2 of 4" in line]
    assert [line["level"] for line in said] == ["WARNING"]

    shards = sidecar_client.SidecarProvider.from_env(environ=proc.client_env())
    ds = shardcache.Dataset(shards, plans.PlanParams(seed=7))
    uids = [uid for batch in ds.batches(64) for uid in batch.column("uid").to_pylist()]
    assert sorted(uids) == table.column("uid").to_pylist()  # every uid, each once


def test_readyz_says_it_waits_for_the_first_shards_while_the_store_stalls(
    s3_server: S3Server,
    s3_bucket: str,
    fault_proxy: FaultProxy,
    sidecar_factory: Factory,
) -> None:
    datasets.write_dataset(s3_server.filesystem(), f"{s3_bucket}/ds", [200, 150, 220])
    env = {
        **s3_server.env(),
        "AWS_ENDPOINT_URL": fault_proxy.endpoint_url,
        source.ENV_S3_CONNECT_TIMEOUT: "5",
        source.ENV_S3_REQUEST_TIMEOUT: "10",
        contract.ENV_READY_SHARDS: "2",
    }
    # Every request to the store is held a while (below the request timeout): the
    # manifest resolves slowly, then the first shards arrive slowly.
    fault_proxy.stall_next(100_000, 1.5)
    proc = sidecar_factory(f"s3://{s3_bucket}/ds", env=env, args=NO_SHUFFLE)
    proc.start()

    def manifest_in(status: int, body: Any) -> bool:
        return any(c["name"] == "manifest" and c["ok"] for c in body["checks"])

    status, body = poll_readyz(proc, manifest_in, timeout=120)
    assert status == 503 and body["ready"] is False
    assert warm_gate(body) == {
        "name": "warm",
        "ok": False,
        "reason": "waiting for the first 2 shard(s) of the startup plan",
    }
    assert proc.control("GET", "/v1/status")[1]["startup"] is None

    fault_proxy.clear_faults()
    body = proc.wait_for("/readyz", timeout=READY_WITHIN_S)
    assert warm_gate(body)["reason"] == "first 2 shard(s) [0, 1] resident"
    assert fault_proxy.stalls_injected > 0
    assert proc.control("GET", "/v1/status")[1]["startup"] == {
        "wanted": 2,
        "resident": 2,
        "shards": [0, 1],
    }


def test_a_startup_shard_larger_than_the_memory_tier_keeps_readyz_closed_and_says_so(
    sidecar_factory: Factory, tmp_path: Path
) -> None:
    uri, _ = local_dataset(tmp_path, [100, 100, 3000, 100])
    sizes = decoded_sizes(uri)
    limit = 3 * (sizes[0] + sizes[1])
    assert sizes[2] > limit  # the dataset is built so
    env = {contract.ENV_MEMORY_LIMIT: str(limit), contract.ENV_READY_SHARDS: "4"}
    proc = sidecar_factory(uri, env=env, args=NO_SHUFFLE)
    proc.start()
    status, body = poll_readyz(proc, lambda s, b: "never" in warm_gate(b)["reason"])
    # Refused before decoding (docs/security.md): the size said is the one the shard's
    # metadata gives, a bound the decoded file stays near.
    manifest = shardcache.resolve(uri)
    with pa.OSFile(f"{uri.removeprefix('file://')}/{manifest.shards[2].path}", "rb") as f:
        reported = formats.decoded_size(manifest.format, f, limit=limit)
    assert reported is not None and reported > limit
    expected = (
        f"shard 2 of the first 4 startup shards is {reported} bytes decoded, more than the "
        f"whole memory tier holds (limit {limit} bytes): it can never be resident and every "
        f"read of it fails; raise spec.cache.memory ({contract.ENV_MEMORY_LIMIT}) above "
        f"{reported} bytes"
    )
    assert status == 503
    assert warm_gate(body) == {"name": "warm", "ok": False, "reason": expected}
    # Said once, not retried: the warm-up gave up on a shard that can never fit (a
    # retry would log "retrying" and repeat the reason), and /readyz stays closed.
    status, body = proc.http_get("/readyz")
    assert status == 503 and warm_gate(body)["reason"] == expected
    assert proc.control("GET", "/v1/status")[1]["startup"] is None
    log = proc.log_tail()
    assert log.count("more than the whole memory tier holds") == 1 and "retrying" not in log
