"""Object-store faults seen through a real sidecar: readiness waits, errors reach the client
with their kind and the shard's name, and the sidecar keeps serving afterwards."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pyarrow as pa
import pytest

from shardcache import errors, plans, sidecar_client, source
from tests.support import datasets, waiting
from tests.support.faultproxy import FaultProxy
from tests.support.s3server import S3Server
from tests.support.sidecar import SidecarProcess

pytestmark = pytest.mark.integration

SHARDS = [200, 150, 0, 220, 90]
Factory = Callable[..., SidecarProcess]


@pytest.fixture
def s3_dataset(s3_server: S3Server, s3_bucket: str) -> tuple[str, pa.Table]:
    table = datasets.write_dataset(s3_server.filesystem(), f"{s3_bucket}/ds", SHARDS)
    return f"s3://{s3_bucket}/ds", table


def through_proxy(s3_server: S3Server, proxy: FaultProxy) -> dict[str, str]:
    return {
        **s3_server.env(),
        "AWS_ENDPOINT_URL": proxy.endpoint_url,
        source.ENV_S3_CONNECT_TIMEOUT: "1",
        source.ENV_S3_REQUEST_TIMEOUT: "2",
    }


def test_readyz_waits_while_the_source_is_down_and_turns_ready_when_it_is_back(
    s3_server: S3Server,
    s3_dataset: tuple[str, pa.Table],
    fault_proxy: FaultProxy,
    sidecar_factory: Factory,
) -> None:
    fault_proxy.refuse_connections()
    proc = sidecar_factory(s3_dataset[0], env=through_proxy(s3_server, fault_proxy))
    proc.start()

    def retrying() -> tuple[int, object] | None:
        reply = proc.http_get("/readyz")
        return reply if "retrying" in str(reply[1]) else None

    status, body = waiting.wait_until(
        "/readyz to say the manifest resolve is retrying",
        retrying,
        interval=0.2,
        describe=proc.log_tail,
    )
    assert status == 503 and "resolving the manifest" in str(body) and "retrying" in str(body)
    assert proc.http_get("/healthz")[0] == 200
    with pytest.raises(errors.SidecarUnavailableError, match="resolving the manifest"):
        sidecar_client.SidecarProvider.from_env(environ=proc.client_env(), reconnect_timeout=1)

    fault_proxy.accept_connections()
    proc.wait_for("/readyz", timeout=90)
    shards = sidecar_client.SidecarProvider.from_env(environ=proc.client_env())
    assert shards.manifest.shard_rows == SHARDS


def test_a_source_failure_reaches_the_client_as_source_error_and_the_sidecar_recovers(
    s3_server: S3Server,
    s3_dataset: tuple[str, pa.Table],
    fault_proxy: FaultProxy,
    sidecar_factory: Factory,
) -> None:
    args = ["--no-shuffle", "--ready-shards", "1", "--prefetch-depth", "0"]
    proc = sidecar_factory(s3_dataset[0], env=through_proxy(s3_server, fault_proxy), args=args)
    proc.start(wait="ready")
    shards = sidecar_client.SidecarProvider.from_env(
        environ=proc.client_env(), reconnect_timeout=10
    )
    reader = shards.open_reader(plans.PlanParams(shuffle=False), position=0)
    shards.acquire(reader, 0, epoch=0, position=0).release()  # resident since start-up

    fault_proxy.refuse_connections()
    with pytest.raises(errors.SourceError) as info:
        shards.acquire(reader, 3, epoch=0, position=0)
    assert "shard 3 (part-00003.parquet)" in str(info.value)
    assert "kind=source" in str(info.value)

    fault_proxy.accept_connections()
    lease = shards.acquire(reader, 3, epoch=0, position=0)
    assert lease.path.stat().st_size > 0
    lease.release()
    _, text = proc.http_get("/metrics")
    assert "shardcache_source_errors_total 1.0" in text


def test_probes_and_other_readers_are_served_while_an_acquire_waits_on_a_stalled_store(
    s3_server: S3Server,
    s3_dataset: tuple[str, pa.Table],
    fault_proxy: FaultProxy,
    sidecar_factory: Factory,
) -> None:
    args = ["--no-shuffle", "--ready-shards", "1", "--prefetch-depth", "0"]
    proc = sidecar_factory(s3_dataset[0], env=through_proxy(s3_server, fault_proxy), args=args)
    proc.start(wait="ready")
    shards = sidecar_client.SidecarProvider.from_env(environ=proc.client_env())
    slow = shards.open_reader(plans.PlanParams(shuffle=False), position=0)
    other = shards.open_reader(plans.PlanParams(shuffle=False), position=0)
    # Every request to the store hangs for a while (below the S3 request timeout).
    fault_proxy.stall_next(1000, 1.5)
    result: list[object] = []
    acquiring = threading.Thread(
        target=lambda: result.append(shards.acquire(slow, 4, epoch=0, position=0)), daemon=True
    )
    acquiring.start()
    waiting.wait_until("the proxy to hold a store request", lambda: fault_proxy.stalls_injected)
    assert acquiring.is_alive()
    # While that acquire waits on the store, the event loop answers everyone else.
    assert proc.http_get("/healthz")[0] == 200
    assert proc.control("GET", "/readyz")[0] == 200
    shards.acquire(other, 0, epoch=0, position=0).release()  # resident: no store needed
    assert acquiring.is_alive()
    fault_proxy.clear_faults()
    acquiring.join(60)
    assert not acquiring.is_alive() and len(result) == 1
