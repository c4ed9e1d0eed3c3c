"""A DatasetMount failing for a cause outside its spec recovers once the cause is fixed.

Through the real API server and the operator under the chart's identity: a Secret
missing a key (`SecretInvalid`), then holding a wrong key (`CredentialsRejected`),
then fixed, brings the mount to Ready without a spec edit; so does restoring the data a
`spec.source.version` pins (`DigestMismatch`). Before, both stayed `Invalid` until the
spec changed or the operator restarted (docs/operator.md, "Status, phases and
conditions"). The harness's backoff (1 s doubling to 5 s) bounds the waits.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import kubernetes.client
import pytest

from shardcache import manifests
from tests.e2e import harness, objects

pytestmark = pytest.mark.e2e


def put_secret(
    admin: kubernetes.client.ApiClient, namespace: str, name: str, data: Mapping[str, str]
) -> None:
    body = kubernetes.client.V1Secret(
        metadata=kubernetes.client.V1ObjectMeta(name=name), string_data=dict(data)
    )
    kubernetes.client.CoreV1Api(admin).replace_namespaced_secret(name, namespace, body)


@pytest.fixture
def secret_restored(
    admin: kubernetes.client.ApiClient,
    workload_namespace: str,
    object_store: harness.ObjectStore,
    s3_secret: str,
) -> Iterator[str]:
    """The shared Secret (the one name the chart lets the operator read), put back as
    it was whatever the test did to it: other tests' mounts read it too."""
    try:
        yield s3_secret
    finally:
        put_secret(admin, workload_namespace, s3_secret, harness.store_env(object_store))


def test_a_mount_recovers_once_its_secret_is_fixed(
    admin: kubernetes.client.ApiClient,
    operator: harness.Operator,
    workload_namespace: str,
    object_store: harness.ObjectStore,
    secret_restored: str,
) -> None:
    uri = objects.write_shards(object_store, shard_rows=(10, 10))
    env = harness.store_env(object_store)
    name = objects.unique("fix-secret")
    ns = workload_namespace
    put_secret(
        admin, ns, secret_restored, {k: v for k, v in env.items() if k != "AWS_SECRET_ACCESS_KEY"}
    )
    objects.create_datasetmount(admin, ns, objects.datasetmount(name, uri))
    invalid = objects.wait_phase(admin, ns, name, "Pending", operator, reason="SecretInvalid")
    message = objects.condition(invalid, "Ready")["message"]
    assert f"Secret {ns}/{secret_restored}" in message and "AWS_SECRET_ACCESS_KEY" in message

    put_secret(admin, ns, secret_restored, {**env, "AWS_SECRET_ACCESS_KEY": "not-the-key"})
    rejected = objects.wait_phase(
        admin, ns, name, "Pending", operator, reason="CredentialsRejected"
    )
    message = objects.condition(rejected, "Ready")["message"]
    assert f"Secret {ns}/{secret_restored}" in message and "not-the-key" not in message
    assert objects.condition(rejected, "SourceReachable")["status"] == "False"

    put_secret(admin, ns, secret_restored, env)
    ready = objects.wait_phase(admin, ns, name, "Ready", operator)
    assert ready["manifestDigest"].startswith("sha256:")
    uid = objects.get_datasetmount(admin, ns, name)["metadata"]["uid"]
    wanted = {"SecretInvalid", "CredentialsRejected", "ManifestPinned"}
    harness.wait_until(
        f"Events {sorted(wanted)} of DatasetMount {ns}/{name}",
        lambda: wanted <= {e.reason for e in objects.events_of(admin, ns, uid)},
        timeout=30,
    )


def test_restoring_the_pinned_data_heals_a_digest_mismatch(
    admin: kubernetes.client.ApiClient,
    operator: harness.Operator,
    workload_namespace: str,
    object_store: harness.ObjectStore,
    s3_secret: str,
) -> None:
    uri = objects.write_shards(object_store, shard_rows=(10, 10))
    env = harness.store_env(object_store)
    pinned = manifests.resolve(uri, format="parquet", storage_options=env).digest
    fs = object_store.filesystem()
    prefix = uri.removeprefix("s3://").rstrip("/")
    extra = f"{prefix}/part-00099.parquet"
    with fs.open_input_file(f"{prefix}/part-00000.parquet") as f:
        data = f.read()
    with fs.open_output_stream(extra) as f:  # someone adds a shard
        f.write(data)
    name = objects.unique("digest-pin")
    body = objects.datasetmount(name, uri)
    body["spec"]["source"]["version"] = pinned
    objects.create_datasetmount(admin, workload_namespace, body)
    mismatch = objects.wait_phase(
        admin, workload_namespace, name, "Degraded", operator, reason="DigestMismatch"
    )
    assert pinned in objects.condition(mismatch, "Ready")["message"]

    fs.delete_file(extra)  # ... and the pinned data is restored
    ready = objects.wait_phase(admin, workload_namespace, name, "Ready", operator)
    assert ready["manifestDigest"] == pinned
