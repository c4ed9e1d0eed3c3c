"""`shardcache skip` on the real node: a Job's pod commits a checkpoint with its data
state, the skip is requested with the command against the object store, the pod is
deleted, and its replacement's sidecar restores the checkpoint with the skip before the
trainer starts. The trainer reads neither the skipped samples nor any sample twice, and
the DatasetMount's status and an Event report the skip (issue 19, the pods' test).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import kubernetes.client
import pytest
from shardcache_operator import skips

from shardcache import plans
from tests.e2e import harness, objects
from tests.node.product import jobs, preemption, release
from tests.support import s3server

# Fixture set-up (images, the release, a Ready mount) counts towards the first test.
pytestmark = [pytest.mark.node, pytest.mark.timeout(900)]

CHECKPOINT_AT = 64
BATCH_SIZE = 8
SKIP_BATCHES = 3
REASON = "loss spike on the node"
#: The operator's check-skips timer runs every release.SKIPS_INTERVAL_S here: a few
#: rounds on two busy cores, never the chart's default minute.
REPORT_TIMEOUT_S = 120.0
#: The venv's console script: what a user runs, with the host's view of the store.
SHARDCACHE = pathlib.Path(sys.executable).with_name("shardcache")


def reading_order(status: dict[str, Any], total: int) -> list[int]:
    """Sample ids in the order the trainer (one rank of world size 1) reads epoch 0 of
    the shards: the plan is a pure function of the pinned digest and the plan parameters
    the trainer gives `shardcache.open()` (seed, rank, world size) and those it leaves
    out, which open() takes from the mount's spec.sharding (shuffle, blockSize: the
    webhook writes them into the trainer, issue 19), and the dataset's uid of a row is
    its global index (tests/support/datasets.py)."""
    params = plans.PlanParams(
        seed=release.TRAIN_SEED, rank=0, world_size=1, block_size=release.TRAIN_BLOCK_SIZE
    )
    offsets = plans.shard_offsets(release.TRAIN_SHARDS)
    runs = plans.rank_runs(release.TRAIN_SHARDS, status["manifestDigest"], params)
    order = [
        plans.global_index(offsets, r.shard, row) for r in runs for row in range(r.start, r.stop)
    ]
    assert sorted(order) == list(range(total)), "the plan must cover every row once"
    return order


def request_skip(store: s3server.S3Server, uri: str, *, step: int) -> dict[str, Any]:
    proc = subprocess.run(
        [str(SHARDCACHE), "skip", "--checkpoint-uri", uri, "--step", str(step),
         "--batches", str(SKIP_BATCHES), "--reason", REASON, "--json"],
        env={**os.environ, **store.env()}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, f"shardcache skip: rc={proc.returncode}\n{proc.stderr}"
    report: dict[str, Any] = json.loads(proc.stdout)
    return report


def test_a_skip_requested_with_shardcache_skip_is_applied_at_restore_and_reported_in_status(
    admin: kubernetes.client.ApiClient,
    namespace: str,
    operator: harness.InClusterOperator,
    node_store: s3server.S3Server,
    product_images: release.ProductImages,
    real_node: release.RealNode,
) -> None:
    core = kubernetes.client.CoreV1Api(admin)
    checkpoints = node_store.make_bucket("ckpt")
    uri = f"s3://{checkpoints}/run/"
    mount = preemption.resumable_mount(
        admin, operator, node_store, namespace, "skipping", checkpoint_uri=uri
    )
    order = reading_order(mount.status, mount.total_rows)
    name = preemption.start_job(
        admin, namespace, "skip", mount, product_images, real_node,
        TRAINER_BATCH_SIZE=BATCH_SIZE, TRAINER_CHECKPOINT_AT=CHECKPOINT_AT,
    )  # fmt: skip
    first_name, committed = preemption.wait_first_checkpoint(core, namespace, name)
    step = committed["step"]
    assert step == committed["position"] == CHECKPOINT_AT
    # The first pod read the plan's first `step` samples and holds there.
    assert jobs.expand(committed["runs"]) == sorted(order[:step])
    skipped = (step, step + SKIP_BATCHES * BATCH_SIZE)

    # Requested from this host, as a user would: the Job's only rank publishes under
    # <uri>/rank-0, and the command finds it from the URI in the DatasetMount.
    requested = request_skip(node_store, uri, step=step)
    assert [(r["rank"], r["skip"], r["set_aside"]) for r in requested["ranks"]] == [
        (0, {"epoch": 0, "start": skipped[0], "stop": skipped[1]}, [])
    ], requested
    log = preemption.preempt(admin, core, namespace, name, first_name)

    # Before the trainer started, the sidecar restored the step and applied the skip.
    start = jobs.event(log, "start")
    assert start["checkpoints"]["dirs"] == [f"step-{step}"], start
    restore = start["checkpoints"]["restore"]
    assert restore["phase"] == "restored" and restore["step"] == step, restore
    assert restore["skip"] == {
        "epoch": 0, "start": skipped[0], "stop": skipped[1], "batches": SKIP_BATCHES, "rank": 0,
    }, restore  # fmt: skip
    # The trainer changed nothing: `resume_from="latest"` loaded a state past the skip.
    resumed = jobs.event(log, "resumed")
    assert resumed["position"] == skipped[1], resumed
    assert resumed["runs"] == committed["runs"]
    before = jobs.expand(resumed["runs"])
    done = jobs.event(log, "done")
    after = jobs.expand(done["runs"])
    # No skipped sample was read; every other one exactly once across the two pods.
    never = set(order[skipped[0] : skipped[1]])
    assert not never & set(after) and not never & set(before)
    assert not set(before) & set(after)
    assert sorted(before + after + sorted(never)) == list(range(mount.total_rows))
    assert after == sorted(order[skipped[1] :])
    assert done["rows"] == mount.total_rows - skipped[1]
    assert jobs.Totals.reported(done) == jobs.Totals.of(after)

    # The operator found the sidecar's record of the applied skip in the store.
    def last_skip() -> dict[str, Any] | None:
        status = objects.get_datasetmount(admin, namespace, mount.name).get("status") or {}
        last = status.get("lastSkip")
        return last if isinstance(last, dict) and last.get("step") == step else None

    last = harness.wait_until(
        "status.lastSkip", last_skip, timeout=REPORT_TIMEOUT_S, interval=1, describe=operator.logs
    )
    assert (last["step"], last["batches"], last["reason"]) == (step, SKIP_BATCHES, REASON)
    assert last["ranges"] == [{"rank": 0, "epoch": 0, "start": skipped[0], "stop": skipped[1]}]
    assert last["requestedAt"] <= last["appliedAt"], last
    uid = objects.get_datasetmount(admin, namespace, mount.name)["metadata"]["uid"]

    events = harness.wait_until(
        f"a {skips.EVENT_REASON} Event",
        lambda: objects.events_with(admin, namespace, uid, skips.EVENT_REASON) or None,
        timeout=REPORT_TIMEOUT_S, interval=1, describe=operator.logs,
    )  # fmt: skip
    assert len(events) == 1, [e.message for e in events]
    assert str(events[0].message) == (
        f"checkpoint step {step} was restored with a skip of {SKIP_BATCHES} batches ({REASON}): "
        f"rank 0: epoch 0 positions [{skipped[0]}, {skipped[1]})"
    )
