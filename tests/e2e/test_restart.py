"""Restarting the operator causes no duplicate side effects.

After a restart kopf resumes every DatasetMount (the resume handler runs again). For a
Ready mount whose source is unchanged that must leave no trace: the pinned digest and
the whole status stay as they were (no re-listing of the bucket, resolvedAt and the
conditions' lastTransitionTime unchanged), no new Event is posted, the finalizer is not
added twice, and the pod count is unchanged.
"""

from __future__ import annotations

import kubernetes.client
import pytest
from kubernetes.client.exceptions import ApiException
from shardcache_operator import manifest_backfill, manifest_handoff, specs

from tests.e2e import harness, objects
from tests.e2e.conftest import ReadyMount

pytestmark = pytest.mark.e2e

RESUME_TIMEOUT_S = 90.0
SETTLE_TIMEOUT_S = 90.0


def attached(admin: kubernetes.client.ApiClient, mount: ReadyMount) -> object:
    obj = objects.get_datasetmount(admin, mount.namespace, mount.name)
    return (obj.get("status") or {}).get("attachedPods")


def unfinished_pods(admin: kubernetes.client.ApiClient, mount: ReadyMount) -> int:
    """Pods labelled for `mount` that have not finished: what attachedPods must say. The
    mount is shared with other tests of the session (test_injection creates pods on
    it), so the count is read from the cluster, not assumed to be this test's one pod."""
    pods = kubernetes.client.CoreV1Api(admin).list_namespaced_pod(
        mount.namespace, label_selector=f"shardcache.io/mount={mount.name}"
    )
    return sum(1 for p in pods.items if (p.status.phase or "") not in ("Succeeded", "Failed"))


def snapshot(admin: kubernetes.client.ApiClient, mount: ReadyMount) -> dict[str, object]:
    obj = objects.get_datasetmount(admin, mount.namespace, mount.name)
    digest = obj["status"]["manifestDigest"]
    for cond in obj["status"]["conditions"]:
        # The one documented difference: after a restart the ManifestResolved message
        # says the pin was kept ("kept the pinned manifest <digest>") rather than
        # resolved; same digest, same reason, same lastTransitionTime.
        if cond["type"] == "ManifestResolved":
            cond["message"] = cond["message"].replace(
                f"kept the pinned manifest {digest}", f"resolved manifest {digest}"
            )
    events = objects.events_of(admin, mount.namespace, obj["metadata"]["uid"])
    return {
        "status": obj.get("status"),
        "finalizers": obj["metadata"].get("finalizers"),
        "generation": obj["metadata"]["generation"],
        "events": [(e.metadata.name, e.reason, e.count or 1, e.message) for e in events],
    }


def test_restarting_the_operator_causes_no_duplicate_side_effects(
    admin: kubernetes.client.ApiClient, operator: harness.Operator, ready_mount: ReadyMount
) -> None:
    core = kubernetes.client.CoreV1Api(admin)
    core.create_namespaced_pod(ready_mount.namespace, objects.pod(None, ready_mount.name))
    # The pod counted first, so the comparison is about the restart alone.
    harness.wait_until(
        "status.attachedPods to count the new pod with the mount's other pods",
        lambda: attached(admin, ready_mount) == unfinished_pods(admin, ready_mount),
        timeout=SETTLE_TIMEOUT_S,
        describe=operator.logs,
    )
    before = snapshot(admin, ready_mount)
    assert [e[1] for e in before["events"]] == ["ManifestPinned"]

    operator.restart()
    ready_phase = {"phase": "Ready"}

    def resumed() -> bool:
        # The new process reconciled (resumed) every Ready mount it found.
        text = operator.metrics()
        return harness.metric_value(text, "shardcache_operator_reconcile_total", ready_phase) >= 1

    harness.wait_until(
        "the restarted operator to resume the DatasetMounts",
        resumed,
        timeout=RESUME_TIMEOUT_S,
        describe=operator.logs,
    )
    # The restarted operator has counted the pod from its own pod watch: its gauge is
    # set at each flush of the count writer, from what the watch listed, so a repeated
    # side effect (a second count, a status write) would have happened by then.
    mount_labels = {"namespace": ready_mount.namespace, "datasetmount": ready_mount.name}
    harness.wait_until(
        "the restarted operator to count the mount's pods from its own pod watch",
        lambda: (
            harness.metric_value(
                operator.metrics(), "shardcache_operator_attached_pods", mount_labels
            )
            == unfinished_pods(admin, ready_mount)
        ),
        timeout=SETTLE_TIMEOUT_S,
        describe=operator.logs,
    )
    after = snapshot(admin, ready_mount)
    changed = {key: (before[key], after[key]) for key in before if before[key] != after[key]}
    if "status" in changed:
        old_status, new_status = changed.pop("status")
        assert isinstance(old_status, dict) and isinstance(new_status, dict)
        changed.update(
            {
                f"status.{key}": (old_status.get(key), new_status.get(key))
                for key in {*old_status, *new_status}
                if old_status.get(key) != new_status.get(key)
            }
        )
    assert not changed, f"changed by the restart: {changed}"


def test_a_pin_kept_across_a_restart_without_its_configmaps_is_handed_again(
    admin: kubernetes.client.ApiClient,
    operator: harness.Operator,
    object_store: harness.ObjectStore,
    workload_namespace: str,
    s3_secret: str,
) -> None:
    """A pin the reconcile keeps is not resolved again, so not handed again; the
    restarted operator looks at its ConfigMaps (`manifest_backfill`), finds part 0
    deleted by hand, reads the source again and writes the same bytes back."""
    core = kubernetes.client.CoreV1Api(admin)
    uri = objects.write_shards(object_store, shard_rows=(12, 7))
    name = objects.unique("handed-again")
    objects.create_datasetmount(admin, workload_namespace, objects.datasetmount(name, uri))
    status = objects.wait_phase(admin, workload_namespace, name, "Ready", operator)
    part = manifest_handoff.config_map_name(name, manifest_handoff.PRIMARY, 0)
    try:
        first = core.read_namespaced_config_map(part, workload_namespace)
        core.delete_namespaced_config_map(part, workload_namespace)
        operator.restart()

        def handed() -> kubernetes.client.V1ConfigMap | None:
            try:
                return core.read_namespaced_config_map(part, workload_namespace)
            except ApiException as exc:
                assert exc.status == 404
                return None

        again = harness.wait_until(
            "the restarted operator to hand the kept pin's manifest again",
            handed,
            timeout=RESUME_TIMEOUT_S,
            describe=operator.logs,
        )
        assert again.binary_data == first.binary_data
        annotations = again.metadata.annotations
        assert annotations[manifest_handoff.ANNOTATION_DIGEST] == status["manifestDigest"]
        assert annotations[manifest_handoff.ANNOTATION_PARTS] == "1"
        uid = objects.get_datasetmount(admin, workload_namespace, name)["metadata"]["uid"]
        looks = harness.metric_value(
            operator.metrics(), "shardcache_operator_manifest_looks_total", {"result": "handed"}
        )
        assert looks >= 1
        harness.wait_until(
            "the ManifestHanded Event",
            lambda: objects.events_with(admin, workload_namespace, uid, manifest_backfill.HANDED),
            timeout=SETTLE_TIMEOUT_S,
            describe=operator.logs,
        )
    finally:
        kubernetes.client.CustomObjectsApi(admin).delete_namespaced_custom_object(
            specs.GROUP, specs.VERSION, workload_namespace, specs.PLURAL, name
        )
