"""A replica that led and was then outranked admits pods from the mounts as they are now.

kopf stops listing and watching while peering pauses a replica, so its DatasetMount index
stays as it was when the replica was outranked. The node tier (s18) saw such a replica
inject an edited mount's old digest and URI into every new pod, and admit pods of a
deleted mount. Here the `operator` fixture leads and sees the mount, then a second local
operator with a higher priority takes over, and the paused one's webhook is asked
directly (the API server's connection may go to either replica).
"""

from __future__ import annotations

import base64
import json
import pathlib
import ssl
import urllib.request
from typing import Any

import jsonpatch
import kubernetes.client
import pytest
from kubernetes.client.rest import ApiException
from shardcache_operator import specs, webhook
from shardcache_sidecar import listening

from tests.e2e import harness, objects

pytestmark = pytest.mark.e2e

TIMEOUT_S = 90.0
DIGEST_ENV = "SHARDCACHE_MANIFEST_DIGEST"


class Usurper(harness.LocalOperator):
    """A LocalOperator that outranks any other (random priorities stay below 2**30)."""

    def argv(self) -> list[str]:
        return [*super().argv(), f"--priority={2**31 - 1}"]


def admit(operator: harness.LocalOperator, namespace: str, mount: str) -> dict[str, Any]:
    """This replica's own answer to a pod of `mount`: its AdmissionReview response."""
    pod = objects.pod("probe", mount)
    pod["metadata"]["namespace"] = namespace
    review = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "probe",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": namespace,
            "operation": "CREATE",
            "userInfo": {"username": "e2e"},
            "object": pod,
        },
    }
    context = ssl.create_default_context(cafile=str(operator.tls_dir / "ca.crt"))
    request = urllib.request.Request(
        f"https://{harness.HOST}:{operator.webhook_port}/{webhook.HANDLER_ID}",
        data=json.dumps(review).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10, context=context) as reply:
        response: dict[str, Any] = json.loads(reply.read())["response"]
    if response.get("patch"):
        patched = jsonpatch.apply_patch(pod, json.loads(base64.b64decode(response["patch"])))
        response["digests"] = [
            env["value"]
            for container in patched["spec"].get("initContainers") or []
            for env in container.get("env") or []
            if env.get("name") == DIGEST_ENV
        ]
    return response


def pinned(admin: kubernetes.client.ApiClient, namespace: str, name: str, old: str) -> str | None:
    """The mount's new digest once its current generation is Ready on another than `old`."""
    try:
        obj = objects.get_datasetmount(admin, namespace, name)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    status = obj.get("status") or {}
    digest = status.get("manifestDigest")
    current = status.get("observedGeneration") == obj["metadata"].get("generation")
    if status.get("phase") == "Ready" and current and digest and digest != old:
        return str(digest)
    return None


def gone(admin: kubernetes.client.ApiClient, namespace: str, name: str) -> bool:
    try:
        objects.get_datasetmount(admin, namespace, name)
    except ApiException as exc:
        return exc.status == 404
    return False


def test_a_replica_outranked_after_leading_admits_from_the_current_mount(
    admin: kubernetes.client.ApiClient,
    operator: harness.Operator,
    workload_namespace: str,
    object_store: harness.ObjectStore,
    s3_secret: str,
    e2e_workdir: pathlib.Path,
) -> None:
    if not isinstance(operator, harness.LocalOperator):
        pytest.fail("this test runs two local operators; this provider runs none")
    ns, name = workload_namespace, objects.unique("flip")
    custom = kubernetes.client.CustomObjectsApi(admin)
    objects.create_datasetmount(
        admin, ns, objects.datasetmount(name, objects.write_shards(object_store, (10, 12)))
    )
    digest_a = objects.wait_phase(admin, ns, name, "Ready", operator)["manifestDigest"]
    assert admit(operator, ns, name)["digests"] == [digest_a]  # kopf's index has it now

    workdir = e2e_workdir / "usurper"
    workdir.mkdir(exist_ok=True)
    usurper = Usurper(
        workdir,
        operator.kubeconfig,
        operator.tls_dir,
        listening.free_port(),
        operator.sidecar_image,
        # The same platform policy: the object store is on loopback.
        source_endpoints=operator.source_endpoints,
    )
    usurper.start()
    try:
        harness.wait_until(
            "the first operator paused in favour of the usurper",
            lambda: harness.log_mentions(operator, "Pausing operations in favour of") > 0,
            timeout=TIMEOUT_S,
            describe=operator.logs,
        )
        # Edited: the usurper pins the new source; the paused replica injects it.
        custom.patch_namespaced_custom_object(
            objects.GROUP, objects.VERSION, ns, objects.PLURAL, name,
            {"spec": {"source": {"uri": objects.write_shards(object_store, (7,))}}},
        )  # fmt: skip
        digest_b = harness.wait_until(
            "the edit pinned by the usurper",
            lambda: pinned(admin, ns, name, digest_a),
            timeout=TIMEOUT_S,
            describe=usurper.logs,
        )
        harness.wait_until(
            "the paused replica injecting the edited mount",
            lambda: admit(operator, ns, name).get("digests") == [digest_b],
            timeout=5,
            describe=lambda: f"{admit(operator, ns, name)}\n{operator.logs()}",
        )
        # Deleted: refused.
        custom.patch_namespaced_custom_object(
            objects.GROUP, objects.VERSION, ns, objects.PLURAL, name,
            {"metadata": {"annotations": {specs.ANNOTATION_FORCE_DELETE: "true"}}},
        )  # fmt: skip
        custom.delete_namespaced_custom_object(
            objects.GROUP, objects.VERSION, ns, objects.PLURAL, name
        )
        harness.wait_until(
            "the mount gone", lambda: gone(admin, ns, name), timeout=TIMEOUT_S,
            describe=usurper.logs,
        )  # fmt: skip
        harness.wait_until(
            "the paused replica refusing pods of the deleted mount",
            lambda: admit(operator, ns, name)["allowed"] is False,
            timeout=5,
            describe=lambda: f"{admit(operator, ns, name)}\n{operator.logs()}",
        )
        # Created again on other data: its digest.
        objects.create_datasetmount(
            admin, ns, objects.datasetmount(name, objects.write_shards(object_store, (5, 6)))
        )
        digest_c = harness.wait_until(
            "the recreated mount pinned by the usurper",
            lambda: pinned(admin, ns, name, digest_b),
            timeout=TIMEOUT_S,
            describe=usurper.logs,
        )
        harness.wait_until(
            "the paused replica injecting the recreated mount",
            lambda: admit(operator, ns, name).get("digests") == [digest_c],
            timeout=5,
            describe=lambda: f"{admit(operator, ns, name)}\n{operator.logs()}",
        )
    finally:
        usurper.stop()  # the first operator resumes; its teardown releases the mounts
