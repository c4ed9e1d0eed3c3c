"""The webhook through the real API server: pods are stored as the webhook made them."""

from __future__ import annotations

import json
from typing import Any

import kubernetes.client
import pytest
from kubernetes.client.rest import ApiException
from shardcache_operator import injection, pod_volumes

from shardcache import contract
from tests.e2e import harness, objects, workloads
from tests.e2e.conftest import ReadyMount, Release

pytestmark = pytest.mark.e2e

#: The Job controller creates pods within a second or two of the Job.
JOB_PODS_TIMEOUT_S = 90.0


def create_pod(admin: kubernetes.client.ApiClient, namespace: str, body: dict[str, Any]) -> Any:
    core = kubernetes.client.CoreV1Api(admin)
    created = core.create_namespaced_pod(namespace, body)
    # Read it back: what the API server stored, not what the create call echoed.
    return admin.sanitize_for_serialization(
        core.read_namespaced_pod(created.metadata.name, namespace)
    )


def assert_injected(stored: dict[str, Any], mount: ReadyMount, *, trainers: list[str]) -> None:
    spec = stored["spec"]
    sidecars = [
        c for c in spec.get("initContainers", []) if c["name"] == f"shardcache-{mount.name}"
    ]
    assert len(sidecars) == 1, spec.get("initContainers")
    sidecar = sidecars[0]
    # A native sidecar, gated by a startup probe on the sidecar's /readyz.
    assert sidecar["restartPolicy"] == "Always"
    assert sidecar["image"] == ":".join(harness.SIDECAR_IMAGE)
    assert sidecar["startupProbe"]["httpGet"]["path"] == "/readyz"
    security = sidecar["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert sidecar["resources"]["requests"] and sidecar["resources"]["limits"]
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert env[contract.ENV_MANIFEST_DIGEST] == mount.status["manifestDigest"]
    assert env[contract.ENV_SOURCE_URI] == mount.uri
    assert sidecar["envFrom"] == [{"secretRef": {"name": objects.SECRET_NAME}}]
    volumes = {v["name"]: v for v in spec["volumes"]}
    run = volumes[f"shardcache-{mount.name}-run"]["emptyDir"]
    assert run["medium"] == "Memory" and run["sizeLimit"]
    assert volumes[f"shardcache-{mount.name}-disk"]["hostPath"]["type"] == "DirectoryOrCreate"
    # The Secret as files too, so a rotated key reaches the running sidecar: every key,
    # at the API's default mode (0644, which the non-root sidecar reads), mounted whole
    # (the kubelet does not update a subPath mount) and read-only, where its env says.
    credentials = f"shardcache-{mount.name}-cred"
    secret = volumes[credentials]["secret"]
    assert secret["secretName"] == objects.SECRET_NAME
    assert secret["defaultMode"] == 0o644 and "items" not in secret
    (files,) = [m for m in sidecar["volumeMounts"] if m["name"] == credentials]
    assert files["mountPath"] == pod_volumes.CREDENTIALS_PATH
    assert files["readOnly"] is True and "subPath" not in files
    assert env[contract.ENV_CREDENTIALS_DIR] == pod_volumes.CREDENTIALS_PATH
    for container in spec["containers"]:
        trainer_env = {e["name"]: e.get("value") for e in container.get("env", [])}
        if container["name"] not in trainers:
            assert contract.ENV_MOUNT not in trainer_env
            continue
        assert trainer_env[contract.ENV_MOUNT] == mount.name
        assert trainer_env[contract.ENV_RUN_DIR] == contract.DEFAULT_RUN_DIR
        mounted = {m["name"] for m in container["volumeMounts"]}
        assert f"shardcache-{mount.name}-run" in mounted
        # Credentials go to the sidecar only.
        assert "envFrom" not in container
        assert f"shardcache-{mount.name}-cred" not in mounted
        assert not any(
            "valueFrom" in e and "secretKeyRef" in e["valueFrom"] for e in container.get("env", [])
        )
    assert stored["metadata"]["annotations"][injection.ANNOTATION_INJECTED] == mount.name


def test_opted_in_pod_is_stored_with_the_sidecar_injected(
    admin: kubernetes.client.ApiClient, ready_mount: ReadyMount
) -> None:
    body = objects.pod(objects.unique("opted-in"), ready_mount.name, containers=2)
    body["spec"]["initContainers"] = [
        {"name": "setup", "image": objects.TRAINER_IMAGE, "command": ["true"]}
    ]
    stored = create_pod(admin, ready_mount.namespace, body)
    assert_injected(stored, ready_mount, trainers=["trainer", "trainer-1"])
    # The user's init container still runs first.
    assert [c["name"] for c in stored["spec"]["initContainers"]] == [
        "setup",
        f"shardcache-{ready_mount.name}",
    ]


def test_trainers_are_stored_with_their_mounts_reading_plan_as_the_sidecar_has_it(
    workload: workloads.Workload,
) -> None:
    """Issue 19: `shardcache.open()` in the trainer takes seed, shuffle, granularity,
    block size and window from these variables, so it reads the plan the sidecar warms
    up with."""
    sharding = {"seed": 5, "shuffle": True, "blockSize": 16, "granularity": "sample", "window": 512}
    name = workload.ready_mount("planned", sharding=sharding)
    body = objects.pod(objects.unique("planned"), name, containers=2)
    stored = create_pod(workload.admin, workload.namespace, body)
    (sidecar,) = [c for c in stored["spec"]["initContainers"] if c["name"] == f"shardcache-{name}"]
    plan = (
        contract.ENV_SEED,
        contract.ENV_SHUFFLE,
        contract.ENV_BLOCK_SIZE,
        contract.ENV_SHUFFLE_GRANULARITY,
        contract.ENV_SHUFFLE_WINDOW,
    )
    expected = {
        contract.ENV_SEED: "5",
        contract.ENV_SHUFFLE: "true",
        contract.ENV_BLOCK_SIZE: "16",
        contract.ENV_SHUFFLE_GRANULARITY: "sample",
        contract.ENV_SHUFFLE_WINDOW: "512",
    }
    sidecar_env = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert {n: sidecar_env[n] for n in plan} == expected
    for container in stored["spec"]["containers"]:
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        assert {n: env.get(n) for n in plan} == expected, container["name"]
    kubernetes.client.CoreV1Api(workload.admin).delete_namespaced_pod(
        stored["metadata"]["name"],
        workload.namespace,
        body=kubernetes.client.V1DeleteOptions(grace_period_seconds=0),
    )


def test_pod_without_the_label_is_stored_untouched(
    admin: kubernetes.client.ApiClient, ready_mount: ReadyMount
) -> None:
    body = objects.pod(objects.unique("plain"), None)
    stored = create_pod(admin, ready_mount.namespace, body)
    spec = stored["spec"]
    assert "initContainers" not in spec
    # Only what the API server itself adds (the ServiceAccount token volume).
    assert all(v["name"].startswith("kube-api-access-") for v in spec["volumes"]), spec["volumes"]
    assert "env" not in spec["containers"][0]
    assert injection.ANNOTATION_INJECTED not in (stored["metadata"].get("annotations") or {})


def test_pod_asking_for_a_missing_mount_is_refused_naming_it(
    admin: kubernetes.client.ApiClient, ready_mount: ReadyMount
) -> None:
    core = kubernetes.client.CoreV1Api(admin)
    with pytest.raises(ApiException) as refused:
        core.create_namespaced_pod(ready_mount.namespace, objects.pod(None, "no-such-mount"))
    message = json.loads(refused.value.body)["message"]
    assert "inject.shardcache.io" in message, message
    assert f"DatasetMount {ready_mount.namespace}/no-such-mount does not exist" in message


def test_pods_of_a_job_are_injected(
    admin: kubernetes.client.ApiClient, ready_mount: ReadyMount
) -> None:
    """kube-controller-manager's Job controller creates the pods; the webhook injects them."""
    name = objects.unique("job")
    template = objects.pod(None, ready_mount.name)
    template["spec"]["restartPolicy"] = "Never"
    del template["metadata"]["generateName"], template["apiVersion"], template["kind"]
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "completionMode": "Indexed",
            "completions": 2,
            "parallelism": 2,
            "backoffLimit": 0,
            "template": template,
        },
    }
    kubernetes.client.BatchV1Api(admin).create_namespaced_job(ready_mount.namespace, job)
    core = kubernetes.client.CoreV1Api(admin)

    def job_pods() -> list[Any] | None:
        listing = core.list_namespaced_pod(ready_mount.namespace, label_selector=f"job-name={name}")
        return listing.items if len(listing.items) >= 2 else None

    pods = harness.wait_until(f"2 pods of Job {name}", job_pods, timeout=JOB_PODS_TIMEOUT_S)
    for pod in pods:
        stored = admin.sanitize_for_serialization(pod)
        # Indexed Job pods are named <job>-<index>-<random>.
        assert stored["metadata"]["generateName"].startswith(f"{name}-")
        assert_injected(stored, ready_mount, trainers=["trainer"])
        sidecar = next(
            c for c in stored["spec"]["initContainers"] if c["name"].startswith("shardcache-")
        )
        # Indexed Job: the sidecar's rank comes from the completion index annotation.
        rank = next(e for e in sidecar["env"] if e["name"] == contract.ENV_RANK)
        assert injection.ANNOTATION_JOB_INDEX in rank["valueFrom"]["fieldRef"]["fieldPath"]


