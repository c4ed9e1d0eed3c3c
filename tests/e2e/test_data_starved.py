"""DataStarved set and cleared through the real API server (issue 16, item 5).

A real sidecar process stands in for the one the webhook injected into a kwok pod: it
listens on 127.0.0.1 at the port the webhook gave the pod's sidecar, and the pod's
status.podIP points there, so the operator reads it exactly as it reads an in-cluster
sidecar. A trainer reads through it from storage too slow for it (every batch waits
50 ms for a shard, `tests.support.stalls`) doing nothing between batches, until
DataStarved is set with an Event naming the pod; then storage keeps up and the loop
computes 20 ms per batch, until the condition clears.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes.client
import pyarrow.fs as pafs
import pytest

import shardcache
from shardcache import plans, sidecar_client
from shardcache.contract import variables
from tests.e2e import harness, objects
from tests.e2e.conftest import ReadyMount
from tests.support import datasets
from tests.support import stalls as stall_support
from tests.support.sidecar import SidecarProcess

pytestmark = pytest.mark.e2e

SHARDS = [200, 150, 220]
#: More rows than any shard: while storage is slow, every batch waits for a shard.
BATCH_ROWS = 256
RUNNING_TIMEOUT_S = 60.0
#: Far above the operator's 1 s check plus spec.stall.forSeconds below.
CONDITION_TIMEOUT_S = 90.0


def first_free_port(start: int) -> tuple[int, socket.socket]:
    """The first port from `start` free on loopback, held by a bound socket until the
    sidecar takes it (closed just before)."""
    for port in range(start, start + 200):
        s = socket.socket()
        try:
            s.bind((harness.HOST, port))
        except OSError:
            s.close()
            continue
        return port, s
    raise AssertionError(f"no free port in {start}..{start + 199}")


def test_data_starved_is_set_with_an_event_naming_the_pod_and_cleared_on_recovery(
    admin: kubernetes.client.ApiClient,
    operator: harness.Operator,
    ready_mount: ReadyMount,
    sidecar_factory: Callable[..., SidecarProcess],
    tmp_path: Path,
) -> None:
    if not isinstance(operator, harness.LocalOperator):
        pytest.skip("the stand-in sidecar listens on this machine's loopback (local cluster)")
    namespace = ready_mount.namespace
    name = objects.unique("starve")
    mount = objects.create_datasetmount(
        admin,
        namespace,
        objects.datasetmount(
            name, ready_mount.uri, stall={"thresholdPercent": 50, "forSeconds": 2}
        ),
    )
    objects.wait_phase(admin, namespace, name, "Ready", operator)

    first = variables.METRICS_PORT.default
    port, held = first_free_port(first)
    body = objects.pod(objects.unique("trainer"), name)
    # Ports below the free one declared by the trainer, so the webhook's next free port
    # (docs/operator.md, "Injection") is the one the stand-in sidecar can listen on.
    body["spec"]["containers"][0]["ports"] = [
        {"containerPort": p, "protocol": "TCP"} for p in range(first, port)
    ]
    core = kubernetes.client.CoreV1Api(admin)
    created = core.create_namespaced_pod(namespace, body)
    pod_name = created.metadata.name
    sidecar = next(c for c in created.spec.init_containers or [] if c.restart_policy == "Always")
    assert sidecar.ports[0].container_port == port

    def running() -> dict[str, Any] | None:
        raw = core.read_namespaced_pod(pod_name, namespace, _preload_content=False)
        got: dict[str, Any] = json.loads(raw.data)
        return got if got["status"].get("phase") == "Running" else None

    running_pod = harness.wait_until(f"pod {pod_name} Running", running, timeout=RUNNING_TIMEOUT_S)
    # Where the operator finds this pod's sidecar: the stand-in's loopback address.
    running_pod["status"]["podIP"] = harness.HOST
    running_pod["status"]["podIPs"] = [{"ip": harness.HOST}]
    core.replace_namespaced_pod_status(pod_name, namespace, running_pod)

    root = tmp_path / "ds"
    datasets.write_dataset(pafs.LocalFileSystem(), str(root), SHARDS)
    proc = sidecar_factory(f"file://{root}")
    proc.port = port
    held.close()
    proc.start(wait="ready")

    stalled = threading.Event()
    stalled.set()
    stop = threading.Event()

    def step() -> None:
        if not stalled.is_set():
            stop.wait(0.02)

    shards = stall_support.SlowShards(
        sidecar_client.SidecarProvider.from_env(environ=proc.client_env())
    )
    ds = shardcache.Dataset(shards, plans.PlanParams())
    reader = threading.Thread(
        target=stall_support.read_until, args=(stop, ds, BATCH_ROWS, step), daemon=True
    )
    reader.start()
    try:

        def wait_data_starved(state: str) -> dict[str, Any]:
            """The DataStarved condition, once its status is `state`."""

            def found() -> dict[str, Any] | None:
                status = objects.get_datasetmount(admin, namespace, name).get("status") or {}
                condition = objects.condition(status, "DataStarved")
                return condition if condition.get("status") == state else None

            return harness.wait_until(
                f"DataStarved {state}", found, timeout=CONDITION_TIMEOUT_S, describe=describe
            )

        def describe() -> str:
            status = objects.get_datasetmount(admin, namespace, name).get("status")
            pod_status = core.read_namespaced_pod(pod_name, namespace).status
            _, metrics = proc.http_get("/metrics")
            fraction = [line for line in str(metrics).splitlines() if "stall_fraction" in line]
            return (
                f"status: {status}\npod IP: {pod_status.pod_ip}, phase {pod_status.phase}\n"
                f"sidecar: {fraction}\n{operator.logs()[-3000:]}"
            )

        starved = wait_data_starved("True")
        assert starved["reason"] == "ReadersWaitingOnData"
        assert pod_name in starved["message"]
        uid = mount["metadata"]["uid"]
        warnings = harness.wait_until(
            "a DataStarved Event",
            lambda: objects.events_with(admin, namespace, uid, "DataStarved"),
            timeout=CONDITION_TIMEOUT_S,
        )
        assert warnings[0].type == "Warning" and pod_name in warnings[0].message

        # Storage keeps up again and the loop computes between batches.
        shards.slow.clear()
        stalled.clear()
        cleared = wait_data_starved("False")
        assert cleared["reason"] == "DataKeepsUp"
        harness.wait_until(
            "a DataRecovered Event",
            lambda: objects.events_with(admin, namespace, uid, "DataRecovered"),
            timeout=CONDITION_TIMEOUT_S,
        )
    finally:
        stop.set()
        reader.join(timeout=30)
        ds.close()
        core.delete_namespaced_pod(pod_name, namespace, grace_period_seconds=0)
