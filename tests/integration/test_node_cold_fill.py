"""A registered reader's epoch is filled beyond its depth, in plan order and round robin
with the other readers', as far as the memory tier has room beside a wave of readahead,
never by evicting, and never with shards of ranks that did not register; what the
readers then read is exactly the dataset (issue 14's cold fill)."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.ipc as ipc
import pytest

from shardcache import errors, manifests, plans
from shardcache.node import _locks, caches, timelines
from tests.support import datasets

pytestmark = pytest.mark.integration

SHARDS = [300] * 8


def make_node(
    tmp_path: Path,
    manifest: manifests.Manifest,
    *,
    memory_limit: int,
    concurrency: int,
    sole_writer: bool = False,
) -> caches.CacheNode:
    settings = caches.NodeSettings(
        memory_sole_writer=sole_writer,
        disk_dir=tmp_path / "disk",
        memory_dir=tmp_path / "mem",
        memory_limit=memory_limit,
        # Readahead of the shard each reader is at and the next: what is fetched beyond
        # them is the fill's.
        prefetch_depth=1,
        fetch_concurrency=concurrency,
    )
    return caches.CacheNode(manifest, settings)


def settle(node: caches.CacheNode, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while node.prefetching():
        assert time.monotonic() < deadline, "the prefetcher never went idle"
        time.sleep(0.02)


def read_all(node: caches.CacheNode) -> pa.Table:
    batches = []
    for shard in range(len(node.manifest.shards)):
        with node.acquire(shard, timeout=60) as entry:
            batches.append(ipc.open_file(pa.memory_map(str(entry.path))).get_batch(0))
    return pa.Table.from_batches(batches)


def resident(node: caches.CacheNode) -> list[int]:
    keys = set(node.memory.keys())
    return [i for i in range(len(node.manifest.shards)) if node.manifest.decoded_key(i) in keys]


@pytest.fixture
def dataset(tmp_path: Path) -> tuple[manifests.Manifest, pa.Table, int]:
    """The manifest, the table, and the largest shard's decoded size."""
    expected = datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / "ds"), SHARDS)
    manifest = manifests.resolve(f"file://{tmp_path / 'ds'}")
    probe = make_node(tmp_path / "probe", manifest, memory_limit=1 << 30, concurrency=2)
    try:
        sizes = []
        for shard in range(len(SHARDS)):
            with probe.acquire(shard, timeout=60) as entry:
                sizes.append(entry.size)
    finally:
        probe.close()
    return manifest, expected, max(sizes)


def plan_of(manifest: manifests.Manifest, params: plans.PlanParams) -> list[int]:
    runs = plans.rank_runs(manifest.shard_rows, manifest.digest, params)
    return plans.upcoming_shards(runs, 0)


def test_a_registered_reader_has_its_whole_epoch_filled_and_no_other_ranks_shards(
    tmp_path: Path, dataset: tuple[manifests.Manifest, pa.Table, int]
) -> None:
    manifest, expected, _ = dataset
    node = make_node(tmp_path, manifest, memory_limit=1 << 30, concurrency=2)
    try:
        params = plans.PlanParams(seed=1, epoch=0, rank=0, world_size=2, block_size=100)
        mine = plan_of(manifest, params)
        assert 2 < len(set(mine)) < len(SHARDS)  # beyond its depth, not every shard
        node.register_reader("rank-0", params)
        settle(node)
        # Its depth is 1: without the fill two shards would be resident now. Rank 1's
        # shards are another pod's to fetch.
        assert resident(node) == sorted(set(mine))
        assert node.stats().evictions["memory"] == 0
        node.register_reader("rank-1", dataclasses.replace(params, rank=1))
        settle(node)
        assert resident(node) == list(range(len(SHARDS)))
        assert read_all(node).equals(expected)
    finally:
        node.close()


