"""`shardcache skip` as a real command on a file:// store: what it refuses, what a dry
run leaves alone, and what it writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from shardcache import plans, states
from shardcache.checkpoint import layout

pytestmark = pytest.mark.integration


def skip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardcache", "skip", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def publish(prefix: str, step: int, *, batch_size: int | None = 4) -> None:
    params = plans.PlanParams(rank=0, world_size=1)
    state = states.DataState("sha256:d", params, position=step * 4, batch_size=batch_size)
    manifest = layout.CheckpointManifest(step, f"step-{step}", (), state.to_json(), 1.0)
    layout.write_json(
        pafs.LocalFileSystem(), layout.manifest_path(prefix, step), manifest.to_json()
    )


@pytest.fixture
def store(tmp_path: Path) -> Path:
    for step in (10, 20, 30):
        publish(str(tmp_path / "run"), step)
    return tmp_path / "run"


def test_a_step_that_is_not_published_is_refused_naming_the_published_ones(store: Path) -> None:
    proc = skip("--checkpoint-uri", store.as_uri(), "--step", "15", "--batches", "2")
    assert proc.returncode == 2
    assert "checkpoint step 15 is not published (published steps: [10, 20, 30])" in proc.stderr


def test_keep_later_refuses_when_newer_checkpoints_would_be_restored(store: Path) -> None:
    proc = skip(
        "--checkpoint-uri", store.as_uri(), "--step", "20", "--batches", "2", "--keep-later"
    )
    assert proc.returncode == 2 and "checkpoints [30] are newer than step 20" in proc.stderr


def test_a_dry_run_writes_nothing(store: Path) -> None:
    proc = skip("--checkpoint-uri", store.as_uri(), "--step", "20", "--batches", "2", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("checkpoint 20 would be restored skipping the next 2 batches")
    fs = pafs.LocalFileSystem()
    assert layout.list_steps(fs, str(store))[0] == [10, 20, 30]
    assert layout.read_skip_request(fs, str(store), 20) is None


def test_the_request_is_written_and_later_checkpoints_set_aside_with_their_manifests(
    store: Path,
) -> None:
    proc = skip("--checkpoint-uri", store.as_uri(), "--step", "10", "--batches", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["ranks"] == [
        {
            "rank": None,
            "prefix": str(store),
            "skip": {"epoch": 0, "start": 40, "stop": 52},
            "set_aside": [20, 30],
        }
    ]
    fs = pafs.LocalFileSystem()
    assert layout.list_steps(fs, str(store)) == ([10], [20, 30])
    kept = layout.read_json(fs, layout.discarded_path(str(store), 30))
    assert isinstance(kept, dict) and kept["step"] == 30
    request = layout.read_skip_request(fs, str(store), 10)
    assert request is not None and (request.step, request.batches) == (10, 3)
    assert layout.parse_pointer(layout.read_json(fs, layout.pointer_path(str(store)))) == 10


def test_a_state_without_a_batch_size_needs_one(tmp_path: Path) -> None:
    publish(str(tmp_path / "old"), 10, batch_size=None)
    uri = (tmp_path / "old").as_uri()
    proc = skip("--checkpoint-uri", uri, "--step", "10", "--batches", "1")
    assert proc.returncode == 2 and "shardcache skip --batch-size" in proc.stderr
    proc = skip("--checkpoint-uri", uri, "--step", "10", "--batches", "1", "--batch-size", "8")
    assert proc.returncode == 0, proc.stderr
    assert "epoch 0 positions [40, 48) skipped" in proc.stdout
