"""Limits hold on the real node: a cold epoch over a dataset about twice the size of the
memory tier runs through with the run volume's `sizeLimit` (a tmpfs of that size: the
tier plus the webhook's headroom for evicted shards a reader still maps) and the
sidecar's memory limit enforced by the kernel: no OOM kill, no eviction, every row.
"""

from __future__ import annotations

import secrets
import urllib.request

import kubernetes.client
import pytest
from shardcache_operator import injection

from tests.e2e import harness
from tests.node.product import jobs, pods, release
from tests.support import s3server

# Fixture set-up (images, the release, a Ready mount) counts towards the first test.
pytestmark = [pytest.mark.node, pytest.mark.timeout(900)]

#: Ten shards of 50,000 rows: about 3.5 MiB each once decoded to Arrow, 35 MiB in all.
SHARDS = (50_000,) * 10
#: The memory tier: well under the decoded dataset.
MEMORY = "16Mi"
#: The run volume's sizeLimit: the tier plus a quarter (pod_volumes.RUN_VOLUME_HEADROOM).
VOLUME_KIB = 20 * 1024
#: The sidecar's own memory limit; the injection adds the run volume on top (tmpfs
#: pages are charged to the pod's memory cgroup).
SIDECAR_MEMORY = "256Mi"
LINGER_S = 600


def _metrics(pod: kubernetes.client.V1Pod) -> str:
    sidecar = next(c for c in pod.spec.init_containers if c.name.startswith(pods.SIDECAR_PREFIX))
    url = f"http://{pod.status.pod_ip}:{sidecar.ports[0].container_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        return str(response.read().decode())


def test_cold_epoch_larger_than_the_memory_tier_stays_within_size_and_memory_limits(
    admin: kubernetes.client.ApiClient,
    operator: harness.InClusterOperator,
    node_store: s3server.S3Server,
    namespace: str,
    product_images: release.ProductImages,
    real_node: release.RealNode,
) -> None:
    core = kubernetes.client.CoreV1Api(admin)
    mount = release.make_mount(
        admin, operator, node_store, namespace, "bounded", SHARDS,
        cache={"memory": MEMORY},
        prefetch={"depth": 2},
        sharding={"seed": release.TRAIN_SEED, "rankFrom": "Reader"},
        sidecar={"resources": {"requests": {"cpu": "50m", "memory": "128Mi"},
                               "limits": {"memory": SIDECAR_MEMORY}}},
    )  # fmt: skip
    name = f"bounded-{secrets.token_hex(3)}"
    body = jobs.single_pod(
        name, mount.name, product_images.trainer,
        settings=release.trainer_settings(
            TRAINER_BATCH_SIZE=4096, TRAINER_PROGRESS_ROWS=100_000, TRAINER_CHECKSUMS=0,
            TRAINER_LINGER_SECONDS=LINGER_S,
        ),
        node_selector=real_node.node_selector, tolerations=real_node.tolerations,
    )  # fmt: skip
    body["metadata"]["annotations"] = {injection.ANNOTATION_WORLD_SIZE: "1"}
    core.create_namespaced_pod(namespace, body)
    try:
        done = pods.wait_event(core, namespace, name, lambda e: e["event"] == "done", "epoch done")
        # The kubelet reports the phase on its own schedule: a trainer can log "done"
        # while the pod's status still says Pending (seen once in CI).
        pod = pods.wait_pod(
            core, namespace, name,
            lambda p: p.status.phase == "Running"
            and any(s.ready for s in p.status.init_container_statuses or []),
            "running with its sidecar ready",
        )  # fmt: skip
        log = pods.log(core, namespace, name, jobs.TRAINER_CONTAINER)
        metrics = _metrics(pod)
    finally:
        core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)

    total = sum(SHARDS)
    assert done["rows"] == total and done["uid_sum"] == total * (total - 1) // 2
    assert jobs.expand(done["runs"]) == list(range(total))
    # The run volume is a tmpfs exactly sizeLimit big: the kernel, not the sidecar's
    # bookkeeping alone, bounds the memory tier (and its headroom).
    volume = jobs.event(log, "start")["run_volume"]
    assert volume["fstype"] == "tmpfs", volume
    assert f"size={VOLUME_KIB}k" in volume["options"].split(","), volume
    # The tier was full and evicted to make room: the bound was exercised, and held.
    assert harness.metric_value(metrics, "shardcache_cache_evictions_total", {"tier": "memory"}) > 0
    assert harness.metric_value(metrics, "shardcache_source_errors_total") == 0
    assert pod.status.phase == "Running" and pod.status.reason != "Evicted", pod.status
    sidecar = pods.sidecar_status(pod)
    assert sidecar.restart_count == 0, sidecar.last_state  # no OOM kill, no crash
    assert sidecar.state.running is not None and sidecar.ready
    resources = next(c.resources for c in pod.spec.init_containers if c.name == sidecar.name)
    assert resources.limits["memory"] == "276Mi", resources  # 256Mi + the 20Mi run volume
    # The scheduler counted the tmpfs too: the request is raised as the limit is.
    assert resources.requests["memory"] == "148Mi", resources  # 128Mi + the 20Mi volume
