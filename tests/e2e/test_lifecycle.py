"""Attached pods and deletion: the finalizer semantics of docs/operator.md.

A deleted DatasetMount stays (phase Terminating, one WaitingForPods Event) while
unfinished pods that use it exist; it goes once they are gone, or at once when
annotated shardcache.io/force-delete=true. The pods run on kwok's fake nodes
(`tests.e2e.workloads`).
"""

from __future__ import annotations

import kubernetes.client
import pytest
from kubernetes.client.rest import ApiException
from shardcache_operator import specs

from tests.e2e import harness, objects, workloads

pytestmark = pytest.mark.e2e

# What kopf logs each time the finalizer is retried while pods still hold the mount.
FINALIZER_POLL = "Handler 'finalize' failed temporarily: waiting for"


def test_attached_pods_are_counted_and_deletion_waits_for_them(
    workload: workloads.Workload,
) -> None:
    admin, operator, ns = workload.admin, workload.operator, workload.namespace
    name, pods = workload.attached("held", pods=2)

    workload.delete_mount(name)
    status = objects.wait_phase(admin, ns, name, "Terminating", operator)
    assert status["attachedPods"] == 2
    obj = objects.get_datasetmount(admin, ns, name)
    assert obj["metadata"]["deletionTimestamp"]
    assert obj["metadata"]["finalizers"] == [specs.FINALIZER]
    # Three more deletion polls later there is still exactly one Event about it; each
    # poll is kopf retrying the finalizer, which it logs.
    polls = harness.log_mentions(operator, FINALIZER_POLL)
    harness.wait_until(
        "three more deletion polls of the finalizer",
        lambda: harness.log_mentions(operator, FINALIZER_POLL) >= polls + 3,
        timeout=90,
        describe=operator.logs,
    )
    waiting = [
        e
        for e in objects.events_of(admin, ns, obj["metadata"]["uid"])
        if e.reason == "WaitingForPods"
    ]
    assert len(waiting) == 1 and (waiting[0].count or 1) == 1, waiting
    assert "waiting for 2 pod(s)" in waiting[0].message

    # A new pod cannot join a mount that is being deleted.
    core = kubernetes.client.CoreV1Api(admin)
    with pytest.raises(ApiException) as refused:
        core.create_namespaced_pod(ns, objects.pod(None, name))
    assert "is being deleted" in refused.value.body

    workload.delete_pod(pods[0])
    workload.wait_attached(name, 1)
    assert objects.get_datasetmount(admin, ns, name)["metadata"]["finalizers"] == [specs.FINALIZER]
    workload.delete_pod(pods[1])
    workload.wait_gone(name)


def test_force_delete_annotation_releases_it_with_pods_attached(
    workload: workloads.Workload,
) -> None:
    admin, ns = workload.admin, workload.namespace
    name, pods = workload.attached("forced", pods=1)
    workload.delete_mount(name)
    objects.wait_phase(admin, ns, name, "Terminating", workload.operator)
    patch = {"metadata": {"annotations": {specs.ANNOTATION_FORCE_DELETE: "true"}}}
    kubernetes.client.CustomObjectsApi(admin).patch_namespaced_custom_object(
        objects.GROUP, objects.VERSION, ns, objects.PLURAL, name, patch
    )
    workload.wait_gone(name)
    # The pod is not touched: the operator never writes pods.
    core = kubernetes.client.CoreV1Api(admin)
    assert core.read_namespaced_pod(pods[0], ns).status.phase == "Running"
    workload.delete_pod(pods[0])


def test_pods_that_finish_stop_holding_the_deletion_and_it_completes(
    workload: workloads.Workload,
) -> None:
    admin, ns = workload.admin, workload.namespace
    name, pods = workload.attached("finished", pods=2)

    workload.finish_pod(pods[0], "Succeeded")
    workload.wait_attached(name, 1)
    workload.delete_mount(name)
    status = objects.wait_phase(admin, ns, name, "Terminating", workload.operator)
    assert status["attachedPods"] == 1  # the running pod still holds it

    workload.finish_pod(pods[1], "Failed")
    workload.wait_gone(name)
    # Released because the pods finished, not because they went: both are still there.
    core = kubernetes.client.CoreV1Api(admin)
    assert [core.read_namespaced_pod(p, ns).status.phase for p in pods] == ["Succeeded", "Failed"]
    for pod in pods:
        workload.delete_pod(pod)
