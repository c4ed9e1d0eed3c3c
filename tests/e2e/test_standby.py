"""A second replica stands by through kopf peering and takes over when the active stops.

Two `shardcache operator` processes under the chart's identity share the chart's
ClusterKopfPeering: the standby (lowest priority) reconciles nothing while the active
one runs, and serves the DatasetMounts once the active one is gone.
"""

from __future__ import annotations

import pathlib

import kubernetes.client
import pytest
from shardcache_sidecar import listening

from tests.e2e import harness, objects

pytestmark = pytest.mark.e2e

TAKEOVER_TIMEOUT_S = 90.0
# The chart's peering (values: peering.name).
PEERING = "shardcache"


class Standby(harness.LocalOperator):
    """A LocalOperator that always loses the peering election while another runs."""

    def argv(self) -> list[str]:
        return [*super().argv(), "--priority=0"]


def peering_priorities(admin: kubernetes.client.ApiClient) -> set[int]:
    """The priorities of the peers in the chart's ClusterKopfPeering (0: the standby)."""
    custom = kubernetes.client.CustomObjectsApi(admin)
    peering = custom.get_cluster_custom_object("kopf.dev", "v1", "clusterkopfpeerings", PEERING)
    peers = (peering.get("status") or {}).values()
    return {0 if int(p.get("priority", 0)) == 0 else 1 for p in peers if isinstance(p, dict)}


def reconciled(operator: harness.Operator) -> float:
    return harness.metric_value(operator.metrics(), "shardcache_operator_reconcile_total")


def test_the_standby_replica_takes_over_when_the_active_one_stops(
    admin: kubernetes.client.ApiClient,
    operator: harness.Operator,
    workload_namespace: str,
    object_store: harness.ObjectStore,
    s3_secret: str,
    e2e_workdir: pathlib.Path,
) -> None:
    if not isinstance(operator, harness.LocalOperator):
        pytest.fail("the standby test runs two local operators; this provider runs none")
    workdir = e2e_workdir / "standby"
    workdir.mkdir(exist_ok=True)
    standby = Standby(
        workdir,
        operator.kubeconfig,
        operator.tls_dir,
        listening.free_port(),
        operator.sidecar_image,
        # The same platform policy: the object store is on loopback.
        source_endpoints=operator.source_endpoints,
    )
    standby.start()
    created: list[str] = []
    try:
        uri = objects.write_shards(object_store, shard_rows=(10, 12))
        first = objects.unique("active")
        objects.create_datasetmount(admin, workload_namespace, objects.datasetmount(first, uri))
        created.append(first)
        objects.wait_phase(admin, workload_namespace, first, "Ready", operator)
        # Both are in the peering, the standby (priority 0) below the active one: from
        # then on it is paused (kopf starts mandatory peering paused, and logs nothing
        # while it stays so), and it has reconciled nothing.
        harness.wait_until(
            "the standby's keep-alive beside the active operator's in the peering",
            lambda: peering_priorities(admin) >= {0, 1} or None,
            timeout=TAKEOVER_TIMEOUT_S,
            describe=lambda: f"{peering_priorities(admin)}\n{standby.logs()}",
        )
        assert reconciled(operator) >= 1
        assert reconciled(standby) == 0, standby.logs()

        operator.stop()
        second = objects.unique("standby")
        objects.create_datasetmount(admin, workload_namespace, objects.datasetmount(second, uri))
        created.append(second)
        objects.wait_phase(
            admin, workload_namespace, second, "Ready", standby, timeout=TAKEOVER_TIMEOUT_S
        )
        assert reconciled(standby) >= 1
    finally:
        standby.stop()
        operator.start()
        custom = kubernetes.client.CustomObjectsApi(admin)
        for name in created:
            custom.delete_namespaced_custom_object(
                objects.GROUP, objects.VERSION, workload_namespace, objects.PLURAL, name
            )
