"""Every pod of one Job reads the identical dataset, even after a source edit.

The Job controller (kube-controller-manager) creates an Indexed Job's pods; the mount's
`spec.source` is then edited and pinned anew; a rank's pod is deleted (as preemption or
node loss would) and the Job controller replaces it. The replacement must get the digest
and source its Job's other live pod was given, and an Event on the mount says so; a pod
of another Job gets the new dataset.
"""

from __future__ import annotations

from typing import Any

import kubernetes.client
import pytest
from kubernetes.client.rest import ApiException
from shardcache_operator import admission, injection

from shardcache import contract
from tests.e2e import harness, objects

pytestmark = pytest.mark.e2e

TIMEOUT_S = 90.0


def job(name: str, mount: str, pods: int) -> dict[str, Any]:
    template = objects.pod(None, mount)
    template["spec"]["restartPolicy"] = "Never"
    # Pending for good: kwok completes a Job's pods once they run, and a finished pod
    # holds no pin. A pending pod is as live as a running one.
    template["spec"]["nodeSelector"] = {"shardcache.io/e2e": "no-such-node"}
    del template["metadata"]["generateName"], template["apiVersion"], template["kind"]
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "completionMode": "Indexed",
            "completions": pods,
            "parallelism": pods,
            # A deleted pod counts as failed: the Job must replace it, not give up.
            "backoffLimit": 6,
            "template": template,
        },
    }


def sidecar_env(pod: Any) -> dict[str, str]:
    for container in pod.spec.init_containers or []:
        env = {e.name: e.value for e in container.env or []}
        if container.restart_policy == "Always" and contract.ENV_MOUNT in env:
            return env
    raise AssertionError(f"no cache sidecar in pod {pod.metadata.name}")


def live_pods(core: kubernetes.client.CoreV1Api, namespace: str, job_name: str) -> list[Any]:
    listing = core.list_namespaced_pod(namespace, label_selector=f"job-name={job_name}")
    return [p for p in listing.items if p.metadata.deletion_timestamp is None]


def by_index(pods: list[Any]) -> dict[str, Any]:
    return {p.metadata.annotations[injection.ANNOTATION_JOB_INDEX]: p for p in pods}


def repinned(admin: kubernetes.client.ApiClient, namespace: str, name: str, old: str) -> str | None:
    """The mount's new digest once its current generation is Ready on another than `old`."""
    obj = objects.get_datasetmount(admin, namespace, name)
    status = obj.get("status") or {}
    digest = status.get("manifestDigest")
    current = status.get("observedGeneration") == obj["metadata"].get("generation")
    if status.get("phase") == "Ready" and current and digest and digest != old:
        return str(digest)
    return None


def test_a_replaced_pod_of_a_job_gets_its_jobs_dataset_after_a_source_edit(
    admin: kubernetes.client.ApiClient,
    operator: harness.Operator,
    workload_namespace: str,
    object_store: harness.ObjectStore,
    s3_secret: str,
) -> None:
    ns, name = workload_namespace, objects.unique("jobpin")
    core = kubernetes.client.CoreV1Api(admin)
    batch = kubernetes.client.BatchV1Api(admin)
    custom = kubernetes.client.CustomObjectsApi(admin)
    uri_a = objects.write_shards(object_store, (10, 12))
    created = objects.create_datasetmount(admin, ns, objects.datasetmount(name, uri_a))
    digest_a = objects.wait_phase(admin, ns, name, "Ready", operator)["manifestDigest"]
    train, other = objects.unique("train"), objects.unique("other")
    try:
        batch.create_namespaced_job(ns, job(train, name, 2))

        def both() -> dict[str, Any] | None:
            found = by_index(live_pods(core, ns, train))
            return found if len(found) == 2 else None

        pods = harness.wait_until(f"2 pods of Job {train}", both, timeout=TIMEOUT_S)
        assert {sidecar_env(p)[contract.ENV_MANIFEST_DIGEST] for p in pods.values()} == {digest_a}

        uri_b = objects.write_shards(object_store, (7,))
        custom.patch_namespaced_custom_object(
            objects.GROUP, objects.VERSION, ns, objects.PLURAL, name,
            {"spec": {"source": {"uri": uri_b}}},
        )  # fmt: skip
        digest_b = harness.wait_until(
            "the edited source pinned",
            lambda: repinned(admin, ns, name, digest_a),
            timeout=TIMEOUT_S,
            describe=operator.logs,
        )

        # Rank 1's pod goes (preemption, node loss); the Job controller replaces it.
        gone = pods["1"].metadata.name
        core.delete_namespaced_pod(gone, ns, grace_period_seconds=0)

        def replacement() -> Any:
            now = by_index(live_pods(core, ns, train))
            new = now.get("1")
            return new if new is not None and new.metadata.name != gone else None

        def describe() -> str:
            events = core.list_namespaced_event(ns, field_selector=f"involvedObject.name={train}")
            pods_now = core.list_namespaced_pod(ns, label_selector=f"job-name={train}").items
            seen = [(p.metadata.name, p.metadata.deletion_timestamp) for p in pods_now]
            said = [f"{e.reason}: {e.message}" for e in events.items]
            return f"pods {seen}\nJob events {said}\n{operator.logs()}"

        new = harness.wait_until(
            f"rank 1 of Job {train} replaced", replacement, timeout=TIMEOUT_S, describe=describe
        )
        env = sidecar_env(new)
        assert env[contract.ENV_MANIFEST_DIGEST] == digest_a, "two datasets in one Job"
        assert env[contract.ENV_SOURCE_URI] == uri_a
        assert env == sidecar_env(pods["1"])  # every setting the first rank 1 was given

        uid = created["metadata"]["uid"]
        (event,) = harness.wait_until(
            "the mount's Event naming the Job's pin",
            lambda: objects.events_with(admin, ns, uid, admission.REASON_JOB_PIN) or None,
            timeout=TIMEOUT_S,
            describe=operator.logs,
        )
        assert event.type == "Normal"
        assert f"gets digest {digest_a}" in event.message
        assert f"now pins {digest_b}" in event.message
        assert f"Job {train}" in event.message

        # Another Job reads the mount as it is now.
        batch.create_namespaced_job(ns, job(other, name, 1))
        (fresh,) = harness.wait_until(
            f"the pod of Job {other}",
            lambda: live_pods(core, ns, other) or None,
            timeout=TIMEOUT_S,
        )
        assert sidecar_env(fresh)[contract.ENV_MANIFEST_DIGEST] == digest_b
        assert sidecar_env(fresh)[contract.ENV_SOURCE_URI] == uri_b
    finally:
        for job_name in (train, other):
            try:
                batch.delete_namespaced_job(job_name, ns, propagation_policy="Background")
            except ApiException as exc:
                if exc.status != 404:
                    raise
