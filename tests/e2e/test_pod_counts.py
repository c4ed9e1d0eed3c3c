"""status.attachedPods follows pod events, and the pod watch sees only labelled pods.

Pods run on kwok's fake nodes; a pod "finishes" by a status write of its terminal phase
(no kubelet runs there to end it, and kwok leaves terminal pods alone).
"""

from __future__ import annotations

import kubernetes.client
import pytest

from tests.e2e import harness, objects
from tests.e2e.test_lifecycle import delete_pod, ready_mount, start_pods, wait_attached

pytestmark = pytest.mark.e2e

EVENTS = "shardcache_operator_pod_events_total"


def finish(admin: kubernetes.client.ApiClient, namespace: str, name: str, phase: str) -> None:
    kubernetes.client.CoreV1Api(admin).patch_namespaced_pod_status(
        name, namespace, {"status": {"phase": phase}}
    )


def test_counts_follow_pods_created_finished_deleted_and_an_operator_restart(
    admin: kubernetes.client.ApiClient,
    operator: harness.Operator,
    workload_namespace: str,
    object_store: harness.ObjectStore,
    s3_secret: str,
) -> None:
    ns = workload_namespace
    name = ready_mount(admin, operator, ns, object_store, "counted")
    pods = start_pods(admin, ns, name, 5)
    wait_attached(admin, operator, ns, name, 5)
    finish(admin, ns, pods[0], "Succeeded")
    wait_attached(admin, operator, ns, name, 4)
    finish(admin, ns, pods[1], "Failed")
    wait_attached(admin, operator, ns, name, 3)
    delete_pod(admin, ns, pods[2])
    wait_attached(admin, operator, ns, name, 2)
    # Changes while the operator is down are counted by the next one from its index.
    operator.stop()
    try:
        delete_pod(admin, ns, pods[3])
        finish(admin, ns, pods[4], "Failed")
    finally:
        operator.start()
    wait_attached(admin, operator, ns, name, 0)
    for pod in pods:
        if pod != pods[2] and pod != pods[3]:
            delete_pod(admin, ns, pod)


def test_unlabelled_pods_never_reach_a_handler(
    admin: kubernetes.client.ApiClient,
    operator: harness.Operator,
    workload_namespace: str,
    object_store: harness.ObjectStore,
    s3_secret: str,
) -> None:
    ns = workload_namespace
    name = ready_mount(admin, operator, ns, object_store, "filtered")
    start = operator.metrics()
    opted_in_before = harness.metric_value(start, EVENTS, {"opted_in": "true"})
    core = kubernetes.client.CoreV1Api(admin)
    unlabelled = [
        core.create_namespaced_pod(ns, objects.pod(None, None)).metadata.name for _ in range(10)
    ]
    # Created after the unlabelled ones: once its events arrived, theirs would have too
    # (one watch stream, in resourceVersion order), had the watch let them through.
    (labelled,) = start_pods(admin, ns, name, 1)
    wait_attached(admin, operator, ns, name, 1)
    delete_pod(admin, ns, labelled)
    wait_attached(admin, operator, ns, name, 0)
    text = operator.metrics()
    assert harness.metric_value(text, EVENTS, {"opted_in": "true"}) > opted_in_before
    assert harness.metric_value(text, EVENTS, {"opted_in": "false"}) == 0
    for pod in unlabelled:
        delete_pod(admin, ns, pod)
