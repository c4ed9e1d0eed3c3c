"""The product on the real node: a DatasetMount goes Ready, an Indexed Job of two ranks
runs through the sidecars the webhook injected, every row is read exactly once; then a
second pod reads the same dataset from the node's disk tier, and what the containers
enforce is checked from inside them while it runs.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import secrets
import urllib.request
from collections.abc import Iterator
from typing import Any

import kubernetes.client
import pytest
from shardcache_operator import injection

from shardcache.node import handed_manifests
from tests.e2e import harness
from tests.node.product import jobs, pods, release

# Fixture set-up (images, the release, a Ready mount) counts towards the first test.
pytestmark = [pytest.mark.node, pytest.mark.timeout(900)]

RANKS = 2
#: The second pod stays up this long after its epoch, so the test can look inside it
#: and scrape its sidecar; the test deletes it when done.
LINGER_S = 600


@dataclasses.dataclass(frozen=True)
class RanJob:
    name: str
    job: kubernetes.client.V1Job
    pods: list[Any]
    logs: dict[int, str]


@pytest.fixture(scope="module")
def core(admin: kubernetes.client.ApiClient) -> kubernetes.client.CoreV1Api:
    return kubernetes.client.CoreV1Api(admin)


@pytest.fixture(scope="module")
def ran_job(
    admin: kubernetes.client.ApiClient,
    core: kubernetes.client.CoreV1Api,
    namespace: str,
    train_mount: release.Mount,
    product_images: release.ProductImages,
    real_node: release.RealNode,
) -> RanJob:
    name = f"train-{secrets.token_hex(3)}"
    body = jobs.indexed_job(
        name, train_mount.name, product_images.trainer, ranks=RANKS,
        settings=release.trainer_settings(),
        node_selector=real_node.node_selector, tolerations=real_node.tolerations,
    )  # fmt: skip
    kubernetes.client.BatchV1Api(admin).create_namespaced_job(namespace, body)
    job = pods.wait_job_complete(admin, namespace, name)
    job_pods = pods.job_pods(core, namespace, name)
    logs = {}
    for pod in job_pods:
        rank = int(pod.metadata.annotations[injection.ANNOTATION_JOB_INDEX])
        logs[rank] = pods.log(core, namespace, pod.metadata.name, jobs.TRAINER_CONTAINER)
    return RanJob(name, job, job_pods, logs)


def test_datasetmount_is_ready_with_the_dataset_pinned(train_mount: release.Mount) -> None:
    status = train_mount.status
    assert status["phase"] == "Ready"
    assert status["manifestDigest"].startswith("sha256:")
    assert status["shards"] == len(release.TRAIN_SHARDS)
    assert status["rows"] == sum(release.TRAIN_SHARDS)


def test_indexed_job_reads_every_row_exactly_once_across_its_ranks(ran_job: RanJob) -> None:
    total = sum(release.TRAIN_SHARDS)
    assert sorted(ran_job.logs) == list(range(RANKS)), "one pod per rank, no retries"
    seen: list[int] = []
    for rank, log in ran_job.logs.items():
        done = jobs.event(log, "done")
        uids = jobs.expand(done["runs"])
        # Per rank: the plan's share, and what was read is what the rows hold.
        assert done["rows"] == jobs.rank_rows(total, rank, RANKS) == len(uids)
        assert jobs.Totals.reported(done) == jobs.Totals.of(uids)
        seen += uids
    # Across ranks: nothing lost, nothing read twice, the dataset's known totals.
    assert sorted(seen) == list(range(total))
    reported = [jobs.Totals.reported(jobs.event(log, "done")) for log in ran_job.logs.values()]
    assert sum(t.rows for t in reported) == total
    assert sum(t.uid_sum for t in reported) == total * (total - 1) // 2
    assert sum(t.text_crc for t in reported) == jobs.Totals.of(list(range(total))).text_crc
    assert sum(t.token_sum for t in reported) == jobs.Totals.of(list(range(total))).token_sum


def test_the_sidecar_started_and_answered_before_the_trainer(ran_job: RanJob) -> None:
    for pod in ran_job.pods:
        sidecar = pods.sidecar_status(pod)
        trainer = pods.container_status(pod, jobs.TRAINER_CONTAINER)
        assert pods.started_at(sidecar) <= pods.started_at(trainer)
        rank = int(pod.metadata.annotations[injection.ANNOTATION_JOB_INDEX])
        start = jobs.event(ran_job.logs[rank], "start")
        # The trainer's first act found the sidecar serving /readyz on its socket: the
        # startup probe held the trainer back until then.
        assert start["sidecar_answering"] is True, start


def test_job_completes_and_its_sidecars_are_gone(ran_job: RanJob) -> None:
    conditions = {c.type: c.status for c in ran_job.job.status.conditions}
    assert conditions.get("Complete") == "True"
    assert ran_job.job.status.succeeded == RANKS
    assert not ran_job.job.status.failed
    for pod in ran_job.pods:
        assert pod.status.phase == "Succeeded"
        sidecar = pods.sidecar_status(pod)
        # A native sidecar is stopped by the kubelet once the trainer exits.
        assert sidecar.state.running is None and sidecar.state.terminated is not None, sidecar
        assert sidecar.restart_count == 0
        trainer = pods.container_status(pod, jobs.TRAINER_CONTAINER)
        assert trainer.state.terminated.exit_code == 0


# -- a second pod on the node, while it runs --------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Running:
    name: str
    pod: Any
    log: str


@pytest.fixture(scope="module")
def second_pod(
    core: kubernetes.client.CoreV1Api,
    namespace: str,
    ran_job: RanJob,
    train_mount: release.Mount,
    product_images: release.ProductImages,
    real_node: release.RealNode,
) -> Iterator[Running]:
    """After the Job: one pod reads the whole dataset (world size 1) and lingers."""
    name = f"second-{secrets.token_hex(3)}"
    body = jobs.single_pod(
        name, train_mount.name, product_images.trainer,
        settings=release.trainer_settings(TRAINER_LINGER_SECONDS=LINGER_S),
        node_selector=real_node.node_selector, tolerations=real_node.tolerations,
    )  # fmt: skip
    body["metadata"]["annotations"] = {"shardcache.io/world-size": "1"}
    core.create_namespaced_pod(namespace, body)
    try:
        pods.wait_event(core, namespace, name, lambda e: e["event"] == "done", "its epoch done")
        pod = core.read_namespaced_pod(name, namespace)
        yield Running(name, pod, pods.log(core, namespace, name, jobs.TRAINER_CONTAINER))
    finally:
        core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)


def _metrics(pod: Any) -> str:
    sidecar = next(c for c in pod.spec.init_containers if c.name.startswith(pods.SIDECAR_PREFIX))
    port = sidecar.ports[0].container_port
    url = f"http://{pod.status.pod_ip}:{port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        return str(response.read().decode())


def test_metrics_are_scraped_from_the_pod_ip(second_pod: Running) -> None:
    address = ipaddress.ip_address(second_pod.pod.status.pod_ip)
    assert address in ipaddress.ip_network("198.18.0.0/15"), address
    text = _metrics(second_pod.pod)
    assert "shardcache_cache_hits_total" in text
    assert harness.metric_value(text, "shardcache_control_requests_total") > 0


def test_second_pod_reads_its_cold_epoch_from_the_node_disk_tier(second_pod: Running) -> None:
    done = jobs.event(second_pod.log, "done")
    total = sum(release.TRAIN_SHARDS)
    assert sorted(jobs.expand(done["runs"])) == list(range(total))
    text = _metrics(second_pod.pod)
    shards = len(release.TRAIN_SHARDS)
    # Its memory tier started empty (a new pod's volume); every shard came from the
    # disk tier the Job's sidecars filled, and not one byte from the object store. (A
    # memory-tier miss is a reader's lookup that found nothing: the warm-up and the
    # readahead, which made these shards resident, count none; every shard handed to
    # the reader counts a hit.)
    assert harness.metric_value(text, "shardcache_cache_hits_total", {"tier": "memory"}) >= shards
    assert harness.metric_value(text, "shardcache_cache_hits_total", {"tier": "disk"}) >= shards
    assert harness.metric_value(text, "shardcache_source_fetched_bytes_total") == 0
    assert harness.metric_value(text, "shardcache_source_errors_total") == 0
    # Nor a single request at start: the pinned manifest came from the node disk tier
    # too (the Job's sidecars kept it there), not from a listing and the shards' footers.
    # With no shard fetched either, this sidecar made no object-store request at all.
    loads = "shardcache_manifest_loads_total"
    assert harness.metric_value(text, loads, {"origin": "node"}) == 1
    assert harness.metric_value(text, loads, {"origin": "source"}) == 0


#: Read inside a container: what the kernel enforces on its main process (pid 1 of the
#: container's pid namespace), whether its root filesystem takes a write, and the names
#: (never values) of credential variables in that process's environment.
INSIDE = """
import json, os
status = dict(line.split(":", 1) for line in open("/proc/1/status").read().splitlines())
environ = open("/proc/1/environ", "rb").read().split(b"\\0")
names = sorted(e.split(b"=", 1)[0].decode() for e in environ if e)
try:
    open("/shardcache-write-probe", "w").close()
    root = "writable"
