"""The loss-spike recipe end to end, with real checkpoint agents on a file:// store:
train two ranks with checkpoints, `shardcache skip` back to an earlier step, restore
(the agent applies the skip), train on; then `shardcache lineage` and `shardcache diff`
as real commands agree with what the ranks actually read."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest

from shardcache import states
from shardcache.checkpoint import _protocol, layout
from tests.support import checkpoints, datasets

pytestmark = pytest.mark.integration

SHARDS = [50, 30, 0, 44]
WORLD, BATCH, SEED, BLOCK = 2, 5, 4, 8
#: (rank, epoch, step in epoch, slot) -> (uid, training step) of every read.
Reads = dict[tuple[int, int], tuple[int, int, int, int]]


def shardcache_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardcache", *args], capture_output=True, text=True, timeout=120
    )


class Pod(checkpoints.TrainerPod):
    """A pod whose trainer reads one batch of `BATCH` rows a step, into the next epoch
    at an epoch's end."""

    def __init__(self, tmp: Path, name: str, rank: int, store: str) -> None:
        super().__init__(tmp, name, rank, WORLD, store, seed=SEED, block_size=BLOCK)
        self.epoch_steps = 0

    def read(self, step: int, reads: dict[tuple[int, int], tuple[int, int, int, int]]) -> None:
        batch = next(iter(self.ds.batches(BATCH)), None)
        if batch is None:
            self.ds.set_epoch(self.ds.epoch + 1)
            self.epoch_steps = 0
            batch = next(iter(self.ds.batches(BATCH)))
        for slot, uid in enumerate(batch.column("uid").to_pylist()):
            reads[(uid, self.ds.epoch)] = (self.rank, self.epoch_steps, slot, step)
        self.epoch_steps += 1


def train(pods: list[Pod], steps: range, reads: Any) -> None:
    for step in steps:
        for pod in pods:
            pod.read(step, reads)
        if step % 4 == 0:
            for pod in pods:
                pod.commit(step)


def test_skip_rewinds_restores_with_the_skip_and_lineage_and_diff_see_it(tmp_path: Path) -> None:
    datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / "ds"), SHARDS)
    store = (tmp_path / "store").as_uri()
    reads: dict[tuple[int, int], tuple[int, int, int, int]] = {}
    first = [Pod(tmp_path, "first", r, store) for r in range(WORLD)]
    train(first, range(1, 13), reads)
    for pod in first:
        pod.close()
    # A spike at step 12: back to checkpoint 8, skip 3 batches.
    proc = shardcache_cli("skip", "--checkpoint-uri", store, "--step", "8", "--batches", "3")
    assert proc.returncode == 0, proc.stderr
    assert "set aside later checkpoints [12]" in proc.stdout
    fs = pafs.LocalFileSystem()
    rank0 = str(tmp_path / "store" / "rank-0")
    assert layout.list_steps(fs, rank0)[0] == [4, 8]
    assert layout.read_skip_request(fs, rank0, 8) == layout.SkipRequest(
        step=8,
        batches=3,
        requested_at=layout.read_skip_request(fs, rank0, 8).requested_at,  # type: ignore[union-attr]
    )
    reads = {k: v for k, v in reads.items() if v[3] <= 8}

    second = [Pod(tmp_path, "second", r, store) for r in range(WORLD)]
    for pod in second:
        assert pod.restored.step == 8
        assert pod.restored.skip is not None and pod.restored.skip["batches"] == 3
        restore_file = _protocol.read_root_file(pod.root, _protocol.RESTORE_NAME)
        assert restore_file is not None and restore_file["skip"] == pod.restored.skip
        assert "with a skip of 3 batches" in pod.agent.readiness()[1]
        # The trainer's restored state already carries the skip.
        skip = states.Skip(0, 8 * BATCH, 11 * BATCH)
        assert pod.ds.skips == (skip,) and pod.ds.position == 11 * BATCH
        pod.epoch_steps = 8
    train(second, range(9, 21), reads)
    for pod in second:
        pod.close()

    # lineage --where: every sample, as the ranks read it.
    proc = shardcache_cli(
        "lineage", str(tmp_path / "ds"), "--cache-dir", str(tmp_path / "cache"),
        "--checkpoint-uri", store, "--where", "uid >= 0", "--limit", "1000", "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert [c["step"] for c in data["run"]["checkpoints"]] == [4, 8, 12, 16, 20]
    found = {(r["index"], r["epoch"]): r for r in data["reads"]}
    for (uid, epoch), (rank, step, slot, at) in reads.items():
        r = found[(uid, epoch)]
        before = -(-at // 4) * 4
        assert (r["status"], r["rank"], r["step"], r["slot"], r["before"]) == (
            "read",
            rank,
            step,
            slot,
            before,
        ), (uid, epoch)
        assert r["checkpoints"] == list(range(before, 21, 4))
    skipped = [k for k, r in found.items() if r["status"] == "skipped"]
    assert len(skipped) == WORLD * 3 * BATCH and not set(skipped) & set(reads)

    # lineage --consumed: checkpoint 12 of the rewound run read steps 9-12.
    proc = shardcache_cli(
        "lineage", str(tmp_path / "ds"), "--cache-dir", str(tmp_path / "cache"),
        "--checkpoint-uri", store, "--consumed", "12", "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    for rank_report in report["ranks"]:
        got = sorted(
            i for e in rank_report["epochs"] for lo, hi in e["ranges"] for i in range(lo, hi)
        )
        want = sorted(
            u for (u, _), v in reads.items() if v[0] == rank_report["rank"] and 8 < v[3] <= 12
        )
        assert got == want

    # diff: the same plan without the skip first differs at the skip.
    plan = ["--seed", str(SEED), "--world-size", str(WORLD), "--batch-size", str(BATCH),
            "--block-size", str(BLOCK)]  # fmt: skip
    proc = shardcache_cli(
        "diff", str(tmp_path / "ds"), *plan, "--a-checkpoint-uri", store, "--json"
    )
    assert proc.returncode == 1, proc.stderr
    diff = json.loads(proc.stdout)
    assert (diff["epoch"], diff["step"], diff["rank"]) == (0, 8, 0)
    assert any(r.startswith("a skip: rank 0 in epoch 0") for r in diff["reasons"])
    proc = shardcache_cli("diff", str(tmp_path / "ds"), *plan)
    assert (proc.returncode, proc.stdout) == (0, "")
