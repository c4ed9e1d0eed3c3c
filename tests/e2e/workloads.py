"""A test's own DatasetMounts and pods, through the real API server.

Tests of the operator's pod bookkeeping (attached pods, deletion, admission from its
index) each make a Ready mount, start pods that use it on kwok's fake nodes, and wait
for `status.attachedPods` to follow. `Workload` (the `workload` fixture) holds what they
all need (the admin client, the operator, the namespace, the object store) and those
steps, so each test states only what it does with them.

On the local provider kwok's fake nodes run the pods (kube-scheduler binds them, kwok
reports them Running): the counts are of real pod objects moving through real phases.
A pod "finishes" by a status write of its terminal phase, as a kubelet would report it
(no kubelet runs there to end it, and kwok leaves terminal pods alone).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import kubernetes.client
from kubernetes.client import ApiException

from tests.e2e import harness, objects

#: kube-scheduler binds a pod and kwok reports it Running within seconds.
RUNNING_TIMEOUT_S = 90.0
#: The operator patches status.attachedPods on pod events; this allows for a busy machine.
COUNT_TIMEOUT_S = 60.0


def name_of(obj: Any) -> str:
    """A created object's name (the client's models type every field as optional)."""
    return str(obj.metadata.name)


def pod_phase(core: kubernetes.client.CoreV1Api, name: str, namespace: str) -> str | None:
    status = core.read_namespaced_pod(name, namespace).status
    return None if status is None else status.phase


@dataclasses.dataclass(frozen=True)
class Workload:
    admin: kubernetes.client.ApiClient
    operator: harness.Operator
    namespace: str
    store: harness.ObjectStore

    def ready_mount(self, prefix: str, **spec: Any) -> str:
        """A new DatasetMount on two small shards, once it is Ready; returns its name."""
        name = objects.unique(prefix)
        uri = objects.write_shards(self.store, shard_rows=(10, 10))
        objects.create_datasetmount(
            self.admin, self.namespace, objects.datasetmount(name, uri, **spec)
        )
        objects.wait_phase(self.admin, self.namespace, name, "Ready", self.operator)
        return name

    def start_pods(self, mount: str, count: int) -> list[str]:
        """`count` pods using `mount`, once all are Running; returns their names."""
        core = kubernetes.client.CoreV1Api(self.admin)
        created = [
            name_of(
                core.create_namespaced_pod(self.namespace, objects.body(objects.pod(None, mount)))
            )
            for _ in range(count)
        ]

        def phases() -> list[tuple[str, str | None]]:
            return [(n, pod_phase(core, n, self.namespace)) for n in created]

        harness.wait_until(
            f"{count} pods of {mount} Running on the fake nodes",
            lambda: all(phase == "Running" for _, phase in phases()),
            timeout=RUNNING_TIMEOUT_S,
            describe=lambda: str(phases()),
        )
        return created

    def attached(self, prefix: str, pods: int, **spec: Any) -> tuple[str, list[str]]:
        """A Ready mount with `pods` Running pods, once its status counts them all:
        (mount, pod names)."""
        name = self.ready_mount(prefix, **spec)
        created = self.start_pods(name, pods)
        self.wait_attached(name, pods)
        return name, created

    def finish_pod(self, name: str, phase: str) -> None:
        """The pod's containers exited: its phase as the kubelet reports it."""
        core = kubernetes.client.CoreV1Api(self.admin)
        core.patch_namespaced_pod_status(name, self.namespace, {"status": {"phase": phase}})
        harness.wait_until(
            f"pod {name} to be {phase}",
            lambda: pod_phase(core, name, self.namespace) == phase,
            timeout=RUNNING_TIMEOUT_S,
        )

    def delete_pod(self, name: str) -> None:
        """Delete a pod without grace, once it is gone."""
        core = kubernetes.client.CoreV1Api(self.admin)
        core.delete_namespaced_pod(
            name, self.namespace, body=kubernetes.client.V1DeleteOptions(grace_period_seconds=0)
        )

        def gone() -> bool:
            try:
                core.read_namespaced_pod(name, self.namespace)
            except ApiException as exc:
                return bool(exc.status == 404)
            return False

        harness.wait_until(f"pod {name} to be gone", gone, timeout=RUNNING_TIMEOUT_S)

    def delete_mount(self, name: str) -> None:
        """Ask the API server to delete the DatasetMount (its finalizer decides when)."""
        kubernetes.client.CustomObjectsApi(self.admin).delete_namespaced_custom_object(
            objects.GROUP, objects.VERSION, self.namespace, objects.PLURAL, name
        )

    def wait_attached(self, mount: str, count: int) -> dict[str, Any]:
        """The mount's status once `status.attachedPods == count`."""
        last: dict[str, Any] = {}

        def check() -> dict[str, Any] | None:
            last.clear()
            status = objects.get_datasetmount(self.admin, self.namespace, mount).get("status")
            last.update(status or {})
            return dict(last) if last.get("attachedPods") == count else None

        return harness.wait_until(
            f"status.attachedPods == {count} on {mount}",
            check,
            timeout=COUNT_TIMEOUT_S,
            describe=lambda: f"last status: {last}\n{self.operator.logs()}",
        )

    def wait_gone(self, mount: str) -> None:
        """Until the DatasetMount no longer exists (its finalizer let it go)."""

        def gone() -> bool:
            try:
                objects.get_datasetmount(self.admin, self.namespace, mount)
            except ApiException as exc:
                return bool(exc.status == 404)
            return False

        harness.wait_until(
            f"DatasetMount {mount} to be gone",
            gone,
            timeout=COUNT_TIMEOUT_S,
            describe=self.operator.logs,
        )