def test_the_fill_leaves_room_for_a_wave_of_readahead_and_never_evicts(
    tmp_path: Path, dataset: tuple[manifests.Manifest, pa.Table, int]
) -> None:
    manifest, expected, largest = dataset
    concurrency = 1
    limit = largest * 5 + largest // 2  # five shards fit; one is kept for readahead
    node = make_node(tmp_path, manifest, memory_limit=limit, concurrency=concurrency)
    try:
        params = plans.PlanParams(seed=1, epoch=0, rank=0, world_size=2, block_size=100)
        node.register_reader("rank-0", params)
        settle(node)
        held = node.memory.used_bytes()
        # More than the two shards rank 0's readahead asks for, fewer than all.
        assert 3 <= len(resident(node)) < len(SHARDS)
        assert held + concurrency * largest <= limit
        assert node.stats().evictions["memory"] == 0
        # Every row once, in order, shards evicted and fetched again as the reads go.
        assert read_all(node).equals(expected)
        assert node.memory.used_bytes() <= limit
    finally:
        node.close()


def test_a_reader_that_leaves_takes_its_fill_with_it(
    tmp_path: Path, dataset: tuple[manifests.Manifest, pa.Table, int]
) -> None:
    manifest, _, _ = dataset
    node = make_node(tmp_path, manifest, memory_limit=1 << 30, concurrency=1)
    try:
        params = plans.PlanParams(seed=1, epoch=0, rank=0, world_size=2, block_size=100)
        node.register_reader("rank-0", params)
        node.unregister_reader("rank-0")
        settle(node)
        # At most what was queued or fetching when it left: the two readahead shards
        # and the top-up of two fill shards for the one fetch thread.
        assert len(resident(node)) <= 4 < len(set(plan_of(manifest, params))) + 1
    finally:
        node.close()


def test_each_shard_made_resident_logs_its_stages_in_order_when_the_timeline_listens(
    tmp_path: Path,
    dataset: tuple[manifests.Manifest, pa.Table, int],
    caplog: pytest.LogCaptureFixture,
) -> None:
    manifest, _, _ = dataset
    node = make_node(tmp_path, manifest, memory_limit=1 << 30, concurrency=1)
    try:
        with caplog.at_level(logging.DEBUG, logger=timelines.log.name):
            node.acquire(3, timeout=60).release()
    finally:
        node.close()
    lines = [r for r in caplog.records if r.getMessage() == timelines.MESSAGE]
    assert len(lines) == 1
    line = lines[0].__dict__
    assert (line["shard"], line["why"], line["outcome"]) == (3, "acquire", "inserted")
    stamps = [line[f"t_{stage}"] for stage in timelines.STAGES]
    assert stamps == sorted(stamps)


def test_the_timeline_costs_nothing_when_nobody_listens() -> None:
    assert not timelines.log.isEnabledFor(logging.DEBUG)
    assert timelines.start(1, "fill") is timelines.OFF


def test_a_prefetch_depth_of_0_fills_nothing(
    tmp_path: Path, dataset: tuple[manifests.Manifest, pa.Table, int]
) -> None:
    manifest, _, _ = dataset
    settings = caches.NodeSettings(
        disk_dir=tmp_path / "disk",
        memory_dir=tmp_path / "mem",
        prefetch_depth=0,
        fetch_concurrency=2,
    )
    node = caches.CacheNode(manifest, settings)
    try:
        node.register_reader("rank-0", plans.PlanParams(seed=1, world_size=4, block_size=100))
        settle(node)
        assert len(resident(node)) == 1  # the shard it is at
    finally:
        node.close()


def test_an_epoch_that_fits_the_memory_tier_is_filled_to_its_last_shard(
    tmp_path: Path, dataset: tuple[manifests.Manifest, pa.Table, int]
) -> None:
    manifest, expected, largest = dataset
    concurrency = 2
    # All eight fit with a shard to spare (a decode reserves its size from the Parquet
    # footer, a third more than the decoded file here), not with room for a wave of
    # two more beside them: the fill is the readers' own shards, so it needs no room
    # kept for them.
    limit = largest * (len(SHARDS) + 1) + largest // 2
    node = make_node(tmp_path, manifest, memory_limit=limit, concurrency=concurrency)
    try:
        params = plans.PlanParams(seed=1, epoch=0, rank=0, world_size=2, block_size=100)
        node.register_reader("rank-0", params)
        node.register_reader("rank-1", dataclasses.replace(params, rank=1))
        settle(node)
        assert resident(node) == list(range(len(SHARDS)))
        assert node.memory.used_bytes() <= limit
        assert node.stats().evictions["memory"] == 0
        assert read_all(node).equals(expected)
    finally:
        node.close()