def test_pods_in_the_release_namespace_never_reach_the_webhook(
    admin: kubernetes.client.ApiClient, release: Release, ready_mount: ReadyMount
) -> None:
    """The default namespaceSelector leaves out the operator's own namespace, so even a
    labelled pod naming a missing mount is admitted there, as it was sent."""
    core = kubernetes.client.CoreV1Api(admin)
    name = objects.unique("exempt")
    core.create_namespaced_pod(release.namespace, objects.pod(name, "no-such-mount"))
    try:
        stored = admin.sanitize_for_serialization(core.read_namespaced_pod(name, release.namespace))
        assert "initContainers" not in stored["spec"]
        assert injection.ANNOTATION_INJECTED not in (stored["metadata"].get("annotations") or {})
    finally:
        core.delete_namespaced_pod(
            name, release.namespace, body=kubernetes.client.V1DeleteOptions(grace_period_seconds=0)
        )


def refusal(call: Any) -> str:
    """The message of the API server's refusal of `call()`, which must be refused."""
    with pytest.raises(ApiException) as refused:
        call()
    message: str = json.loads(refused.value.body)["message"]
    return message


def test_a_trainer_mounting_the_injected_disk_volume_by_name_is_refused(
    admin: kubernetes.client.ApiClient, ready_mount: ReadyMount
) -> None:
    """The API server checks volume names after the webhooks: without the webhook's own
    check this trainer was stored with the node disk tier, another namespace's part of
    it through the subPath."""
    body = objects.pod(objects.unique("intruder"), ready_mount.name)
    body["spec"]["containers"][0]["volumeMounts"] = [
        {"name": f"shardcache-{ready_mount.name}-disk", "mountPath": "/loot", "subPath": "ns-x"}
    ]
    core = kubernetes.client.CoreV1Api(admin)
    message = refusal(lambda: core.create_namespaced_pod(ready_mount.namespace, body))
    assert 'admission webhook "inject.shardcache.io" denied the request' in message, message
    assert f"names volume 'shardcache-{ready_mount.name}-disk', which the pod does not" in message


