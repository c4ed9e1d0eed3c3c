"""`shardcache skip` through the real API server: checkpoints of a two-rank job on the
real S3-compatible server, a skip requested with the command, the agents' restore
applies it, and the DatasetMount's status and an Event report it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import kubernetes.client
import pytest
from shardcache_sidecar.checkpoint import Agent, CheckpointSettings

from shardcache import checkpoint, plans, states
from tests.e2e import harness, objects
from tests.support.checkpoints import write_checkpoint

pytestmark = pytest.mark.e2e

WORLD, BATCH = 2, 8


def data_state(rank: int, position: int) -> dict[str, object]:
    params = plans.PlanParams(seed=1, rank=rank, world_size=WORLD, block_size=16)
    state = states.DataState("sha256:e2e", params, position=position, batch_size=BATCH)
    return state.to_json()


def agent(root: Path, uri: str, store: harness.ObjectStore) -> Agent:
    settings = CheckpointSettings(directory=root, uri=uri, keep_last=10)
    return Agent(settings, storage_options=harness.store_env(store))


def test_a_skip_requested_with_shardcache_skip_is_applied_at_restore_and_reported(
    admin: kubernetes.client.ApiClient,
    object_store: harness.ObjectStore,
    operator: harness.Operator,
    workload_namespace: str,
    s3_secret: str,
    tmp_path: Path,
) -> None:
    data = objects.write_shards(object_store, (40, 24))
    ckpt = f"s3://{object_store.make_bucket('e2e-ckpt')}/run"
    name = objects.unique("skip")
    objects.create_datasetmount(
        admin, workload_namespace, objects.datasetmount(name, data, checkpoint={"uri": ckpt})
    )
    objects.wait_phase(admin, workload_namespace, name, "Ready", operator)
    # Each rank's pod published checkpoints 2 and 4 under <uri>/rank-<r>.
    for rank in range(WORLD):
        root = tmp_path / f"pod-a-{rank}"
        publisher = agent(root, f"{ckpt}/rank-{rank}", object_store)
        publisher.restore()
        for step in (2, 4):
            path = write_checkpoint(root, f"step-{step}", {"model.bin": b"w%d" % step})
            checkpoint.commit(path, step=step, data_state=data_state(rank, step * BATCH))
            assert publisher.scan() == [step]
    proc = subprocess.run(
        [sys.executable, "-m", "shardcache", "skip", "--checkpoint-uri", ckpt, "--step", "2",
         "--batches", "1", "--reason", "spike at step 4", "--json"],
        env={**os.environ, **harness.store_env(object_store)}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert [r["set_aside"] for r in json.loads(proc.stdout)["ranks"]] == [[4], [4]]
    # The restarted pods: each sidecar's agent restores step 2 with the skip.
    for rank in range(WORLD):
        restored = agent(tmp_path / f"pod-b-{rank}", f"{ckpt}/rank-{rank}", object_store).restore()
        assert restored.step == 2
        assert restored.skip == {
            "epoch": 0, "start": 2 * BATCH, "stop": 3 * BATCH, "batches": 1, "rank": rank,
        }  # fmt: skip
        state = checkpoint.data_state("latest", root=tmp_path / f"pod-b-{rank}")
        assert state is not None and states.parse(state).position == 3 * BATCH

    def reported() -> dict[str, object] | None:
        status = objects.get_datasetmount(admin, workload_namespace, name).get("status") or {}
        last = status.get("lastSkip")
        return last if isinstance(last, dict) and len(last.get("ranges", [])) == WORLD else None

    last = harness.wait_until(
        "status.lastSkip with both ranks", reported, timeout=60, describe=operator.logs
    )
    assert (last["step"], last["batches"], last["reason"]) == (2, 1, "spike at step 4")
    assert last["ranges"] == [
        {"rank": r, "epoch": 0, "start": 2 * BATCH, "stop": 3 * BATCH} for r in range(WORLD)
    ]
    uid = objects.get_datasetmount(admin, workload_namespace, name)["metadata"]["uid"]
    events = objects.events_with(admin, workload_namespace, uid, "SkipApplied")
    assert len(events) == 1
    assert "checkpoint step 2 was restored with a skip of 1 batches (spike at step 4)" in str(
        events[0].message
    )