def test_a_startup_plan_for_the_local_ranks_fills_their_epochs_before_they_register(
    tmp_path: Path, dataset: tuple[manifests.Manifest, pa.Table, int]
) -> None:
    manifest, expected, _ = dataset
    node = make_node(tmp_path, manifest, memory_limit=1 << 30, concurrency=2)
    try:
        params = plans.PlanParams(seed=1, epoch=0, rank=1, world_size=4, block_size=100)
        node.register_reader("startup", params, fill_ranks=2)
        settle(node)
        local = set(plan_of(manifest, params)) | set(
            plan_of(manifest, dataclasses.replace(params, rank=2))
        )
        assert resident(node) == sorted(local) != list(range(len(SHARDS)))
        assert read_all(node).equals(expected)
    finally:
        node.close()


def warm_node(
    tmp_path: Path, manifest: manifests.Manifest, world: int, *, sole_writer: bool = False
) -> tuple[caches.CacheNode, plans.PlanParams]:
    """A node whose `world` registered readers (epoch 0) made every shard resident:
    the node and rank 0's parameters."""
    node = make_node(
        tmp_path, manifest, memory_limit=1 << 30, concurrency=2, sole_writer=sole_writer
    )
    params = plans.PlanParams(seed=1, epoch=0, rank=0, world_size=world, block_size=100)
    for rank in range(world):
        node.register_reader(f"rank-{rank}", dataclasses.replace(params, rank=rank))
    settle(node)
    assert resident(node) == list(range(len(SHARDS)))
    return node, params


