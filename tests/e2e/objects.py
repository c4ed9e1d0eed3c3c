"""Builders and waiters for the objects the e2e tests create through the API server."""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any, cast

import kubernetes.client
from shardcache_operator import injection, specs

from tests.e2e import harness
from tests.support import datasets

SECRET_NAME = "s3-credentials"
#: Resolving a manifest of a few shards on loopback takes well under a second; the
#: bound covers a busy machine and the operator's first list calls.
PHASE_TIMEOUT_S = 90.0
GROUP, VERSION, PLURAL = specs.GROUP, specs.VERSION, specs.PLURAL
#: What trainer containers run: kwok never starts it, kind runs it (the sidecar image has
#: Python, and it is loaded into kind already).
TRAINER_IMAGE = ":".join(harness.SIDECAR_IMAGE)
TRAINER_COMMAND = ["python3", "-c", "import time; time.sleep(3600)"]


def write_shards(store: harness.ObjectStore, shard_rows: tuple[int, ...]) -> str:
    """Parquet shards in a new bucket; returns the s3:// URI of their prefix."""
    bucket = store.make_bucket("e2e")
    datasets.write_dataset(store.filesystem(), f"{bucket}/data", shard_rows)
    return f"s3://{bucket}/data/"


def datasetmount(
    name: str, uri: str, *, secret: str | None = SECRET_NAME, **spec: Any
) -> dict[str, Any]:
    source: dict[str, Any] = {"uri": uri, "format": "parquet"}
    if secret:
        source["secretRef"] = {"name": secret}
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "DatasetMount",
        "metadata": {"name": name},
        "spec": {"source": source, **spec},
    }


def body(obj: Mapping[str, Any]) -> Any:
    """`obj` as a request body: the client's methods are typed for its model classes,
    and serialise the plain dicts these tests build the same way."""
    return obj


def create_datasetmount(
    admin: kubernetes.client.ApiClient, namespace: str, body: Mapping[str, Any]
) -> dict[str, Any]:
    custom = kubernetes.client.CustomObjectsApi(admin)
    created = custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, dict(body))
    return cast(dict[str, Any], created)


def get_datasetmount(
    admin: kubernetes.client.ApiClient, namespace: str, name: str
) -> dict[str, Any]:
    custom = kubernetes.client.CustomObjectsApi(admin)
    obj = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    return cast(dict[str, Any], obj)


def wait_phase(
    admin: kubernetes.client.ApiClient,
    namespace: str,
    name: str,
    phase: str,
    operator: harness.Operator,
    *,
    reason: str | None = None,
    timeout: float = PHASE_TIMEOUT_S,
) -> dict[str, Any]:
    """Wait until status.phase is `phase` (and the Ready condition's reason, if given)."""
    last: dict[str, Any] = {}

    def check() -> dict[str, Any] | None:
        last.clear()
        last.update(get_datasetmount(admin, namespace, name).get("status") or {})
        if last.get("phase") != phase:
            return None
        if reason is not None and condition(last, "Ready").get("reason") != reason:
            return None
        return dict(last)

    return harness.wait_until(
        f"DatasetMount {namespace}/{name} phase {phase}" + (f" ({reason})" if reason else ""),
        check,
        timeout=timeout,
        describe=lambda: f"last status: {last}\n{operator.logs()}",
    )


def condition(status: Mapping[str, Any], kind: str) -> dict[str, Any]:
    for cond in status.get("conditions") or []:
        if cond.get("type") == kind:
            return dict(cond)
    return {}


def events_of(
    admin: kubernetes.client.ApiClient, namespace: str, uid: str
) -> list[kubernetes.client.CoreV1Event]:
    core = kubernetes.client.CoreV1Api(admin)
    listing = core.list_namespaced_event(namespace, field_selector=f"involvedObject.uid={uid}")
    return sorted(listing.items, key=lambda e: (e.reason or "", e.metadata.name))


def events_with(
    admin: kubernetes.client.ApiClient, namespace: str, uid: str, reason: str
) -> list[kubernetes.client.CoreV1Event]:
    """The Events of the object `uid` whose reason is `reason`; a wait's test."""
    return [e for e in events_of(admin, namespace, uid) if e.reason == reason]


def pod(
    name: str | None,
    mount: str | None,
    *,
    containers: int = 1,
    labels: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A trainer pod, opted in to `mount` when given."""
    all_labels = dict(labels or {})
    if mount:
        all_labels[injection.LABEL_MOUNT] = mount
    metadata: dict[str, Any] = {"labels": all_labels}
    if name:
        metadata["name"] = name
    else:
        metadata["generateName"] = "trainer-"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {
                    "name": "trainer" if i == 0 else f"trainer-{i}",
                    "image": TRAINER_IMAGE,
                    "command": TRAINER_COMMAND,
                }
                for i in range(containers)
            ],
        },
    }


def unique(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(3)}"
