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
    # A short retry budget: the default rides out a minute of refused connections.
    args = ["--no-shuffle", "--ready-shards", "1", "--prefetch-depth", "0"]
    args += ["--source-retry-seconds", "1"]
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
    assert 'shardcache_source_errors_total{op="fetch"} 1.0' in text


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


def readyz_saying(proc: SidecarProcess, text: str) -> tuple[int, object]:
    """/readyz once its answer holds `text`."""

    def said() -> tuple[int, object] | None:
        reply = proc.http_get("/readyz")
        return reply if text in str(reply[1]) else None

    return waiting.wait_until(f"/readyz to say {text!r}", said, describe=proc.log_tail)


def source_errors(proc: SidecarProcess, op: str) -> float:
    _, text = proc.http_get("/metrics")
    prefix = f'shardcache_source_errors_total{{op="{op}"}} '
    (line,) = [line for line in str(text).splitlines() if line.startswith(prefix)]
    return float(line.removeprefix(prefix))


def test_a_source_failing_at_start_up_is_counted_while_readyz_says_it_retries(
    s3_server: S3Server,
    s3_dataset: tuple[str, pa.Table],
    fault_proxy: FaultProxy,
    sidecar_factory: Factory,
) -> None:
    """No shard is fetched before the manifest is resolved: without its own count, the
    source-error rule and alert stayed at zero while every new pod was stuck."""
    fault_proxy.refuse_connections()
    proc = sidecar_factory(s3_dataset[0], env=through_proxy(s3_server, fault_proxy))
    proc.start()
    count = waiting.wait_until(
        "the failed manifest resolution to be counted",
        lambda: source_errors(proc, "manifest") or None,
        interval=0.2,
        describe=proc.log_tail,
    )
    assert count >= 1
    assert source_errors(proc, "fetch") == 0
    status, body = proc.http_get("/readyz")
    assert status == 503 and "retrying" in str(body)
    fault_proxy.accept_connections()
    proc.wait_for("/readyz", timeout=90)


def test_refused_credentials_at_start_up_are_counted_and_named_in_readyz(
    s3_server: S3Server, s3_dataset: tuple[str, pa.Table], sidecar_factory: Factory
) -> None:
    env = {**s3_server.env(), "AWS_SECRET_ACCESS_KEY": "not-the-key"}
    proc = sidecar_factory(s3_dataset[0], env=env)
    proc.start()
    status, body = readyz_saying(proc, "refused")
    assert status == 503
    assert "the object store refused the credentials" in str(body)
    assert "not-the-key" not in str(body)
    assert source_errors(proc, "manifest") == 1
    # The trainer gets what embedded mode raises, not a plain InputError.
    with pytest.raises(errors.AccessDeniedError, match=r"HTTP 409, kind=input, code=access_denied"):
        sidecar_client.SidecarProvider.from_env(environ=proc.client_env(), reconnect_timeout=1)
    assert proc.running, "the sidecar exited: it must keep saying why"


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"AWS_SECRET_ACCESS_KEY": ""}, "AWS_SECRET_ACCESS_KEY is missing"),
        ({"AWS_ACCESS_KEY_ID": ""}, "AWS_ACCESS_KEY_ID is missing"),
        ({"AWS_ACCESS_KEY_ID": "AKIAWITHNEWLINE\n"}, "AWS_ACCESS_KEY_ID begins or ends with"),
    ],
    ids=["no-secret-key", "no-key-id", "newline"],
)
def test_a_sidecar_whose_secret_lacks_a_key_refuses_at_start_naming_it(
    s3_server: S3Server,
    s3_dataset: tuple[str, pa.Table],
    sidecar_factory: Factory,
    change: dict[str, str],
    named: str,
) -> None:
    proc = sidecar_factory(s3_dataset[0], env={**s3_server.env(), **change})
    proc.start()
    status, body = readyz_saying(proc, "unusable")
    assert status == 503 and named in str(body), body
    assert "AKIAWITHNEWLINE" not in str(body)
    assert source_errors(proc, "manifest") == 1
    # A Secret that can only fail is the pod's configuration, not a refusal by the store.
    with pytest.raises(errors.InputError, match=r"code=bad_request") as refused:
        sidecar_client.SidecarProvider.from_env(environ=proc.client_env(), reconnect_timeout=1)
    assert not isinstance(refused.value, errors.AccessDeniedError)
