"""Sample-mode windows against cache.memory through the real API server: the mount
says how many ranks' windows its memory tier holds in an Event, and a pod whose ranks
would not fit is admitted with a warning the API server hands its creator
(docs/reading-plan.md, "Said at admission, before the pod runs")."""

from __future__ import annotations

import kubernetes.client
import pytest

from tests.e2e import harness, objects
from tests.e2e.conftest import ReadyMount

pytestmark = pytest.mark.e2e

EVENT_TIMEOUT_S = 60


def test_a_sample_mount_too_small_for_its_ranks_windows_warns_on_itself_and_at_admission(
    admin: kubernetes.client.ApiClient,
    operator: harness.Operator,
    workload_namespace: str,
    ready_mount: ReadyMount,
) -> None:
    ns = workload_namespace
    name = objects.unique("sample-tight")
    # Three shards of 40, 25 and 31 rows; two windows of 10 rows touch at most 2 shards,
    # and a memory tier of 1 KiB holds not one of them.
    spec = {"sharding": {"granularity": "sample", "window": 10}, "cache": {"memory": "1Ki"}}
    objects.create_datasetmount(admin, ns, objects.datasetmount(name, ready_mount.uri, **spec))
    objects.wait_phase(admin, ns, name, "Ready", operator)
    uid = objects.get_datasetmount(admin, ns, name)["metadata"]["uid"]
    events = harness.wait_until(
        "a SampleWindowsDoNotFit Event",
        lambda: objects.events_with(admin, ns, uid, "SampleWindowsDoNotFit"),
        timeout=EVENT_TIMEOUT_S,
        describe=lambda: str([(e.reason, e.message) for e in objects.events_of(admin, ns, uid)]),
    )
    assert events[0].type == "Warning"
    assert "cannot hold one rank's sample-shuffle windows" in events[0].message

    pod = objects.pod(None, name)
    pod["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "8"}}
    core = kubernetes.client.CoreV1Api(admin)
    created, code, headers = core.create_namespaced_pod_with_http_info(
        ns, objects.body(pod), dry_run="All"
    )
    assert code == 201
    names = [c.name for c in created.spec.init_containers or []] + [
        c.name for c in created.spec.containers
    ]
    assert len(names) > 1, "the sidecar was not injected"
    warning = headers.get("Warning") or ""
    assert f"DatasetMount {ns}/{name} shuffles samples" in warning, headers
    assert "8 ranks, one per accelerator the pod asks for" in warning
