"""K rank processes on one sidecar (issue 14): correctness, not timing.

Against a real `shardcache sidecar` process (file:// source) and real rank processes:
while a memory tier smaller than the dataset evicts and re-fetches shards, every rank
reads exactly its plan and together they read every row once per epoch; a rank killed
in the middle of a shard leaves nothing that keeps the shard from being evicted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pyarrow.fs as pafs
import pytest

import shardcache
from shardcache import plans, sidecar_client
from tests.support import datasets
from tests.support.locks import exclusively_lockable
from tests.support.sidecar import SidecarProcess

pytestmark = pytest.mark.integration

Factory = Callable[..., SidecarProcess]
BLOCK = 64
SEED = 3
BATCH = 50

RANK = textwrap.dedent(
    f"""
    import json, sys
    import shardcache
    rank, world, epochs = (int(x) for x in sys.argv[1:4])
    streams = []
    with shardcache.open(rank=rank, world_size=world, seed={SEED}, block_size={BLOCK}) as ds:
        for epoch in range(epochs):
            ds.set_epoch(epoch)
            streams.append(
                [u for b in ds.batches({BATCH}) for u in b.column("uid").to_pylist()]
            )
    print(json.dumps(streams))
    """
)

# Reads one batch of its first shard (holding its lease), says so, and waits to die.
STALLED_RANK = textwrap.dedent(
    f"""
    import sys, time
    import shardcache
    ds = shardcache.open(rank=0, world_size=2, shuffle=False, block_size={BLOCK})
    stream = ds.batches({BATCH})  # kept: a collected generator releases its lease
    next(stream)
    print("mid-shard", flush=True)
    time.sleep(600)
    """
)


def decoded_sizes(uri: str, cache: Path) -> list[int]:
    """Bytes of each decoded shard (an embedded read of the dataset)."""
    with shardcache.open(uri, cache_dir=cache, shuffle=False) as ds:
        for _ in ds.batches(1000):
            pass
    return [p.stat().st_size for p in (cache / "mem").iterdir() if "." not in p.name]


def reference(uri: str, cache: Path, rank: int, world: int, epochs: int) -> list[list[int]]:
    """What `rank` must read: the same plan in embedded mode."""
    streams = []
    with shardcache.open(
        uri, cache_dir=cache, rank=rank, world_size=world, seed=SEED, block_size=BLOCK
    ) as ds:
        for epoch in range(epochs):
            ds.set_epoch(epoch)
            streams.append([u for b in ds.batches(BATCH) for u in b.column("uid").to_pylist()])
    return streams


def test_k_ranks_read_every_row_once_while_a_small_memory_tier_evicts(
    sidecar_factory: Factory, tmp_path: Path
) -> None:
    k, epochs = 3, 2
    rows = [256, 192, 256, 128, 256, 200, 256, 64, 256, 160]
    root = tmp_path / "ds"
    datasets.write_dataset(pafs.LocalFileSystem(), str(root), rows)
    uri = f"file://{root}"
    sizes = decoded_sizes(uri, tmp_path / "size")
    # Room for one shard held by each rank and a little more: under half the dataset.
    limit = int((k + 0.5) * max(sizes))
    assert len(sizes) == len(rows) and limit < sum(sizes) / 2
    proc = sidecar_factory(uri, args=["--memory-limit", str(limit), "--ready-shards", "0"])
    proc.start()
    env = {**os.environ, **proc.client_env()}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(rank), str(k), str(epochs)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(k)
    ]
    streams = []
    for rank, p in enumerate(ranks):
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, f"rank {rank} failed:\n{err[-3000:]}\n{proc.log_tail(40)}"
        streams.append(json.loads(out))

    for rank in range(k):
        assert streams[rank] == reference(uri, tmp_path / "ref", rank, k, epochs), rank
    for epoch in range(epochs):
        every = sorted(u for rank in range(k) for u in streams[rank][epoch])
        assert every == list(range(sum(rows))), f"epoch {epoch}: rows missing or repeated"
    stats = proc.control("GET", "/v1/status")[1]["stats"]
    assert stats["evictions"]["memory"] > 0, "the memory tier never evicted: the test is moot"
    assert stats["memory_resident_bytes"] <= limit


def test_a_rank_killed_mid_shard_leaves_no_lease_that_blocks_eviction(
    sidecar_factory: Factory, tmp_path: Path
) -> None:
    rows = [200] * 6
    root = tmp_path / "eq"
    datasets.write_dataset(pafs.LocalFileSystem(), str(root), rows)
    uri = f"file://{root}"
    size = max(decoded_sizes(uri, tmp_path / "size"))
    args = ["--memory-limit", str(int(2.5 * size)), "--prefetch-depth", "0"]
    proc = sidecar_factory(uri, args=[*args, "--ready-shards", "0"])
    proc.start()
    shards = sidecar_client.SidecarProvider.from_env(
        environ=proc.client_env(), reconnect_timeout=10.0
    )
    key = shards.manifest.decoded_key(0)  # rank 0's first shard, unshuffled
    lock = proc.memory_dir / f"{key}.lock"
    with subprocess.Popen(
        [sys.executable, "-c", STALLED_RANK],
        env={**os.environ, **proc.client_env()},
        stdout=subprocess.PIPE,
        text=True,
    ) as stalled:
        try:
            assert stalled.stdout is not None
            assert stalled.stdout.readline().strip() == "mid-shard", stalled.poll()
            assert not exclusively_lockable(lock)  # the rank holds shard 0
        finally:
            stalled.send_signal(signal.SIGKILL)
            stalled.wait(timeout=30)
    # A hold the sidecar kept for the hand-over expires (30 s) if the rank died before
    # dropping it; the rank's own lock died with it.
    assert proc.holds_drain(timeout=45) == 0
    assert exclusively_lockable(lock)
    # Another reader walks every other shard through room for about two and a half: the
    # least recently used entry, the dead rank's shard 0, must be the first to go.
    reader = shards.open_reader(plans.PlanParams(shuffle=False, block_size=BLOCK), position=0)
    for shard in range(1, len(rows)):
        shards.acquire(reader, shard, epoch=0, position=0).release()
    evictions = shards.status()["stats"]["evictions"]["memory"]
    shards.close()
    assert not (proc.memory_dir / key).exists(), "the killed rank's shard was never evicted"
    assert evictions >= 1


def test_nothing_stays_pinned_once_ranks_close_or_die(
    sidecar_factory: Factory, tmp_path: Path
) -> None:
    """Whatever the sidecar holds or hands out for a reader (today: hand-over holds;
    leases granted ahead of time, should it grant them) goes when the reader closes or
    its process dies: no hold remains and every memory-tier entry can be evicted."""
    rows = [200] * 6
    root = tmp_path / "eq"
    datasets.write_dataset(pafs.LocalFileSystem(), str(root), rows)
    uri = f"file://{root}"
    proc = sidecar_factory(uri, args=["--ready-shards", "0"])
    proc.start()
    env = {**os.environ, **proc.client_env()}
    closing = subprocess.Popen(
        [sys.executable, "-c", RANK, "1", "2", "1"], env=env, stdout=subprocess.PIPE, text=True
    )
    with subprocess.Popen(
        [sys.executable, "-c", STALLED_RANK], env=env, stdout=subprocess.PIPE, text=True
    ) as stalled:
        try:
            assert stalled.stdout is not None
            assert stalled.stdout.readline().strip() == "mid-shard", stalled.poll()
            out, _ = closing.communicate(timeout=120)
            assert closing.returncode == 0 and json.loads(out)[0], "the closing rank read nothing"
        finally:
            closing.kill()
            stalled.send_signal(signal.SIGKILL)
            stalled.wait(timeout=30)
    assert proc.holds_drain(timeout=45) == 0
    locks = sorted(proc.memory_dir.glob("*.lock"))
    assert locks, "no shard reached the memory tier: the test is moot"
    assert [lock.name for lock in locks if not exclusively_lockable(lock)] == []
