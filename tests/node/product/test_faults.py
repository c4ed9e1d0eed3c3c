"""Faults on the real node: the kubelet restarts a sidecar killed with SIGKILL mid-epoch,
and a trainer pod deleted after a checkpoint is replaced by one that has the checkpoint
restored before its trainer starts. In both, no row is lost or read twice.
"""

from __future__ import annotations

import secrets
import time

import kubernetes.client
import pytest
from shardcache_operator import injection

from tests.e2e import harness
from tests.node.product import jobs, pods, preemption, release
from tests.support import s3server

# Fixture set-up (images, the release, a Ready mount) counts towards the first test.
pytestmark = [pytest.mark.node, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def core(admin: kubernetes.client.ApiClient) -> kubernetes.client.CoreV1Api:
    return kubernetes.client.CoreV1Api(admin)


def test_sidecar_killed_mid_epoch_is_restarted_and_no_row_is_lost_or_repeated(
    core: kubernetes.client.CoreV1Api,
    namespace: str,
    train_mount: release.Mount,
    product_images: release.ProductImages,
    real_node: release.RealNode,
) -> None:
    total = train_mount.total_rows
    name = f"killed-{secrets.token_hex(3)}"
    body = jobs.single_pod(
        name, train_mount.name, product_images.trainer,
        # 25 batches, a pause after each: the kill lands mid-epoch.
        settings=release.trainer_settings(TRAINER_STEP_SECONDS=0.5),
        node_selector=real_node.node_selector, tolerations=real_node.tolerations,
    )  # fmt: skip
    body["metadata"]["annotations"] = {injection.ANNOTATION_WORLD_SIZE: "1"}
    core.create_namespaced_pod(namespace, body)
    before = pods.wait_event(
        core, namespace, name, lambda e: e["event"] == "progress" and e["rows"] >= 24,
        "a few batches read",
    )  # fmt: skip
    pod = core.read_namespaced_pod(name, namespace)
    sidecar = pods.sidecar_status(pod)
    killed = pods.kill_9(sidecar.container_id)
    killed_at = time.time()

    def restarted(pod: kubernetes.client.V1Pod) -> bool:
        status = pods.sidecar_status(pod)
        return bool(status.restart_count >= 1 and status.state.running is not None)

    # Seen while the trainer still reads: the kubelet restarted the killed sidecar.
    pod = pods.wait_pod(core, namespace, name, restarted, "the sidecar restarted")
    sidecar = pods.sidecar_status(pod)
    assert sidecar.last_state.terminated is not None, f"{sidecar} (killed {killed})"
    assert sidecar.last_state.terminated.exit_code == 137, sidecar.last_state  # SIGKILL
    assert pod.status.phase == "Running"

    pod = pods.wait_pod(core, namespace, name, lambda p: p.status.phase == "Succeeded", "done")
    assert pods.sidecar_status(pod).restart_count == 1, "killed once, restarted once"
    log = pods.log(core, namespace, name, jobs.TRAINER_CONTAINER)
    done = jobs.event(log, "done")
    assert before["rows"] < total and done["t"] > killed_at, "the kill was not mid-epoch"
    # The same trainer process read on through the restart: one start, one epoch, exact.
    assert [e["event"] for e in jobs.events(log)].count("start") == 1
    uids = jobs.expand(done["runs"])
    assert sorted(uids) == list(range(total)) and done["rows"] == total
    assert jobs.Totals.reported(done) == jobs.Totals.of(uids)
    trainer = pods.container_status(pod, jobs.TRAINER_CONTAINER)
    assert trainer.restart_count == 0 and trainer.state.terminated.exit_code == 0


CHECKPOINT_AT = 64


def test_replacement_pod_restores_the_checkpoint_before_its_trainer_and_resumes_exactly(
    admin: kubernetes.client.ApiClient,
    core: kubernetes.client.CoreV1Api,
    namespace: str,
    operator: harness.InClusterOperator,
    node_store: s3server.S3Server,
    product_images: release.ProductImages,
    real_node: release.RealNode,
) -> None:
    checkpoints = node_store.make_bucket("ckpt")
    mount = preemption.resumable_mount(
        admin, operator, node_store, namespace, "resumable",
        checkpoint_uri=f"s3://{checkpoints}/run/",
    )  # fmt: skip
    name = preemption.start_job(
        admin, namespace, "resume", mount, product_images, real_node,
        TRAINER_CHECKPOINT_AT=CHECKPOINT_AT,
    )  # fmt: skip
    first_name, committed = preemption.wait_first_checkpoint(core, namespace, name)
    first_log = pods.log(core, namespace, first_name, jobs.TRAINER_CONTAINER)
    first_start = jobs.event(first_log, "start")["checkpoints"]
    assert first_start["dirs"] == [] and first_start["restore"]["phase"] == "clean"
    log = preemption.preempt(admin, core, namespace, name, first_name)
    start = jobs.event(log, "start")
    step = committed["step"]
    # The trainer's very first look at its volume finds the checkpoint there: the
    # sidecar restored it from the object store before the trainer was started.
    assert start["checkpoints"]["dirs"] == [f"step-{step}"], start
    restore = start["checkpoints"]["restore"]
    assert restore["phase"] == "restored" and restore["step"] == step, restore
    # Bytes came from the object store (or a verified copy already on the node).
    assert restore["downloaded_bytes"] + restore["reused_bytes"] > 0, restore
    resumed = jobs.event(log, "resumed")
    assert resumed["position"] == step == committed["position"]
    assert resumed["runs"] == committed["runs"]
    before = jobs.expand(resumed["runs"])
    done = jobs.event(log, "done")
    after = jobs.expand(done["runs"])
    # The exact next sample: together the two pods read every row once.
    assert not set(before) & set(after)
    assert sorted(before + after) == list(range(mount.total_rows))
    assert done["rows"] == mount.total_rows - step
    assert jobs.Totals.reported(done) == jobs.Totals.of(after)
