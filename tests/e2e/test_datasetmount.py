"""DatasetMounts through the real API server: schema and CEL, reconcile against the real
S3-compatible server, Secrets under least privilege, attached pods, deletion."""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
from typing import Any

import kubernetes.client
import pytest
from kubernetes.client.rest import ApiException
from shardcache_operator import kube, manifest_handoff, specs

from shardcache import manifests
from shardcache.node import handed_manifests, pinned_manifests
from tests.e2e import harness, objects
from tests.e2e.conftest import ReadyMount

pytestmark = pytest.mark.e2e


def test_datasetmount_on_real_s3_reaches_ready_with_the_pinned_digest(
    admin: kubernetes.client.ApiClient,
    object_store: harness.ObjectStore,
    ready_mount: ReadyMount,
) -> None:
    expected = manifests.resolve(
        ready_mount.uri,
        format="parquet",
        storage_options=harness.store_env(object_store),
    )
    status = ready_mount.status
    assert status["manifestDigest"] == expected.digest
    assert (status["shards"], status["rows"]) == (3, 96)
    assert status["bytes"] == expected.total_bytes
    obj = objects.get_datasetmount(admin, ready_mount.namespace, ready_mount.name)
    assert status["observedGeneration"] == obj["metadata"]["generation"]
    for kind in ("SourceReachable", "ManifestResolved", "Ready"):
        cond = objects.condition(status, kind)
        assert cond["status"] == "True", (kind, cond)
        assert cond["reason"] and cond["message"], (kind, cond)
    assert obj["metadata"]["finalizers"] == [specs.FINALIZER]
    reasons = [
        e.reason for e in objects.events_of(admin, ready_mount.namespace, obj["metadata"]["uid"])
    ]
    assert reasons == ["ManifestPinned"]


def test_the_pinned_manifest_is_handed_in_a_configmap_the_mount_owns(
    admin: kubernetes.client.ApiClient,
    object_store: harness.ObjectStore,
    ready_mount: ReadyMount,
) -> None:
    """Where the chart allows it (rbac.manifestNamespaces), the operator writes the
    manifest it pinned for the sidecars (`manifest_handoff`): the exact manifest the pin
    names, owned by the mount (the garbage collector deletes it with the mount)."""
    expected = manifests.resolve(
        ready_mount.uri, format="parquet", storage_options=harness.store_env(object_store)
    )
    core = kubernetes.client.CoreV1Api(admin)
    name = manifest_handoff.config_map_name(ready_mount.name, manifest_handoff.PRIMARY, 0)
    config_map = core.read_namespaced_config_map(name, ready_mount.namespace)
    obj = objects.get_datasetmount(admin, ready_mount.namespace, ready_mount.name)
    (owner,) = config_map.metadata.owner_references
    assert (owner.kind, owner.name, owner.uid) == (
        "DatasetMount",
        ready_mount.name,
        obj["metadata"]["uid"],
    )
    digest = ready_mount.status["manifestDigest"]
    assert config_map.metadata.annotations[manifest_handoff.ANNOTATION_DIGEST] == digest
    packed = base64.b64decode(config_map.binary_data[handed_manifests.DATA_KEY])
    assert gzip.decompress(packed) == pinned_manifests.encode(expected)
    with pytest.raises(ApiException) as absent:  # one part is the whole of a small manifest
        core.read_namespaced_config_map(
            manifest_handoff.config_map_name(ready_mount.name, manifest_handoff.PRIMARY, 1),
            ready_mount.namespace,
        )
    assert absent.value.status == 404