def contains_calls(node: caches.CacheNode, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The keys the node asks its memory tier about (`Tier.contains`) from now on."""
    asked: list[str] = []
    contains = node.memory.contains

    def counted(key: str) -> bool:
        asked.append(key)
        return contains(key)

    monkeypatch.setattr(node.memory, "contains", counted)
    return asked


def test_a_warm_epoch_start_looks_only_at_the_entering_readers_own_shards(
    tmp_path: Path,
    dataset: tuple[manifests.Manifest, pa.Table, int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    manifest, expected, _ = dataset
    node, params = warm_node(tmp_path, manifest, 4)
    try:
        looked = contains_calls(node, monkeypatch)
        node.update_reader("rank-0", epoch=1, position=0)
        own = plan_of(manifest, dataclasses.replace(params, epoch=1))
        # Its own plan once (nothing missing: no fill ordered over the other readers'
        # plans), then its readahead window (depth 1: two shards).
        assert len(looked) <= len(own) + 2
        assert set(looked) <= {manifest.decoded_key(s) for s in own}
        assert node.prefetching() == 0
        assert read_all(node).equals(expected)
    finally:
        node.close()


#: Readers of the warm sole-writer node (`warm_sole_writer`).
WORLD = 4


@pytest.fixture
def warm_sole_writer(
    tmp_path: Path, dataset: tuple[manifests.Manifest, pa.Table, int]
) -> Iterator[tuple[caches.CacheNode, pa.Table]]:
    """The sidecar's kind of node (its memory tier's sole writer) with `WORLD` readers
    registered and every shard resident, and the table it serves."""
    manifest, expected, _ = dataset
    node, _ = warm_node(tmp_path, manifest, WORLD, sole_writer=True)
    try:
        yield node, expected
    finally:
        node.close()


def test_a_warm_epoch_start_of_the_sidecars_cache_makes_no_stat_and_walks_no_plan(
    tmp_path: Path,
    warm_sole_writer: tuple[caches.CacheNode, pa.Table],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The sidecar's memory tier is its own (`memory_sole_writer`): asking which shards
    # are resident, on the event loop at every epoch start, is a set lookup. Each stat
    # lets go of the GIL, and the loop then waited for the fetch threads to hand it
    # back (docs/benchmarks.md, run D: 8-12 ms at a time). With every shard resident,
    # the fill has nothing to order: no reader's whole plan is walked either (13 % of
    # the sidecar's samples with 8-16 ranks opening at once).
    node, expected = warm_sole_writer
    memory = os.fspath(tmp_path / "mem")
    stats: list[str] = []
    real = os.stat

    def counted(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        stats.append(os.fsdecode(path))
        return real(path, *args, **kwargs)

    asked: list[int] = []
    upcoming = caches._Reader.upcoming

    def walked(reader: Any, count: int) -> list[int]:
        asked.append(count)
        return upcoming(reader, count)

    monkeypatch.setattr(os, "stat", counted)
    monkeypatch.setattr(caches._Reader, "upcoming", walked)
    for rank in range(WORLD):
        node.update_reader(f"rank-{rank}", epoch=1, position=0)
    assert [path for path in stats if path.startswith(memory)] == []
    assert asked and max(asked) < len(SHARDS)  # readahead windows, not the epoch
    monkeypatch.undo()
    assert node.prefetching() == 0
    assert read_all(node).equals(expected)


def test_a_warm_epoch_start_looks_at_every_shard_once_until_one_leaves_the_tier(
    warm_sole_writer: tuple[caches.CacheNode, pa.Table], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every reader's epoch start asks whether every shard is resident: for a manifest
    # of 100,000 shards that is 100,000 lookups on the event loop each time, unless
    # nothing left the tier since the last time they all were.
    node, expected = warm_sole_writer
    keys = set(node._memory_keys)
    asked = contains_calls(node, monkeypatch)

    def epoch_start(epoch: int) -> int:
        asked.clear()
        for rank in range(WORLD):
            node.update_reader(f"rank-{rank}", epoch=epoch, position=0)
        return len([key for key in asked if key in keys])

    # The first epoch start after the fill made them looks at every shard once...
    assert epoch_start(1) >= len(SHARDS)
    # ...and then only readahead asks, a shard or two per reader.
    assert epoch_start(2) <= 2 * WORLD
    assert epoch_start(3) <= 2 * WORLD
    # One shard leaves the tier: the next epoch start looks again and finds it gone,
    # and the fill makes it again.
    gone = node.manifest.decoded_key(len(SHARDS) - 1)
    assert node.memory.evict(gone)
    epoch_start(4)
    assert gone in asked
    settle(node)
    assert resident(node) == list(range(len(SHARDS)))
    monkeypatch.undo()
    assert read_all(node).equals(expected)


def test_a_warm_readers_requests_walk_no_readahead_and_make_no_plan_until_a_grant_needs_it(
    warm_sole_writer: tuple[caches.CacheNode, pa.Table], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A warm pass's requests (`notes`, each moving its reader) asked the memory tier
    # about every shard of the reader's readahead window, each resident, and every
    # epoch start made the reader's plan, which only a grant ahead reads while every
    # shard is resident (docs/benchmarks.md, "Where a warm pass's sidecar CPU goes").
    node, expected = warm_sole_writer
    node.update_reader("rank-0", epoch=1, position=0)  # the walk that finds them all
    asked = contains_calls(node, monkeypatch)
    made: list[plans.PlanParams] = []
    rank_spans = node._orders.rank_spans

    def counted(params: plans.PlanParams) -> plans.ShardSpans:
        made.append(params)
        return rank_spans(params)

    monkeypatch.setattr(node._orders, "rank_spans", counted)
    for epoch in (2, 3):
        for rank in range(WORLD):
            node.update_reader(f"rank-{rank}", epoch=epoch, position=0)
            node.update_reader(f"rank-{rank}", epoch=epoch, position=150)
    assert asked == []
    assert made == []
    # A grant ahead reads the plan: made then, once, and the same as made at once.
    ahead = node.upcoming("rank-1", 3)
    assert len(made) == 1 and made[0].rank == 1 and made[0].epoch == 3
    params = plans.PlanParams(seed=1, epoch=3, rank=1, world_size=WORLD, block_size=100)
    assert ahead == plans.next_shards(
        *(lambda runs: (runs, plans.run_ends(runs)))(
            plans.rank_runs(node.manifest.shard_rows, node.manifest.digest, params)
        ),
        150,
        3,
    )
    node.upcoming("rank-1", 3)
    assert len(made) == 1
    # A shard leaves the tier: readahead looks again and makes it again.
    gone = node.manifest.decoded_key(ahead[0])
    assert node.memory.evict(gone)
    node.update_reader("rank-1", epoch=3, position=150)
    assert gone in asked
    monkeypatch.undo()
    settle(node)
    assert resident(node) == list(range(len(SHARDS)))
    assert read_all(node).equals(expected)


def test_the_sidecars_lookups_of_resident_shards_hold_them_without_a_lease_file(
    warm_sole_writer: tuple[caches.CacheNode, pa.Table], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every acquire and every shard granted ahead is a lookup on the event loop: the
    # sidecar's own tier holds the entry in memory (`Tier.hold`), not with a lock file.
    node, _ = warm_sole_writer
    for shard in range(len(SHARDS)):
        entry = node.lookup(shard, count=False)
        assert entry is not None
        entry.release()
    opened: list[str] = []
    real = _locks.open_for_lock

    def counted(path: Path, flags: int, mode: int = 0o644) -> int:
        opened.append(os.fspath(path))
        return real(path, flags, mode)

    monkeypatch.setattr(_locks, "open_for_lock", counted)
    held = [node.lookup(shard) for shard in range(len(SHARDS))]
    assert all(entry is not None for entry in held) and opened == []
    # Held so, none is evicted.
    assert not any(node.memory.evict(node.manifest.decoded_key(s)) for s in range(len(SHARDS)))
    for entry in held:
        assert entry is not None
        entry.release()
    assert node.memory.evict(node.manifest.decoded_key(0))


def test_a_new_epochs_plan_is_made_on_the_loop_only_when_the_ranks_share_is_small(
    tmp_path: Path,
    dataset: tuple[manifests.Manifest, pa.Table, int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    manifest, _, _ = dataset
    node = make_node(tmp_path, manifest, memory_limit=1 << 30, concurrency=2)
    try:
        monkeypatch.setattr(caches, "_CHEAP_RANK_BLOCKS", 6)
        params = plans.PlanParams(seed=1, epoch=0, rank=0, world_size=2, block_size=100)
        # 8 shards of 3 blocks over 2 ranks: 12 blocks each, over the bound of 6; over 4
        # ranks: 6 each.
        assert not node.plan_is_cheap(params)
        assert node.plan_is_cheap(dataclasses.replace(params, world_size=4))
        # Blocks, not shards, are what a plan costs: one block a shard, 4 each.
        assert node.plan_is_cheap(dataclasses.replace(params, block_size=300))
        monkeypatch.setattr(caches, "_CHEAP_ORDER_SHARDS", 4)
        assert not node.plan_is_cheap(dataclasses.replace(params, world_size=4))
        # Once a rank made the epoch's order, every other rank's plan is a slice of it.
        node.register_reader("rank-0", params)
        assert node.plan_is_cheap(dataclasses.replace(params, rank=1))
        assert not node.plan_is_cheap(dataclasses.replace(params, epoch=1))
    finally:
        node.close()


def test_a_shard_outside_the_manifest_is_refused_naming_the_first_and_the_range(
    warm_sole_writer: tuple[caches.CacheNode, pa.Table],
) -> None:
    node, expected = warm_sole_writer
    n = len(node.manifest.shards)
    node.check_shards([])
    node.check_shards([0, n - 1])
    for shards, first in (([1, n + 3, 2, -1], n + 3), ([0, -1], -1), ([n], n)):
        with pytest.raises(errors.ShardIndexError, match=rf"shard index {first} is out of range"):
            node.check_shards(shards)
    with pytest.raises(
        errors.ShardIndexError, match=rf"the manifest has {n} shards \(0\.\.{n - 1}\)"
    ):
        node.acquire(n)
    with pytest.raises(errors.ShardIndexError):
        node.lookup(-1)
    # Refused, nothing else: the node serves every row as before.
    assert read_all(node).equals(expected)
