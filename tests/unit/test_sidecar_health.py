"""Injected sidecars that were OOMKilled or crash-loop show on their DatasetMount: a
SidecarsHealthy=False condition naming pod, container, reason and limit, and one Warning
Event per dead sidecar in a while (exploration s18-xnode, defect 3: a 40Mi sidecar was
OOMKilled at every start, its pod Pending, while the mount said Ready with no Event)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import kopf
import pytest
from kopf._core.engines import posting
from shardcache_operator import (
    configuration,
    context,
    handlers,
    injection,
    sidecar_checks,
    sidecar_health,
    specs,
    status,
)

from shardcache import contract

pytestmark = pytest.mark.unit


def sidecar_pod(
    name: str = "train-0",
    *,
    mount: str = "data",
    last_reason: str | None = "OOMKilled",
    waiting: str | None = "CrashLoopBackOff",
    restarts: int = 4,
) -> dict[str, Any]:
    container_status: dict[str, Any] = {"name": "shardcache-data", "restartCount": restarts}
    if waiting:
        container_status["state"] = {"waiting": {"reason": waiting}}
    else:
        container_status["state"] = {"running": {}}
    if last_reason:
        container_status["lastState"] = {"terminated": {"reason": last_reason, "exitCode": 137}}
    return {
        "metadata": {"name": name, "namespace": "ml", "labels": {"shardcache.io/mount": mount}},
        "spec": {
            "initContainers": [
                {
                    "name": "shardcache-data",
                    "restartPolicy": "Always",
                    "env": [{"name": contract.ENV_MOUNT, "value": mount}],
                    "resources": {"limits": {"memory": "40Mi"}},
                }
            ],
            "containers": [{"name": "trainer"}],
        },
        "status": {
            "phase": "Pending",
            "initContainerStatuses": [container_status],
            "containerStatuses": [
                {"name": "trainer", "restartCount": 0, "state": {"waiting": {}}},
            ],
        },
    }


def test_an_oomkilled_sidecar_is_named_with_its_pod_container_reason_and_limit() -> None:
    (trouble,) = sidecar_health.troubles(sidecar_pod(), "data")
    assert trouble == sidecar_health.Trouble("train-0", "shardcache-data", "OOMKilled", 4, "40Mi")
    new = sidecar_health.condition([trouble])
    assert (new.type, new.status, new.reason) == ("SidecarsHealthy", "False", "SidecarOOMKilled")
    for part in ("train-0", "shardcache-data", "OOMKilled", "40Mi", "limits.memory"):
        assert part in new.message


def test_a_crash_looping_sidecar_is_reported_with_its_last_reason() -> None:
    (trouble,) = sidecar_health.troubles(sidecar_pod(last_reason="Error"), "data")
    assert (trouble.reason, trouble.event_reason) == ("Error", "SidecarCrashLooping")
    assert sidecar_health.condition([trouble]).reason == "SidecarCrashLooping"


def test_healthy_sidecars_other_mounts_and_trainer_deaths_are_no_trouble() -> None:
    assert sidecar_health.troubles(sidecar_pod(last_reason=None, waiting=None), "data") == []
    assert sidecar_health.troubles(sidecar_pod(), "other") == []
    pod = sidecar_pod(last_reason=None, waiting=None)
    pod["status"]["containerStatuses"][0]["lastState"] = {"terminated": {"reason": "OOMKilled"}}
    assert sidecar_health.troubles(pod, "data") == []  # the trainer's own limit


def test_an_injected_trainer_that_dies_is_no_sidecar_trouble() -> None:
    """A pod as the injection builds it: its trainer carries $SHARDCACHE_MOUNT too, and
    its OOMKill was reported as the mount's sidecar (advice: raise the sidecar limit)."""
    mount = specs.load(
        {
            "apiVersion": specs.API_VERSION,
            "kind": specs.KIND,
            "metadata": {"name": "data", "namespace": "ml"},
            "spec": {"source": {"uri": "s3://bucket/data/"}},
            "status": {"phase": "Ready", "manifestDigest": "sha256:" + "0f" * 32},
        }
    )
    given = {
        "metadata": {
            "name": "train-0",
            "namespace": "ml",
            "labels": {"shardcache.io/mount": "data"},
        },
        "spec": {"containers": [{"name": "trainer", "image": "python:3.11"}]},
    }
    pod = injection.inject(
        given,
        [injection.Mount("data", mount.spec, mount.manifest_digest, "ml")],
        defaults=injection.SidecarDefaults(image="shardcache-sidecar:test"),
    )
    (sidecar,) = pod["spec"]["initContainers"]
    pod["status"] = {
        "phase": "Running",
        "initContainerStatuses": [
            {"name": sidecar["name"], "ready": True, "restartCount": 0, "state": {"running": {}}}
        ],
        "containerStatuses": [
            {
                "name": "trainer",
                "restartCount": 5,
                "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                "lastState": {"terminated": {"reason": "OOMKilled", "exitCode": 137}},
            }
        ],
    }
    assert sidecar_health.troubles(pod, "data") == []
    pod["status"]["initContainerStatuses"][0]["lastState"] = {
        "terminated": {"reason": "OOMKilled", "exitCode": 137}
    }
    assert [t.container for t in sidecar_health.troubles(pod, "data")] == [sidecar["name"]]