def test_the_injected_sidecar_cannot_be_changed_nor_debugged_after_admission(
    admin: kubernetes.client.ApiClient, ready_mount: ReadyMount
) -> None:
    """Through the real API server: a pod's init container images are mutable and
    `kubectl debug` adds ephemeral containers (pods/ephemeralcontainers, an UPDATE);
    neither may reach the sidecar, which holds the Secret and the node disk tier.
    What the trainer may do stays possible."""
    core = kubernetes.client.CoreV1Api(admin)
    stored = create_pod(admin, ready_mount.namespace, objects.pod(None, ready_mount.name))
    name, namespace = stored["metadata"]["name"], ready_mount.namespace
    sidecar = f"shardcache-{ready_mount.name}"
    index = [c["name"] for c in stored["spec"]["initContainers"]].index(sidecar)
    swap = [{"op": "replace", "path": f"/spec/initContainers/{index}/image", "value": "evil:1"}]
    message = refusal(lambda: core.patch_namespaced_pod(name, namespace, swap))
    assert 'admission webhook "inject.shardcache.io" denied the request' in message, message
    assert f"init container '{sidecar}' is the cache sidecar of DatasetMount" in message

    def debug(**container: Any) -> Any:
        body = {"name": objects.unique("debug"), "image": objects.TRAINER_IMAGE, **container}
        patch = {"spec": {"ephemeralContainers": [body]}}
        return core.patch_namespaced_pod_ephemeralcontainers(name, namespace, patch)

    message = refusal(lambda: debug(targetContainerName=sidecar))
    assert f"targets '{sidecar}', the cache sidecar" in message, message
    disk = {"name": f"{sidecar}-disk", "mountPath": "/loot"}
    message = refusal(lambda: debug(volumeMounts=[disk]))
    assert f"mounts '{sidecar}-disk', a volume only the cache sidecar mounts" in message

    # The trainer's own image, and a debug container beside the trainer with its volumes.
    trainer = [{"op": "replace", "path": "/spec/containers/0/image", "value": "trainer:2"}]
    core.patch_namespaced_pod(name, namespace, trainer)
    run = {"name": f"{sidecar}-run", "mountPath": "/cache"}
    debug(targetContainerName="trainer", volumeMounts=[run])
    after = admin.sanitize_for_serialization(core.read_namespaced_pod(name, namespace))
    assert after["spec"]["initContainers"][index] == stored["spec"]["initContainers"][index]
    assert after["spec"]["containers"][0]["image"] == "trainer:2"
    assert [c["targetContainerName"] for c in after["spec"]["ephemeralContainers"]] == ["trainer"]
    core.delete_namespaced_pod(
        name, namespace, body=kubernetes.client.V1DeleteOptions(grace_period_seconds=0)
    )


