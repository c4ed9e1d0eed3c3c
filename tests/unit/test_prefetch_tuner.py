"""The sidecar's prefetch tuner against a real cache node on local files: what it
decides reaches the node's scheduler, is logged once and counted; tuning off, depth 0
and a short memory tier change nothing."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from shardcache_sidecar import configuration, prefetch_depths, prefetch_tuner, readers

from shardcache import manifests, plans
from shardcache.contract import protocol
from shardcache.node import caches
from tests.support import datasets, waiting

SHARDS = [50] * 12
SHARD_BYTES = 10_000
STALLED = protocol.Stalls(wait_seconds=9.0, step_seconds=1.0, batches=40, recent_fraction=0.9)


@dataclasses.dataclass
class Counted:
    changes: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    def depth_changed(self, direction: str, reason: str) -> None:
        self.changes.append((direction, reason))


@pytest.fixture
def node(tmp_path: Path) -> Iterator[caches.CacheNode]:
    datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / "ds"), SHARDS)
    settings = caches.NodeSettings(
        disk_dir=tmp_path / "disk", memory_dir=tmp_path / "mem", prefetch_depth=1
    )
    made = caches.CacheNode(manifests.resolve(f"file://{tmp_path / 'ds'}"), settings)
    yield made
    made.close()


def registered(node: caches.CacheNode, *ids: str) -> list[readers.Reader]:
    registry: readers.Registry[object] = readers.Registry(clock=time.monotonic)
    params = plans.PlanParams(shuffle=False)
    for reader_id in ids:
        registry.register(reader_id, params, 0)
        node.register_reader(reader_id, params)
    return registry.readers()


def tuner(counted: Counted, *, memory_limit: int = 1 << 30) -> prefetch_tuner.Tuner:
    made = prefetch_tuner.Tuner(
        prefetch_depths.Policy(floor=1, ceiling=4),
        memory_limit=memory_limit,
        reserved_shards=2,
        changes=counted,
    )
    made.sized(SHARD_BYTES)
    return made


def report_stalled(
    tuning: prefetch_tuner.Tuner, node: caches.CacheNode, all_readers: list[readers.Reader]
) -> prefetch_depths.Decision | None:
    tuning.missed(all_readers[0].reader_id, 0.3)
    return tuning.reported(all_readers[0], STALLED, node=node, registered=all_readers)


def test_a_stalled_reader_that_waited_on_shards_is_read_further_ahead_logged_once(
    node: caches.CacheNode, caplog: pytest.LogCaptureFixture
) -> None:
    counted = Counted()
    tuning = tuner(counted)
    all_readers = registered(node, "r")
    caplog.set_level(logging.INFO, logger=prefetch_tuner.__name__)
    first = report_stalled(tuning, node, all_readers)
    assert first is not None and first.reason is None  # patience: one report is not enough
    second = report_stalled(tuning, node, all_readers)
    assert second is not None and second.reason is prefetch_depths.Reason.STALLED
    assert node.prefetch_depth("r") == 2
    assert counted.changes == [("up", "stalled")]
    (record,) = [r for r in caplog.records if getattr(r, "event", None) == "prefetch_depth"]
    assert (record.reader, record.old, record.new, record.reason) == ("r", 1, 2, "stalled")  # type: ignore[attr-defined]
    # The scheduler follows: the reader's current shard and two ahead become resident.
    wanted = node.upcoming("r", 3)
    waiting.wait_until(
        "the deeper read-ahead to be resident",
        lambda: all(node.lookup(s, count=False) for s in wanted),
    )


def test_a_reader_without_waiting_acquires_keeps_its_depth(node: caches.CacheNode) -> None:
    counted = Counted()
    tuning = tuner(counted)
    all_readers = registered(node, "r")
    for _ in range(5):
        tuning.reported(all_readers[0], STALLED, node=node, registered=all_readers)
    assert node.prefetch_depth("r") == 1 and counted.changes == []


def test_a_memory_tier_full_of_other_readers_windows_holds_the_depth(
    node: caches.CacheNode,
) -> None:
    counted = Counted()
    # Two readers at depth 1 keep 2 shards each, plus 2 reserved: 6 shards, all of it.
    tuning = tuner(counted, memory_limit=6 * SHARD_BYTES)
    all_readers = registered(node, "r", "other")
    for _ in range(5):
        report_stalled(tuning, node, all_readers)
    assert node.prefetch_depth("r") == 1 and counted.changes == []


def test_a_tuned_depth_outlives_an_epoch_and_unknown_readers_are_ignored(
    node: caches.CacheNode,
) -> None:
    registered(node, "r")
    node.set_prefetch_depth("r", 3)
    node.update_reader("r", epoch=1, position=0)
    assert node.prefetch_depth("r") == 3
    node.set_prefetch_depth("gone", 7)
    assert node.prefetch_depth("gone") == node.settings.prefetch_depth


def settings_with(**fields: object) -> configuration.Settings:
    return configuration.Settings(
        source_uri="file:///data",
        socket_path=Path("/tmp/s.sock"),
        memory_dir=Path("/tmp/mem"),
        disk_dir=Path("/tmp/disk"),
        **fields,  # type: ignore[arg-type]
    )


def test_tuning_is_off_when_adaptive_is_false_or_read_ahead_is_disabled() -> None:
    assert prefetch_tuner.policy_for(settings_with(prefetch_adaptive=False)) is None
    assert prefetch_tuner.policy_for(settings_with(prefetch_depth=0)) is None
    policy = prefetch_tuner.policy_for(settings_with(prefetch_depth=3, prefetch_max_depth=9))
    assert policy is not None and (policy.floor, policy.ceiling) == (3, 9)


def test_an_unregistered_reader_leaves_no_waits_behind(node: caches.CacheNode) -> None:
    tuning = tuner(Counted())
    all_readers = registered(node, "r")
    tuning.missed("r", 0.3)
    tuning.forget("r")
    decision = tuning.reported(all_readers[0], STALLED, node=node, registered=all_readers)
    # Its waits were dropped with it: this report is a stall without waits, no streak.
    assert decision is not None and decision.state == prefetch_depths.State(depth=1)
    tuning.missed("r", 0.3)
    decision = tuning.reported(all_readers[0], STALLED, node=node, registered=all_readers)
    assert decision is not None and decision.state.stalled == 1