INVALID: dict[str, tuple[dict[str, Any], str]] = {
    # OpenAPI schema: enum, minimum, required, pattern.
    "unknown-format": (
        {"source": {"uri": "s3://b/p/", "format": "csv"}},
        'Unsupported value: "csv"',
    ),
    "negative-prefetch": (
        {"source": {"uri": "s3://b/p/"}, "prefetch": {"depth": -1}},
        "spec.prefetch.depth",
    ),
    "missing-uri": ({"source": {"format": "parquet"}}, "spec.source.uri: Required value"),
    "unknown-shuffle-granularity": (
        {"source": {"uri": "s3://b/p/"}, "sharding": {"granularity": "rows"}},
        'Unsupported value: "rows"',
    ),
    "zero-shuffle-window": (
        {"source": {"uri": "s3://b/p/"}, "sharding": {"window": 0}},
        "spec.sharding.window",
    ),
    "zero-checkpoint-concurrency": (
        {"source": {"uri": "s3://b/p/"}, "checkpoint": {"uri": "s3://c/", "concurrency": 0}},
        "spec.checkpoint.concurrency",
    ),
    "checkpoint-path-with-dot-dot": (
        {"source": {"uri": "s3://b/p/"}, "checkpoint": {"uri": "s3://c/", "mountPath": "/a/../b"}},
        "spec.checkpoint.mountPath",
    ),
    "secret-name-with-a-final-newline": (
        {"source": {"uri": "s3://b/p/", "secretRef": {"name": "creds\n"}}},
        "spec.source.secretRef.name",
    ),
    # CEL (x-kubernetes-validations): rules across fields.
    "checkpoint-path-at-the-disk-tier": (
        {
            "source": {"uri": "s3://b/p/"},
            "checkpoint": {"uri": "s3://c/", "mountPath": "/var/cache/shardcache"},
        },
        "must not be, hold or lie inside the cache sidecar's own directories",
    ),
    "checkpoint-path-above-the-run-directory": (
        {"source": {"uri": "s3://b/p/"}, "checkpoint": {"uri": "s3://c/", "mountPath": "/var"}},
        "must not be, hold or lie inside the cache sidecar's own directories",
    ),
    "fixed-rank-without-world-size": (
        {"source": {"uri": "s3://b/p/"}, "sharding": {"rankFrom": "Fixed", "rank": 0}},
        "rankFrom Fixed needs both rank and worldSize",
    ),
    "rank-beyond-world-size": (
        {
            "source": {"uri": "s3://b/p/"},
            "sharding": {"rankFrom": "Fixed", "rank": 4, "worldSize": 4},
        },
        "rank must be smaller than worldSize",
    ),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_datasetmount_is_refused_by_the_api_server_with_its_message(
    admin: kubernetes.client.ApiClient, release: object, workload_namespace: str, case: str
) -> None:
    spec, message = INVALID[case]
    body = {
        "apiVersion": f"{objects.GROUP}/{objects.VERSION}",
        "kind": "DatasetMount",
        "metadata": {"name": f"invalid-{case}"},
        "spec": spec,
    }
    with pytest.raises(ApiException) as refused:
        objects.create_datasetmount(admin, workload_namespace, body)
    assert refused.value.status == 422, refused.value.body
    assert message in json.loads(refused.value.body)["message"]


#: spec.checkpoint fields that tune the sidecar's checkpoint agent.
AGENT_FIELDS = ("restoreFallback", "concurrency", "verifyUploads", "uploadBuffer")


def test_api_server_defaults_checkpoint_agent_settings_to_the_agents_own(
    admin: kubernetes.client.ApiClient, release: object, workload_namespace: str
) -> None:
    body = objects.datasetmount("ckpt-defaults", "s3://b/p/", checkpoint={"uri": "s3://c/"})
    custom = kubernetes.client.CustomObjectsApi(admin)
    # A dry run: the API server applies the CRD's defaults and stores nothing.
    stored = custom.create_namespaced_custom_object(
        objects.GROUP, objects.VERSION, workload_namespace, objects.PLURAL, body, dry_run="All"
    )
    checkpoint = stored["spec"]["checkpoint"]
    assert {k: checkpoint[k] for k in AGENT_FIELDS} == {
        "restoreFallback": False,
        "concurrency": 8,
        "verifyUploads": False,
        "uploadBuffer": "512Mi",
    }


def test_name_longer_than_a_label_value_is_refused_by_cel(
    admin: kubernetes.client.ApiClient, release: object, workload_namespace: str
) -> None:
    body = objects.datasetmount("n" * 64, "s3://b/p/")
    with pytest.raises(ApiException) as refused:
        objects.create_datasetmount(admin, workload_namespace, body)
    assert refused.value.status == 422
    assert "metadata.name must be at most 63 characters" in refused.value.body


def test_secret_the_operator_may_not_read_leaves_it_pending_with_the_reason(
    admin: kubernetes.client.ApiClient,
    operator: harness.Operator,
    workload_namespace: str,
    object_store: harness.ObjectStore,
    s3_secret: str,
) -> None:
    """The chart grants `get` on the one Secret name it was given; another Secret in the
    same namespace is not readable, and the DatasetMount says so instead of failing."""
    other = objects.unique("other-credentials")
    core = kubernetes.client.CoreV1Api(admin)
    core.create_namespaced_secret(
        workload_namespace,
        kubernetes.client.V1Secret(
            metadata={"name": other}, string_data={"AWS_ACCESS_KEY_ID": "x"}
        ),
    )
    name = objects.unique("forbidden")
    uri = f"s3://{object_store.make_bucket('e2e')}/data/"
    objects.create_datasetmount(
        admin, workload_namespace, objects.datasetmount(name, uri, secret=other)
    )
    status = objects.wait_phase(
        admin, workload_namespace, name, "Pending", operator, reason="SecretForbidden"
    )
    assert (
        f"may not get Secret {workload_namespace}/{other}"
        in objects.condition(status, "Ready")["message"]
    )
    assert "manifestDigest" not in status


def test_handing_again_replaces_the_configmaps_and_deletes_the_tail(
    admin: kubernetes.client.ApiClient, workload_namespace: str, release: object
) -> None:
    """A re-pin writes over the ConfigMaps of the earlier pin (an update without a
    resourceVersion) and deletes the parts past the new manifest's, through the real API
    server; deleting one already gone is no error."""
    api = kube.Api(admin)
    core = kubernetes.client.CoreV1Api(admin)
    mount = objects.unique("handed")
    owner = {"apiVersion": "v1", "kind": "ConfigMap", "name": mount, "uid": ""}
    # Owned by a ConfigMap of the test's own, which is deleted at the end with them.
    anchor = core.create_namespaced_config_map(
        workload_namespace, {"metadata": {"name": mount}, "data": {}}
    )
    owner["uid"] = anchor.metadata.uid

    def hand(digest: str, parts: list[bytes]) -> None:
        failure = asyncio.run(
            manifest_handoff.hand(
                api,
                owner=owner,
                namespace=workload_namespace,
                source="",
                digest=digest,
                parts=parts,
            )
        )
        assert failure is None

    def found() -> list[tuple[str, bytes | None]]:
        """(the pin it hands, its bytes) of each part there is, in order."""
        parts = []
        for part in range(handed_manifests.MAX_PARTS):
            name = manifest_handoff.config_map_name(mount, "", part)
            try:
                config_map = core.read_namespaced_config_map(name, workload_namespace)
            except ApiException as exc:
                assert exc.status == 404
                continue
            digest = config_map.metadata.annotations[manifest_handoff.ANNOTATION_DIGEST]
            data = (config_map.binary_data or {}).get(handed_manifests.DATA_KEY)
            parts.append((digest, None if data is None else base64.b64decode(data)))
        return parts

    def hands(digest: str) -> bool:
        """What a backfill reads of them (`kube.Api.read_config_map`) and judges."""
        names = [
            manifest_handoff.config_map_name(mount, "", p)
            for p in range(handed_manifests.MAX_PARTS)
        ]
        read = [asyncio.run(api.read_config_map(workload_namespace, n)) for n in names]
        return manifest_handoff.hands(read, digest)

    first, second = "sha256:" + "1" * 64, "sha256:" + "2" * 64
    try:
        hand(first, [b"a" * 10, b"b" * 10, b"c"])
        assert found() == [(first, b"a" * 10), (first, b"b" * 10), (first, b"c")]
        assert hands(first) and not hands(second)
        hand(second, [b"z"])
        assert found() == [(second, b"z")]
        assert hands(second) and not hands(first)
        hand(second, [])  # too large to hand: part 0 says so, without data
        assert found() == [(second, None)]
        assert hands(second)
    finally:
        core.delete_namespaced_config_map(mount, workload_namespace)
