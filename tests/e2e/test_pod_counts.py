"""status.attachedPods follows pod events, and the pod watch sees only labelled pods.

Pods run on kwok's fake nodes and finish by a status write of their terminal phase
(`tests.e2e.workloads`).
"""

from __future__ import annotations

import kubernetes.client
import pytest

from tests.e2e import harness, objects, workloads

pytestmark = pytest.mark.e2e

EVENTS = "shardcache_operator_pod_events_total"


def test_counts_follow_pods_created_finished_deleted_and_an_operator_restart(
    workload: workloads.Workload,
) -> None:
    operator = workload.operator
    name, pods = workload.attached("counted", pods=5)
    workload.finish_pod(pods[0], "Succeeded")
    workload.wait_attached(name, 4)
    workload.finish_pod(pods[1], "Failed")
    workload.wait_attached(name, 3)
    workload.delete_pod(pods[2])
    workload.wait_attached(name, 2)
    # Changes while the operator is down are counted by the next one from its index.
    operator.stop()
    try:
        workload.delete_pod(pods[3])
        workload.finish_pod(pods[4], "Failed")
    finally:
        operator.start()
    workload.wait_attached(name, 0)
    for pod in pods:
        if pod != pods[2] and pod != pods[3]:
            workload.delete_pod(pod)


def test_unlabelled_pods_never_reach_a_handler(workload: workloads.Workload) -> None:
    operator, ns = workload.operator, workload.namespace
    name = workload.ready_mount("filtered")
    start = operator.metrics()
    opted_in_before = harness.metric_value(start, EVENTS, {"opted_in": "true"})
    core = kubernetes.client.CoreV1Api(workload.admin)
    unlabelled = [
        core.create_namespaced_pod(ns, objects.pod(None, None)).metadata.name for _ in range(10)
    ]
    # Created after the unlabelled ones: once its events arrived, theirs would have too
    # (one watch stream, in resourceVersion order), had the watch let them through.
    (labelled,) = workload.start_pods(name, 1)
    workload.wait_attached(name, 1)
    workload.delete_pod(labelled)
    workload.wait_attached(name, 0)
    text = operator.metrics()
    assert harness.metric_value(text, EVENTS, {"opted_in": "true"}) > opted_in_before
    assert harness.metric_value(text, EVENTS, {"opted_in": "false"}) == 0
    for pod in unlabelled:
        workload.delete_pod(pod)
