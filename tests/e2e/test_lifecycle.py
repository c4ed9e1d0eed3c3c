"""Attached pods and deletion: the finalizer semantics of docs/operator.md.

A deleted DatasetMount stays (phase Terminating, one WaitingForPods Event) while
unfinished pods that use it exist; it goes once they are gone, or at once when
annotated shardcache.io/force-delete=true. On the local provider kwok's fake nodes run
the pods (kube-scheduler binds them, kwok reports them Running), so the counts are of
real pod objects moving through real phases.
"""

from __future__ import annotations

from typing import Any

import kubernetes.client
import pytest
from kubernetes.client.rest import ApiException
from shardcache_operator import handlers

from tests.e2e import harness, objects

pytestmark = pytest.mark.e2e

#: kube-scheduler binds a pod and kwok reports it Running within seconds.
RUNNING_TIMEOUT_S = 90.0
#: Pod counts refresh every operator.settings.podsIntervalSeconds (2 s in the e2e values).
COUNT_TIMEOUT_S = 60.0
# What kopf logs each time the finalizer is retried while pods still hold the mount.
FINALIZER_POLL = "Handler 'finalize' failed temporarily: waiting for"


def ready_mount(
    admin: kubernetes.client.ApiClient,
    operator: harness.Operator,
    namespace: str,
    store: harness.ObjectStore,
    prefix: str,
) -> str:
    name = objects.unique(prefix)
    uri = objects.write_shards(store, shard_rows=(10, 10))
    objects.create_datasetmount(admin, namespace, objects.datasetmount(name, uri))
    objects.wait_phase(admin, namespace, name, "Ready", operator)
    return name


def start_pods(
    admin: kubernetes.client.ApiClient, namespace: str, mount: str, count: int
) -> list[str]:
    core = kubernetes.client.CoreV1Api(admin)
    created = [
        core.create_namespaced_pod(namespace, objects.pod(None, mount)).metadata.name
        for _ in range(count)
    ]

    def running() -> bool:
        phases = [core.read_namespaced_pod(n, namespace).status.phase for n in created]
        return all(p == "Running" for p in phases)

    harness.wait_until(
        f"{count} pods of {mount} Running on the fake nodes",
        running,
        timeout=RUNNING_TIMEOUT_S,
        describe=lambda: str(
            [(n, core.read_namespaced_pod(n, namespace).status.phase) for n in created]
        ),
    )
    return created


def delete_pod(admin: kubernetes.client.ApiClient, namespace: str, name: str) -> None:
    core = kubernetes.client.CoreV1Api(admin)
    core.delete_namespaced_pod(
        name, namespace, body=kubernetes.client.V1DeleteOptions(grace_period_seconds=0)
    )

    def gone() -> bool:
        try:
            core.read_namespaced_pod(name, namespace)
        except ApiException as exc:
            return exc.status == 404
        return False

    harness.wait_until(f"pod {name} to be gone", gone, timeout=RUNNING_TIMEOUT_S)


def wait_attached(
    admin: kubernetes.client.ApiClient,
    operator: harness.Operator,
    namespace: str,
    name: str,
    count: int,
) -> dict[str, Any]:
    last: dict[str, Any] = {}

    def check() -> dict[str, Any] | None:
        last.clear()
        last.update(objects.get_datasetmount(admin, namespace, name).get("status") or {})
        return dict(last) if last.get("attachedPods") == count else None

    return harness.wait_until(
        f"status.attachedPods == {count} on {name}",
        check,
        timeout=COUNT_TIMEOUT_S,
        describe=lambda: f"last status: {last}\n{operator.logs()}",
    )


def wait_gone(
    admin: kubernetes.client.ApiClient, operator: harness.Operator, namespace: str, name: str
) -> None:
    def gone() -> bool:
        try:
            objects.get_datasetmount(admin, namespace, name)
        except ApiException as exc:
            return exc.status == 404
        return False

    harness.wait_until(
        f"DatasetMount {name} to be gone", gone, timeout=COUNT_TIMEOUT_S, describe=operator.logs
    )


