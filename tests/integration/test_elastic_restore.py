"""Pods restarted at another world size resume with `resume_from="latest"`: real
checkpoint agents on a file:// store, each rank under its `rank-<r>` prefix. At start
each agent gathers every old rank's data state at the newest complete step; a rank new
to the job restores that step from rank 0's prefix. Checked row by row (`uid` is the
global sample index): every row no old rank consumed in the epoch is read exactly once,
and none they consumed."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest

from shardcache.checkpoint import _protocol, layout
from tests.support import checkpoints, datasets

pytestmark = pytest.mark.integration

SHARDS = [50, 30, 0, 44, 61]
TOTAL = sum(SHARDS)
BATCH, SEED, BLOCK = 5, 4, 8


class Pod(checkpoints.TrainerPod):
    """A pod whose trainer reads batches of `BATCH` rows through one epoch."""

    def __init__(self, tmp: Path, generation: str, rank: int, world: int, store: str) -> None:
        super().__init__(tmp, generation, rank, world, store, seed=SEED, block_size=BLOCK)
        self.it = iter(self.ds.batches(BATCH))

    def read(self, batches: int) -> list[int]:
        out: list[int] = []
        for _ in range(batches):
            batch = next(self.it, None)
            if batch is None:
                break
            out += [int(u) for u in batch.column("uid").to_pylist()]
        return out


def run_generation(
    tmp: Path, name: str, world: int, store: str, batches: list[int], step: int
) -> tuple[list[int], list[Pod]]:
    """`world` pods start (restoring latest), rank r reads batches[r] batches, all
    commit `step` and stop. Returns the rows read and the pods."""
    pods = [Pod(tmp, name, r, world, store) for r in range(world)]
    rows: list[int] = []
    for pod, n in zip(pods, batches, strict=True):
        rows += pod.read(n)
    for pod in pods:
        pod.commit(step)
        pod.close()
    return rows, pods


@pytest.mark.parametrize(("old", "new", "skip"), [(4, 3, False), (2, 5, False), (3, 2, True)])
def test_pods_restarted_at_another_world_size_resume_every_unconsumed_row_once(
    tmp_path: Path, old: int, new: int, skip: bool
) -> None:
    datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / "ds"), SHARDS)
    store = (tmp_path / "store").as_uri()
    first, _ = run_generation(tmp_path, "a", old, store, [1, 3, 2, 4, 0][:old], 10)
    second, pods = run_generation(tmp_path, "b", old, store, [2, 0, 1, 1, 3][:old], 20)
    consumed = first + second
    if skip:
        # `shardcache skip` asked rank 1 to skip 2 batches at restore of step 20: those
        # rows count as consumed, at the new world size too.
        fs, root = pafs.FileSystem.from_uri(store)
        request = layout.SkipRequest(step=20, batches=2)
        layout.write_json(fs, layout.skip_request_path(f"{root}/rank-1", 20), request.to_json())
        pos = pods[1].ds.position
        runs = pods[1].ds.runs()
        offsets = [sum(SHARDS[:i]) for i in range(len(SHARDS))]
        rows = [offsets[r.shard] + i for r in runs for i in range(r.start, r.stop)]
        consumed += rows[pos : pos + 2 * BATCH]
    # The restart at the new world size: every pod gathered all old ranks' states.
    pods = [Pod(tmp_path, "c", r, new, store) for r in range(new)]
    for r, pod in enumerate(pods):
        assert pod.restored.step == 20, f"rank {r} restored {pod.restored.step}"
        assert isinstance(pod.state, list) and len(pod.state) == old
        assert (pod.root / _protocol.DATA_STATES_NAME).exists()
    rest = [row for pod in pods for row in pod.read(10_000)]
    for pod in pods:
        pod.close()
    assert len(consumed) == len(set(consumed))
    assert not set(rest) & set(consumed)
    assert Counter(rest) == Counter(set(range(TOTAL)) - set(consumed))


def test_a_restart_at_the_same_world_size_resumes_each_rank_as_before(tmp_path: Path) -> None:
    datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / "ds"), SHARDS)
    store = (tmp_path / "store").as_uri()
    _, before = run_generation(tmp_path, "a", 3, store, [2, 1, 3], 10)
    saved = [p.ds.state_dict() for p in before]
    pods = [Pod(tmp_path, "b", r, 3, store) for r in range(3)]
    assert [p.ds.state_dict() for p in pods] == saved
    for pod in pods:
        pod.close()


def test_lineage_reads_the_run_across_the_restart_from_the_store(tmp_path: Path) -> None:
    datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / "ds"), SHARDS)
    store = (tmp_path / "store").as_uri()
    before, _ = run_generation(tmp_path, "a", 4, store, [1, 3, 2, 4], 10)
    after, _ = run_generation(tmp_path, "b", 3, store, [2, 0, 5], 20)

    def lineage(*args: str) -> dict[str, Any]:
        proc = subprocess.run(
            [sys.executable, "-m", "shardcache", "lineage", str(tmp_path / "ds"),
             "--cache-dir", str(tmp_path / "cache"), "--checkpoint-uri", store, "--json", *args],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        data: dict[str, Any] = json.loads(proc.stdout)
        return data

    for step, world, rows in ((10, 4, before), (20, 3, after)):
        report = lineage("--consumed", str(step))
        got = [
            i
            for r in report["ranks"]
            for e in r["epochs"]
            for lo, hi in e["ranges"]
            for i in range(lo, hi)
        ]
        assert sorted(got) == sorted(rows), f"step {step}"
        assert {r["world_size"] for r in report["ranks"]} == {world}
    report = lineage("--where", f"uid == {after[0]}")
    (read,) = report["reads"]
    assert (read["status"], read["generation"], read["world_size"], read["before"]) == (
        "read", 1, 3, 20,
    )  # fmt: skip
    assert [g["world_size"] for g in report["run"]["generations"]] == [4, 3]
