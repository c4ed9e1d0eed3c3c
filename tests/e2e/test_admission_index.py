"""Admission from memory, through the real API server (issue 18).

The webhook answers from the operator's own DatasetMount watch; a mount the watch has
not delivered yet is read from the API once. What the watch says decides: a mount that
turned not-Ready, or was deleted, refuses the next pod. The operator's own counters
(`shardcache_operator_admission_lookups_total{source}`) say where each answer came from.
"""

from __future__ import annotations

from typing import Any

import kubernetes.client
import pytest
from kubernetes.client.rest import ApiException

from tests.e2e import harness, objects, workloads

pytestmark = pytest.mark.e2e

LOOKUPS = "shardcache_operator_admission_lookups_total"


def lookups(operator: harness.Operator) -> dict[str, float]:
    text = operator.metrics()
    return {
        source: harness.metric_value(text, LOOKUPS, {"source": source})
        for source in ("api", "memory")
    }


def refused(admin: kubernetes.client.ApiClient, namespace: str, mount: str) -> str:
    core = kubernetes.client.CoreV1Api(admin)
    with pytest.raises(ApiException) as raised:
        core.create_namespaced_pod(namespace, objects.pod(None, mount))
    assert raised.value.status == 403, raised.value.body
    return str(raised.value.body)


def test_a_mount_created_just_before_its_pods_is_read_at_most_once(
    workload: workloads.Workload,
) -> None:
    admin, operator, ns = workload.admin, workload.operator, workload.namespace
    name = objects.unique("fresh")
    uri = objects.write_shards(workload.store, shard_rows=(5,))
    before = lookups(operator)
    # Admit policy: the pods right behind the mount are admitted (without the cache)
    # while it is still Pending, so this measures the lookups, not the reconcile.
    body = objects.datasetmount(name, uri, admission={"policy": "Admit"})
    objects.create_datasetmount(admin, ns, body)
    core = kubernetes.client.CoreV1Api(admin)
    warned: list[Any] = []
    for _ in range(5):
        created = core.create_namespaced_pod(ns, objects.pod(None, name))
        warned.append(created.metadata.name)
    after = lookups(operator)
    # The first pod may beat the watch (a miss: one API read) or not (a hit); every
    # later one is served from memory, whichever way the race went.
    assert after["api"] - before["api"] <= 1, (before, after)
    assert after["memory"] - before["memory"] >= 4, (before, after)
    for pod in warned:
        core.delete_namespaced_pod(
            pod, ns, body=kubernetes.client.V1DeleteOptions(grace_period_seconds=0)
        )


def test_a_mount_that_turned_not_ready_refuses_the_next_pod(
    workload: workloads.Workload,
) -> None:
    admin, operator, ns = workload.admin, workload.operator, workload.namespace
    name = workload.ready_mount("turns")
    core = kubernetes.client.CoreV1Api(admin)
    first = core.create_namespaced_pod(ns, objects.pod(None, name))
    assert first.spec.init_containers, "the Ready mount was injected"
    # A new source the operator cannot resolve: the mount leaves Ready.
    bucket_uri = objects.get_datasetmount(admin, ns, name)["spec"]["source"]["uri"]
    custom = kubernetes.client.CustomObjectsApi(admin)
    custom.patch_namespaced_custom_object(
        objects.GROUP,
        objects.VERSION,
        ns,
        objects.PLURAL,
        name,
        {"spec": {"source": {"uri": bucket_uri + "nothing-here/"}}},
    )
    last: dict[str, Any] = {}

    def left_ready() -> bool:
        last.clear()
        last.update(objects.get_datasetmount(admin, ns, name).get("status") or {})
        return last.get("phase") not in (None, "Ready")

    harness.wait_until(
        f"{name} to leave Ready", left_ready, timeout=objects.PHASE_TIMEOUT_S, describe=str
    )
    before = lookups(operator)
    message = refused(admin, ns, name)
    assert f"DatasetMount {ns}/{name} is not Ready" in message, message
    after = lookups(operator)
    assert after["api"] == before["api"], "the refusal came from memory"
    core.delete_namespaced_pod(
        first.metadata.name, ns, body=kubernetes.client.V1DeleteOptions(grace_period_seconds=0)
    )


def test_a_deleted_mount_refuses_the_next_pod(workload: workloads.Workload) -> None:
    admin, ns = workload.admin, workload.namespace
    name = workload.ready_mount("goes")
    core = kubernetes.client.CoreV1Api(admin)
    pod = core.create_namespaced_pod(ns, objects.pod(None, name))
    workload.delete_pod(pod.metadata.name)
    workload.delete_mount(name)
    workload.wait_gone(name)
    message = refused(admin, ns, name)
    assert f"DatasetMount {ns}/{name} does not exist" in message, message