def test_attached_pods_are_counted_and_deletion_waits_for_them(
    admin: kubernetes.client.ApiClient,
    operator: harness.Operator,
    workload_namespace: str,
    object_store: harness.ObjectStore,
    s3_secret: str,
) -> None:
    ns = workload_namespace
    name = ready_mount(admin, operator, ns, object_store, "held")
    pods = start_pods(admin, ns, name, 2)
    wait_attached(admin, operator, ns, name, 2)

    custom = kubernetes.client.CustomObjectsApi(admin)
    custom.delete_namespaced_custom_object(objects.GROUP, objects.VERSION, ns, objects.PLURAL, name)
    status = objects.wait_phase(admin, ns, name, "Terminating", operator)
    assert status["attachedPods"] == 2
    obj = objects.get_datasetmount(admin, ns, name)
    assert obj["metadata"]["deletionTimestamp"]
    assert obj["metadata"]["finalizers"] == [handlers.FINALIZER]
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

    delete_pod(admin, ns, pods[0])
    wait_attached(admin, operator, ns, name, 1)
    assert objects.get_datasetmount(admin, ns, name)["metadata"]["finalizers"] == [
        handlers.FINALIZER
    ]
    delete_pod(admin, ns, pods[1])
    wait_gone(admin, operator, ns, name)


def test_force_delete_annotation_releases_it_with_pods_attached(
    admin: kubernetes.client.ApiClient,
    operator: harness.Operator,
    workload_namespace: str,
    object_store: harness.ObjectStore,
    s3_secret: str,
) -> None:
    ns = workload_namespace
    name = ready_mount(admin, operator, ns, object_store, "forced")
    pods = start_pods(admin, ns, name, 1)
    wait_attached(admin, operator, ns, name, 1)
    custom = kubernetes.client.CustomObjectsApi(admin)
    custom.delete_namespaced_custom_object(objects.GROUP, objects.VERSION, ns, objects.PLURAL, name)
    objects.wait_phase(admin, ns, name, "Terminating", operator)
    patch = {"metadata": {"annotations": {handlers.ANNOTATION_FORCE_DELETE: "true"}}}
    custom.patch_namespaced_custom_object(
        objects.GROUP, objects.VERSION, ns, objects.PLURAL, name, patch
    )
    wait_gone(admin, operator, ns, name)
    # The pod is not touched: the operator never writes pods.
    core = kubernetes.client.CoreV1Api(admin)
    assert core.read_namespaced_pod(pods[0], ns).status.phase == "Running"
    delete_pod(admin, ns, pods[0])


def finish_pod(admin: kubernetes.client.ApiClient, namespace: str, name: str, phase: str) -> None:
    """The pod's containers exited: its phase as the kubelet reports it (a status patch
    where the fake nodes run no containers)."""
    core = kubernetes.client.CoreV1Api(admin)
    core.patch_namespaced_pod_status(name, namespace, {"status": {"phase": phase}})
    harness.wait_until(
        f"pod {name} to be {phase}",
        lambda: core.read_namespaced_pod(name, namespace).status.phase == phase,
        timeout=RUNNING_TIMEOUT_S,
    )


def test_pods_that_finish_stop_holding_the_deletion_and_it_completes(
    admin: kubernetes.client.ApiClient,
    operator: harness.Operator,
    workload_namespace: str,
    object_store: harness.ObjectStore,
    s3_secret: str,
) -> None:
    ns = workload_namespace
    name = ready_mount(admin, operator, ns, object_store, "finished")
    pods = start_pods(admin, ns, name, 2)
    wait_attached(admin, operator, ns, name, 2)

    finish_pod(admin, ns, pods[0], "Succeeded")
    wait_attached(admin, operator, ns, name, 1)
    custom = kubernetes.client.CustomObjectsApi(admin)
    custom.delete_namespaced_custom_object(objects.GROUP, objects.VERSION, ns, objects.PLURAL, name)
    status = objects.wait_phase(admin, ns, name, "Terminating", operator)
    assert status["attachedPods"] == 1  # the running pod still holds it

    finish_pod(admin, ns, pods[1], "Failed")
    wait_gone(admin, operator, ns, name)
    # Released because the pods finished, not because they went: both are still there.
    core = kubernetes.client.CoreV1Api(admin)
    assert [core.read_namespaced_pod(p, ns).status.phase for p in pods] == ["Succeeded", "Failed"]
    for pod in pods:
        delete_pod(admin, ns, pod)
