"""The data-stall signal from a trainer through a real sidecar to its /metrics."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow.fs as pafs
import pytest

import shardcache
from shardcache import plans, sidecar_client
from tests.support import datasets, waiting
from tests.support.sidecar import SidecarProcess
from tests.support.stalls import SlowShards

pytestmark = pytest.mark.integration

SHARDS = [120, 90, 150]


def sample(text: str, pattern: str) -> float | None:
    match = re.search(rf"^{pattern} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else None


def test_a_loop_waiting_on_slow_storage_shows_in_the_sidecars_metrics_and_recovers(
    sidecar_factory: Callable[..., SidecarProcess], tmp_path: Path
) -> None:
    root = tmp_path / "ds"
    datasets.write_dataset(pafs.LocalFileSystem(), str(root), SHARDS)
    proc = sidecar_factory(f"file://{root}")
    proc.start(wait="ready")
    shards = SlowShards(sidecar_client.SidecarProvider.from_env(environ=proc.client_env()))
    ds = shardcache.Dataset(shards, plans.PlanParams())
    fraction = r'shardcache_reader_stall_fraction\{rank="0",reader="[0-9a-f]+"\}'
    try:
        # Every batch (more rows than a shard) waits 50 ms for storage; the loop does
        # nothing else. Epochs go on until the sidecar has a report (one a second).
        # The recent fraction starts at 0 and moves a twentieth of the way per batch.
        def stalled() -> bool:
            for _ in ds.batches(200):
                pass
            ds.set_epoch(ds.epoch + 1)
            shards.inner.flush()
            high = sample(proc.http_get("/metrics")[1], fraction)
            return high is not None and high > 0.9

        # No pause between checks: the meter times the loop across epochs, so a pause
        # would count as stepping; each check is an epoch of the loop itself.
        waiting.wait_until("the stall fraction in /metrics to rise above 0.9", stalled, interval=0)
        text = proc.http_get("/metrics")[1]
        waited = sample(text, r'shardcache_data_wait_seconds_total\{rank="0"\}')
        stepped = sample(text, r'shardcache_data_step_seconds_total\{rank="0"\}')
        assert waited is not None and stepped is not None and waited > 10 * stepped

        # Storage keeps up and the loop computes between batches: the fraction falls.
        shards.slow.clear()

        def recovered() -> bool:
            for _ in ds.batches(200):
                time.sleep(0.02)  # the step: compute, not a wait for anything
            ds.set_epoch(ds.epoch + 1)
            shards.inner.flush()
            low = sample(proc.http_get("/metrics")[1], fraction)
            return low is not None and low < 0.5

        waiting.wait_until(
            "the stall fraction to fall below 0.5",
            recovered,
            interval=0,
            describe=lambda: "\n".join(
                line
                for line in proc.http_get("/metrics")[1].splitlines()
                if "stall_fraction" in line or "data_wait" in line or "data_step" in line
            ),
        )
    finally:
        ds.close()
    # A closed reader leaves the scrape.
    assert sample(proc.http_get("/metrics")[1], fraction) is None


def test_the_sidecars_counters_reach_each_readers_final_totals_when_it_closes(
    sidecar_factory: Callable[..., SidecarProcess], tmp_path: Path
) -> None:
    """Totals ride on notes at most once a second, so the last second of every reader,
    and all of one that read for less, never reached the counters: the reader was
    forgotten before its queued notes were sent (2.75 s of steps exported as 2.00,
    0.40 s as nothing)."""
    root = tmp_path / "ds"
    datasets.write_dataset(pafs.LocalFileSystem(), str(root), SHARDS)
    proc = sidecar_factory(f"file://{root}")
    proc.start(wait="ready")
    env = proc.client_env()
    own: dict[str, float] = {}
    # Rank 0 reads 1.5 s, past its first report; rank 1 under a second, one report.
    for rank, steps in ((0, 5), (1, 2)):
        shards = sidecar_client.SidecarProvider.from_env(environ=env)
        with shardcache.Dataset(shards, plans.PlanParams(rank=rank, world_size=2)) as ds:
            batches = ds.batches(20)
            for _ in range(steps + 1):
                next(batches)
                time.sleep(0.3)
            batches.close()
            own[f"step{rank}"] = ds.stalls.step_seconds
            own[f"wait{rank}"] = ds.stalls.wait_seconds
    text = proc.http_get("/metrics")[1]
    for rank in (0, 1):
        for kind in ("step", "wait"):
            exported = sample(text, rf'shardcache_data_{kind}_seconds_total\{{rank="{rank}"\}}')
            assert exported == pytest.approx(own[f"{kind}{rank}"], abs=1e-6), (
                f"rank {rank}'s {kind} seconds: {exported} exported, "
                f"{own[f'{kind}{rank}']} measured"
            )


def test_a_reader_registered_again_adds_only_what_grew_since_to_the_counters(
    sidecar_factory: Callable[..., SidecarProcess], tmp_path: Path
) -> None:
    """An elastic resume registers the Dataset's reader anew for its new plan, with the
    same stall meter: its first report counted the meter's whole past a second time."""
    root = tmp_path / "ds"
    datasets.write_dataset(pafs.LocalFileSystem(), str(root), SHARDS)
    proc = sidecar_factory(f"file://{root}")
    proc.start(wait="ready")
    env = proc.client_env()
    old = [
        shardcache.Dataset(
            sidecar_client.SidecarProvider.from_env(environ=env),
            plans.PlanParams(rank=r, world_size=2),
        )
        for r in (0, 1)
    ]
    states = []
    for ds in old:
        next(ds.batches(20))
        states.append(ds.state_dict())
        ds.close()
    shards = sidecar_client.SidecarProvider.from_env(environ=env)
    with shardcache.Dataset(shards, plans.PlanParams(rank=0, world_size=1)) as ds:
        batches = ds.batches(20)
        for _ in range(4):
            next(batches)
            time.sleep(0.3)
        batches.close()
        ds.load_state_dict(states)  # two old ranks' states: segments, a new reader
        batches = ds.batches(20)
        for _ in range(4):
            next(batches)
            time.sleep(0.3)
        batches.close()
        step, wait = ds.stalls.step_seconds, ds.stalls.wait_seconds
    text = proc.http_get("/metrics")[1]
    # Rank 0 of the old run read one batch; the counters are per rank.
    old_step = sample(text, r'shardcache_data_step_seconds_total\{rank="1"\}') or 0.0
    exported = sample(text, r'shardcache_data_step_seconds_total\{rank="0"\}')
    assert exported is not None and old_step < 0.1
    assert exported == pytest.approx(step, abs=0.1), f"{exported} exported, {step} measured"
    exported_wait = sample(text, r'shardcache_data_wait_seconds_total\{rank="0"\}')
    assert exported_wait is not None and exported_wait <= wait + 0.1