def test_opted_in_pod_is_refused_while_the_webhook_is_down(
    admin: kubernetes.client.ApiClient, operator: harness.Operator, ready_mount: ReadyMount
) -> None:
    """failurePolicy Fail (the chart's default): no trainer starts without its cache."""
    core = kubernetes.client.CoreV1Api(admin)
    injected = create_pod(admin, ready_mount.namespace, objects.pod(None, ready_mount.name))
    name = injected["metadata"]["name"]
    operator.stop()
    try:
        with pytest.raises(ApiException) as refused:
            core.create_namespaced_pod(ready_mount.namespace, objects.pod(None, ready_mount.name))
        message = json.loads(refused.value.body)["message"]
        assert 'failed calling webhook "inject.shardcache.io"' in message, message
        # Pods that did not opt in do not depend on the operator.
        core.create_namespaced_pod(ready_mount.namespace, objects.pod(None, None))
        # Nor does an update of an opted-in pod that leaves its spec alone (a label, a
        # finalizer the Job controller removes): the match condition spares the call.
        relabel = {"metadata": {"labels": {"phase": "down"}}}
        core.patch_namespaced_pod(name, ready_mount.namespace, relabel)
        # One that changes the spec waits for the webhook, as a creation does.
        image = [{"op": "replace", "path": "/spec/containers/0/image", "value": "trainer:2"}]
        message = refusal(lambda: core.patch_namespaced_pod(name, ready_mount.namespace, image))
        assert 'failed calling webhook "inject.shardcache.io"' in message, message
    finally:
        operator.start()
    stored = create_pod(admin, ready_mount.namespace, objects.pod(None, ready_mount.name))
    assert_injected(stored, ready_mount, trainers=["trainer"])
