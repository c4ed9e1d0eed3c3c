"""status.lastSkip and the SkipApplied Event from the agents' applied-skip records."""

from __future__ import annotations

from pathlib import Path

import pyarrow.fs as pafs
import pytest
from shardcache_operator import skips

from shardcache.checkpoint import layout

pytestmark = pytest.mark.unit


def record(
    rank: int | None,
    *,
    step: int = 200,
    requested: float = 1764100000.0,
    applied: float = 1764100100.0,
) -> dict[str, object]:
    return {
        "version": 1, "step": step, "batches": 40, "requested_at": requested,
        "applied_at": applied, "reason": "loss spike", "epoch": 0,
        "start": 6400 + (rank or 0), "stop": 7680 + (rank or 0), "rank": rank,
    }  # fmt: skip


def publish(store: Path, rank_dir: str, step: int, applied: dict[str, object] | None) -> None:
    fs = pafs.LocalFileSystem()
    prefix = str(store / rank_dir)
    manifest = layout.CheckpointManifest(step, f"step-{step}", (), None, 1.0)
    layout.write_json(fs, layout.manifest_path(prefix, step), manifest.to_json())
    if applied is not None:
        layout.write_json(fs, layout.skip_applied_path(prefix, step), applied)


def test_applied_skips_are_read_from_every_ranks_prefix(tmp_path: Path) -> None:
    publish(tmp_path, "rank-0", 100, None)
    publish(tmp_path, "rank-0", 200, record(0))
    publish(tmp_path, "rank-1", 200, record(1))
    found = skips.read_applied(tmp_path.as_uri(), None)
    assert sorted((r["rank"], r["step"]) for r in found) == [(0, 200), (1, 200)]
    assert skips.read_applied((tmp_path / "nothing").as_uri(), None) == []


def test_the_first_time_a_skip_is_seen_applied_there_is_an_event() -> None:
    patch, events = skips.report({}, [record(0), record(1)])
    last = patch["lastSkip"]
    assert (last["step"], last["batches"], last["reason"]) == (200, 40, "loss spike")
    assert last["requestedAt"] == "2025-11-25T19:46:40Z"
    assert [r["rank"] for r in last["ranges"]] == [0, 1]
    assert events == [
        (
            "SkipApplied",
            "checkpoint step 200 was restored with a skip of 40 batches (loss spike): "
            "rank 0: epoch 0 positions [6400, 7680); rank 1: epoch 0 positions [6401, 7681)",
        )
    ]


def test_the_same_request_applied_again_updates_the_status_quietly() -> None:
    first, _ = skips.report({}, [record(0)])
    again, events = skips.report(first, [record(0, applied=1764100500.0), record(1)])
    assert again["lastSkip"]["appliedAt"] == "2025-11-25T19:55:00Z" and events == []
    assert skips.report(again, [record(0, applied=1764100500.0), record(1)]) == ({}, [])


def test_a_newer_request_replaces_the_last_one_with_a_new_event() -> None:
    first, _ = skips.report({}, [record(0)])
    newer = record(0, step=300, requested=1764200000.0, applied=1764200050.0)
    patch, events = skips.report(first, [record(0), newer])
    assert patch["lastSkip"]["step"] == 300 and len(events) == 1


def test_no_record_reports_nothing() -> None:
    assert skips.report({"lastSkip": {"step": 1}}, []) == ({}, [])
