"""`bench.node_timeline` reads the sidecar's shard timeline lines and says where the fetch
slots sat idle (issue 14's cold epoch)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from shardcache_sidecar import logs

from bench import node_timeline
from shardcache.node import timelines


def shard(n: int, slot: float, inserted: float) -> node_timeline.Shard:
    times = {"t_queued": 0.0, "t_slot": slot, "t_decoded": inserted, "t_inserted": inserted}
    return node_timeline.Shard(n, "fill", f"shardcache-fetch-{n}", "inserted", times)


def test_busy_time_is_clipped_to_the_window_and_the_peak_is_found() -> None:
    intervals = [(0.0, 2.0), (1.0, 3.0), (1.5, 1.8)]
    assert node_timeline.busy_between(intervals, 1.0, 2.0) == pytest.approx(1.0 + 1.0 + 0.3)
    assert node_timeline.first_peak(intervals) == (1.5, 3)


def test_the_report_puts_idle_slots_in_the_start_the_middle_and_the_tail() -> None:
    # Two slots over 4 s: one busy from 1 s, both from 2 s, the last shard takes its
    # slot at 2 s and ends at 3 s, the epoch at 4 s.
    shards = [shard(0, 1.0, 3.0), shard(1, 2.0, 3.0)]
    text = node_timeline.report(shards, 2, 0.0, 4.0, go=0.2)
    assert "mean busy slots 0.75 of 2" in text
    assert "start (until 2 slots are first busy, the peak): 2.00 s, 3.00 idle slot-s" in text
    assert "tail (after the last shard took a slot): 2.00 s, 2.00 idle slot-s" in text
    assert "first slot taken 1.000 s after the start" in text


def test_the_sidecars_own_json_lines_are_read_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    formatter = logs.JsonFormatter()
    with caplog.at_level(logging.DEBUG, logger=timelines.log.name):
        stamps = timelines.start(7, "readahead", queued=1.0)
        for stage in timelines.STAGES[1:]:
            stamps.mark(stage)
        stamps.done("inserted")
    serving = {"ts": "2026-11-26T14:00:00.250Z", "msg": "serving", "fetch_concurrency": 16}
    lines = [json.dumps(serving), *(formatter.format(r) for r in caplog.records)]
    log = tmp_path / "sidecar.log"
    log.write_text("\n".join(["not json", *lines]) + "\n")
    found = node_timeline.read(log)
    assert found.slots == 16
    assert found.serving == pytest.approx(1795701600.25)
    (only,) = found.shards
    assert (only.shard, only.why, only.outcome) == (7, "readahead", "inserted")
    assert only.times["t_queued"] == 1.0
    assert only.busy is not None and only.busy[1] >= only.busy[0]
