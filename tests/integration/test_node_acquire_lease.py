"""An acquire that makes a shard resident holds it from its insert on: another reader's
eviction between the insert and the hand-over cannot take it (issue 14: K readers on a
memory tier smaller than the dataset; a tight tier used to fail with "evicted from the
memory tier again and again before it could be leased")."""

from __future__ import annotations

import concurrent.futures
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.ipc as ipc
import pytest

from shardcache import manifests
from shardcache.node import caches, tiers
from tests.support import datasets, nodes

pytestmark = pytest.mark.integration

SHARDS = [300, 200, 100]


def evicting_before_every_lookup(node: caches.CacheNode) -> list[str]:
    """The memory tier as a reader beside a busy one meets it: before every lookup,
    another reader's insert evicts whatever nobody leases. Returns the keys evicted."""
    memory = node.memory
    real = memory.lookup
    evicted: list[str] = []

    def lookup(key: str, *, count: bool = True) -> tiers.Entry | None:
        resident = memory.keys()  # a Tier's committed keys, not a dict's
        for other in resident:
            if memory.evict(other):
                evicted.append(other)
        return real(key, count=count)

    memory.lookup = lookup  # type: ignore[method-assign]
    return evicted


def test_a_shard_an_acquire_inserted_is_handed_over_though_others_evict_at_every_turn(
    tmp_path: Path,
) -> None:
    expected = datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / "ds"), SHARDS)
    manifest = manifests.resolve(f"file://{tmp_path / 'ds'}")
    settings = caches.NodeSettings(
        disk_dir=tmp_path / "disk", memory_dir=tmp_path / "mem", prefetch_depth=0
    )
    node = caches.CacheNode(manifest, settings)
    try:
        evicted = evicting_before_every_lookup(node)
        batches = []
        for shard in range(len(SHARDS)):
            with node.acquire(shard, timeout=30) as entry:
                batches.append(ipc.open_file(pa.memory_map(str(entry.path))).get_batch(0))
                # Leased: the eviction before the next lookup leaves it where it is.
                assert not node.memory.evict(entry.key)
        stats = node.stats()
    finally:
        node.close()

    assert pa.Table.from_batches(batches).equals(expected)
    # Each shard was evicted once its reader let it go, before the next acquire's lookup.
    assert evicted == [manifest.decoded_key(s) for s in range(len(SHARDS) - 1)]
    # One memory hit per shard handed to a reader, as when the acquire looked it up again.
    assert stats.hits["memory"] == len(SHARDS)