def test_the_condition_is_absent_until_a_sidecar_dies_and_clears_to_true() -> None:
    healthy = sidecar_health.condition([])
    assert sidecar_health.conditions_with([], healthy, now="t1") == []
    dead = sidecar_health.condition(sidecar_health.troubles(sidecar_pod(), "data"))
    conditions = sidecar_health.conditions_with([], dead, now="t1")
    assert [(c["type"], c["status"]) for c in conditions] == [("SidecarsHealthy", "False")]
    cleared = sidecar_health.conditions_with(conditions, healthy, now="t2")
    assert [(c["type"], c["status"], c["lastTransitionTime"]) for c in cleared] == [
        ("SidecarsHealthy", "True", "t2")
    ]


def test_a_reconcile_keeps_sidecars_healthy() -> None:
    previous = {
        "conditions": [{"type": "SidecarsHealthy", "status": "False", "reason": "SidecarOOMKilled"}]
    }
    resolved = status.Resolved(digest="sha256:x", format="parquet", shards=1, rows=1, bytes=1)
    built = status.build_status(
        resolved, previous=previous, generation=1, now="t", resolved_source=None
    )
    assert {"type": "SidecarsHealthy", "status": "False", "reason": "SidecarOOMKilled"} in built[
        "conditions"
    ]


class PodsApi:
    def __init__(self, pods: list[dict[str, Any]]) -> None:
        self.pods = pods

    async def list_unfinished_pods(self, namespace: str, label_selector: str) -> list[Any]:
        return self.pods


def capture_events() -> asyncio.Queue[posting.K8sEvent]:
    queue: asyncio.Queue[posting.K8sEvent] = asyncio.Queue()
    posting.settings_var.set(kopf.OperatorSettings())
    posting.event_queue_var.set(queue)
    posting.event_queue_loop_var.set(asyncio.get_running_loop())
    return queue


def mount_body(conditions: list[Mapping[str, Any]] | None = None) -> kopf.Body:
    return kopf.Body(
        {
            "apiVersion": "shardcache.io/v1alpha1",
            "kind": "DatasetMount",
            "metadata": {"name": "data", "namespace": "ml", "uid": "u-1"},
            "spec": {"source": {"uri": "s3://bucket/data/"}},
            "status": {"phase": "Ready", "attachedPods": 1, "conditions": conditions or []},
        }
    )


async def test_the_timer_sets_the_condition_and_posts_one_warning_per_dead_sidecar() -> None:
    events = capture_events()
    ctx = context.Context(settings=configuration.Settings(), api=PodsApi([sidecar_pod()]))  # type: ignore[arg-type]
    ctx.pods.set("ml", "train-0", ("data",))
    patch = kopf.Patch()
    await sidecar_checks.check_sidecars(
        body=mount_body(), patch=patch, namespace="ml", name="data", memo=ctx
    )
    (condition,) = patch.status["conditions"]
    assert (condition["type"], condition["status"]) == ("SidecarsHealthy", "False")
    posted = []
    while not events.empty():
        posted.append(events.get_nowait())
    assert [(e.type, e.reason) for e in posted] == [("Warning", "SidecarOOMKilled")]
    assert "train-0" in posted[0].message and "40Mi" in posted[0].message
    # The next check of the same dead sidecar posts nothing new and writes nothing.
    again = kopf.Patch()
    await sidecar_checks.check_sidecars(
        body=mount_body([condition]), patch=again, namespace="ml", name="data", memo=ctx
    )
    assert events.empty()
    assert "conditions" not in again.status


def test_the_operator_registers_the_sidecar_check_for_mounts_with_pods() -> None:
    registry = kopf.OperatorRegistry()
    handlers.register(registry, configuration.Settings())
    assert "check-sidecars" in {h.id for h in registry._spawning.get_all_handlers()}
    assert sidecar_checks.watches_sidecars(body=mount_body())
    dead = [{"type": "SidecarsHealthy", "status": "False"}]
    idle = kopf.Body({"status": {"attachedPods": 0, "conditions": dead}})
    assert sidecar_checks.watches_sidecars(body=idle)
    assert not sidecar_checks.watches_sidecars(body=kopf.Body({"status": {"attachedPods": 0}}))