except OSError as exc:
    root = os.strerror(exc.errno)
print(json.dumps({
    "uid": status["Uid"].split(), "gid": status["Gid"].split(),
    "cap_eff": status["CapEff"].strip(), "cap_prm": status["CapPrm"].strip(),
    "no_new_privs": status["NoNewPrivs"].strip(), "root": root,
    "secret_env": [n for n in names if n.startswith("AWS_")],
}))
"""


def _inside(cluster: harness.Cluster, namespace: str, pod: str, container: str) -> dict[str, Any]:
    out = pods.exec_python(cluster, namespace, pod, container, INSIDE)
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("which", ["sidecar", "trainer"])
def test_security_context_is_enforced_inside_the_running_containers(
    which: str, node_cluster: harness.Cluster, namespace: str, second_pod: Running
) -> None:
    container = (
        jobs.TRAINER_CONTAINER if which == "trainer" else pods.sidecar_status(second_pod.pod).name
    )
    seen = _inside(node_cluster, namespace, second_pod.name, container)
    assert seen["uid"] == ["65532"] * 4, seen  # real, effective, saved, fs
    assert seen["gid"][0] == "65532", seen
    assert seen["cap_eff"] == "0000000000000000", seen
    assert seen["cap_prm"] == "0000000000000000", seen
    assert seen["no_new_privs"] == "1", seen
    assert seen["root"] == "Read-only file system", seen
    if which == "sidecar":
        # The sidecar alone holds the object store's credentials (envFrom the Secret).
        assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(seen["secret_env"]), seen
    else:
        assert seen["secret_env"] == [], seen


def test_trainer_environment_holds_no_credentials_from_its_first_instruction(
    ran_job: RanJob, second_pod: Running
) -> None:
    for log in [*ran_job.logs.values(), second_pod.log]:
        assert jobs.event(log, "start")["aws_env"] == []


#: Inside the sidecar: what it finds of the manifest the operator handed (the directory
#: the kubelet projected the ConfigMaps into), read with the sidecar's own code.
HANDED = """
import json, os
from pathlib import Path
from shardcache.node import handed_manifests
directory = Path(os.environ["SHARDCACHE_HANDED_MANIFESTS_DIR"])
found = handed_manifests.load(directory, digest=sys.argv[1], uri=sys.argv[2])
print(json.dumps({
    "files": sorted(os.listdir(directory)),
    "digest": None if found is None else found.digest,
    "shards": None if found is None else len(found.shards),
}))
"""


def test_the_operator_hands_the_pinned_manifest_into_the_running_sidecar(
    node_cluster: harness.Cluster,
    namespace: str,
    train_mount: release.Mount,
    ran_job: RanJob,
    core: kubernetes.client.CoreV1Api,
    second_pod: Running,
) -> None:
    """rbac.manifestNamespaces lists this namespace: the chart's operator wrote the
    manifest it pinned into ConfigMaps, the webhook projected them into the sidecar and
    the kubelet mounted them, where the sidecar's own code finds the pinned manifest.
    So no sidecar of the Job read the dataset to hash it: each took the manifest the
    operator handed, or the copy a sidecar before it on the node kept."""
    digest = train_mount.status["manifestDigest"]
    uri = f"s3://{train_mount.bucket}/data/"
    sidecar = pods.sidecar_status(second_pod.pod).name
    code = HANDED.replace("sys.argv[1]", repr(digest)).replace("sys.argv[2]", repr(uri))
    seen = json.loads(pods.exec_python(node_cluster, namespace, second_pod.name, sidecar, code)
                      .strip().splitlines()[-1])  # fmt: skip
    # The kubelet's own entries (`..data` and its timestamped directory) beside the one
    # part a manifest this small needs.
    files = [name for name in seen["files"] if not name.startswith("..")]
    assert files == [handed_manifests.file_name(digest, uri, 0)], seen
    assert seen["digest"] == digest and seen["shards"] == len(release.TRAIN_SHARDS), seen
    for pod in ran_job.pods:
        log = pods.log(core, namespace, pod.metadata.name, pods.sidecar_status(pod).name)
        assert "handed by the operator" in log or "from the node disk tier" in log, log[-2000:]