class HeldDecodes:
    """The node's decodes, counted, the first one held until `open()`: an attempt stays
    in flight while other callers join it."""

    def __init__(self, node: caches.CacheNode) -> None:
        self.count = 0
        self._gate = threading.Event()
        real = node._decode

        def decode(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            if self.count == 1:
                assert self._gate.wait(30)
            return real(*args, **kwargs)

        node._decode = decode  # type: ignore[method-assign]

    def open(self) -> None:
        self._gate.set()


def waiting_on(node: caches.CacheNode, shard: int, acquires: int) -> None:
    """Until `acquires` acquires wait on the attempt in flight for `shard`."""
    deadline = time.monotonic() + 30
    while (attempt := node._inflight.get(shard)) is None or attempt.wanting < acquires:
        assert time.monotonic() < deadline, "the acquires never joined the attempt"
        time.sleep(0.005)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[caches.CacheNode]:
    yield from nodes.quiet_node(tmp_path, SHARDS)


def test_an_acquire_that_waited_on_a_readahead_is_handed_its_shard_without_a_second_decode(
    node: caches.CacheNode,
) -> None:
    decodes = HeldDecodes(node)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        readahead = pool.submit(node._prefetch, 0, "readahead")
        waiting_on(node, 0, acquires=0)
        acquired = pool.submit(node.acquire, 0, timeout=30)
        waiting_on(node, 0, acquires=1)
        # From here on every lookup first evicts whatever nobody leases: the readahead
        # lets go of the shard as soon as it is inserted.
        evicted = evicting_before_every_lookup(node)
        decodes.open()
        assert readahead.result(30) == "inserted"
        with acquired.result(30) as entry:
            table = ipc.open_file(pa.memory_map(str(entry.path))).read_all()
            assert not node.memory.evict(entry.key)
    # Before, the acquire looked the shard up after the readahead had let go of it,
    # found it evicted, and fetched and decoded it again.
    assert decodes.count == 1
    assert entry.key not in evicted
    assert table.num_rows == SHARDS[0]
    assert node.stats().hits["memory"] == 1
    assert node.memory.evict(entry.key)  # every lease let go


def test_acquires_waiting_on_one_attempt_each_get_a_lease_and_one_that_gave_up_leaves_none(
    node: caches.CacheNode,
) -> None:
    decodes = HeldDecodes(node)
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        readahead = pool.submit(node._prefetch, 1, "readahead")
        waiting_on(node, 1, acquires=0)
        acquires = [pool.submit(node.acquire, 1, timeout=30) for _ in range(3)]
        waiting_on(node, 1, acquires=3)
        gave_up = pool.submit(node.acquire, 1, timeout=0.2)
        with pytest.raises(concurrent.futures.TimeoutError):
            gave_up.result(30)
        decodes.open()
        assert readahead.result(30) == "inserted"
        entries = [a.result(30) for a in acquires]
    key = node.manifest.decoded_key(1)
    assert decodes.count == 1
    assert {e.key for e in entries} == {key}
    for held in range(len(entries), 0, -1):
        assert not node.memory.evict(key), f"{held} leases held"
        entries[held - 1].release()
    # No lease was left behind for the acquire that gave up.
    assert node.memory.evict(key)


def test_acquires_and_readaheads_racing_on_a_tight_tier_hand_over_exact_shards_and_leak_no_lease(
    tmp_path: Path,
) -> None:
    rows = [120, 80, 160, 40, 200, 100, 60, 140]
    expected = datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / "ds"), rows)
    manifest = manifests.resolve(f"file://{tmp_path / 'ds'}")
    sizes = decoded_sizes(manifest, tmp_path / "sizes")
    # Room for the four largest: three readers hold one shard each, and evict.
    limit = sum(sorted(sizes)[-4:])
    settings = caches.NodeSettings(
        disk_dir=tmp_path / "disk",
        memory_dir=tmp_path / "mem",
        memory_limit=limit,
        prefetch_depth=0,
        wait_timeout=60,
    )
    starts = [sum(rows[:i]) for i in range(len(rows))]
    node = caches.CacheNode(manifest, settings)
    try:

        def read(seed: int) -> int:
            rng = random.Random(seed)
            for _ in range(60):
                shard = rng.randrange(len(rows))
                with node.acquire(shard, timeout=60) as entry:
                    got = ipc.open_file(pa.memory_map(str(entry.path))).read_all()
                    want = expected.slice(starts[shard], rows[shard])
                    assert got.column("uid").equals(want.column("uid")), shard
            return 60

        def read_ahead(seed: int) -> None:
            rng = random.Random(seed)
            for _ in range(60):
                node._prefetch(rng.randrange(len(rows)), "readahead")

        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            readers = [pool.submit(read, seed) for seed in range(3)]
            aheads = [pool.submit(read_ahead, seed) for seed in (10, 11)]
            assert sum(r.result(120) for r in readers) == 180
            for ahead in aheads:
                ahead.result(120)
        stats = node.stats()
        leased = node.memory.leased_bytes()
    finally:
        node.close()
    assert stats.evictions["memory"] > 0, "nothing was evicted: the test is moot"
    assert leased == 0


def decoded_sizes(manifest: manifests.Manifest, root: Path) -> list[int]:
    """Each shard's size in the memory tier, from a node with room for all of them."""
    node = caches.CacheNode(
        manifest, caches.NodeSettings(disk_dir=root / "disk", memory_dir=root / "mem")
    )
    try:
        sizes = []
        for shard in range(len(manifest.shards)):
            with node.acquire(shard, timeout=30) as entry:
                sizes.append(entry.size)
        return sizes
    finally:
        node.close()
