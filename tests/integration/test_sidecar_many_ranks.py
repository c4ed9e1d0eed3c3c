"""K rank processes on one sidecar (issue 14): correctness, not timing.

Against a real `shardcache sidecar` process (file:// source) and real rank processes:
while a memory tier smaller than the dataset evicts and re-fetches shards, every rank
reads exactly its plan and together they read every row once per epoch; a rank killed
in the middle of a shard leaves nothing that keeps the shard from being evicted, and
leases granted ahead of a reader go when it closes or dies.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow.fs as pafs
import pytest

import shardcache
from shardcache import plans, sidecar_client
from shardcache.node import tiers
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


# Takes shard 0 (and with it leases on the next shards, granted ahead) and lets it go,
# says so, then waits: for "close" (closes its reader) or to die.
AHEAD_RANK = textwrap.dedent(
    """
    import sys, time
    from shardcache import plans, sidecar_client
    shards = sidecar_client.SidecarProvider.from_env()
    reader = shards.open_reader(plans.PlanParams(shuffle=False), position=0)
    shards.acquire(reader, 0, epoch=0, position=0).release()
    print("acquired", flush=True)
    assert sys.stdin.readline().strip() == "close"
    shards.close_reader(reader)
    print("closed", flush=True)
    time.sleep(600)
    """
)


def pinned_shards(proc: SidecarProcess, keys: list[str]) -> list[int]:
    """Shards whose memory-tier entry some process holds a lock on."""
    return [
        shard
        for shard, key in enumerate(keys)
        if (proc.memory_dir / (key + ".lock")).exists()
        and not exclusively_lockable(proc.memory_dir / (key + ".lock"))
    ]


def eventually(probe: Callable[[], bool], timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.parametrize("end", ["close", "sigkill"])
def test_leases_granted_ahead_are_released_when_the_reader_closes_or_dies(
    sidecar_factory: Factory, tmp_path: Path, end: str
) -> None:
    rows = [200] * 6
    root = tmp_path / "eq"
    datasets.write_dataset(pafs.LocalFileSystem(), str(root), rows)
    uri = f"file://{root}"
    proc = sidecar_factory(uri, args=["--ready-shards", "0", "--prefetch-depth", "4"])
    proc.start()
    # Make every shard resident first: only resident shards are granted ahead.
    warmer = sidecar_client.SidecarProvider.from_env(environ=proc.client_env(), ahead=0)
    keys = [warmer.manifest.decoded_key(s) for s in range(len(rows))]
    reader = warmer.open_reader(plans.PlanParams(shuffle=False), position=0)
    for shard in range(len(rows)):
        warmer.acquire(reader, shard, epoch=0, position=200 * shard).release()
    warmer.close()
    assert proc.holds_drain() == 0 and pinned_shards(proc, keys) == []

    with subprocess.Popen(
        [sys.executable, "-c", AHEAD_RANK],
        env={**os.environ, **proc.client_env()},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as rank:
        try:
            assert rank.stdin is not None and rank.stdout is not None
            line = rank.stdout.readline().strip()
            assert line == "acquired", f"the rank exited with {rank.poll()} before acquiring"
            # The next shards of its plan, within the prefetch depth, pinned by the rank
            # itself; the sidecar's own holds on them went once the rank had its locks.
            assert proc.holds_drain() == 0
            assert pinned_shards(proc, keys) == [1, 2, 3, 4]
            if end == "close":
                rank.stdin.write("close\n")
                rank.stdin.flush()
                assert rank.stdout.readline().strip() == "closed", rank.poll()
            else:
                rank.send_signal(signal.SIGKILL)
                rank.wait(timeout=30)
            assert eventually(lambda: pinned_shards(proc, keys) == [])
        finally:
            rank.kill()
            rank.wait(timeout=30)
    assert proc.holds_drain() == 0
    # And the sidecar can evict every one of them.
    memory = tiers.Tier(
        proc.memory_dir, limit_bytes=1 << 40, name="memory", fsync=False, verify="never"
    )
    assert all(memory.evict(key) for key in keys)


def test_a_forked_child_does_not_keep_the_parents_leases_granted_ahead(
    sidecar_factory: Factory, tmp_path: Path
) -> None:
    # DataLoader workers are forked from the trainer: sharing its lock descriptors, a
    # child would keep every shard granted ahead pinned for as long as it lives.
    rows = [200] * 6
    root = tmp_path / "eq"
    datasets.write_dataset(pafs.LocalFileSystem(), str(root), rows)
    proc = sidecar_factory(f"file://{root}", args=["--ready-shards", "0"])
    proc.start()
    warmer = sidecar_client.SidecarProvider.from_env(environ=proc.client_env(), ahead=0)
    keys = [warmer.manifest.decoded_key(s) for s in range(len(rows))]
    reader = warmer.open_reader(plans.PlanParams(shuffle=False), position=0)
    for shard in range(len(rows)):  # every shard resident
        warmer.acquire(reader, shard, epoch=0, position=200 * shard).release()
    warmer.close()
    shards = sidecar_client.SidecarProvider.from_env(environ=proc.client_env())
    reader = shards.open_reader(plans.PlanParams(shuffle=False), position=0)
    shards.acquire(reader, 0, epoch=0, position=0).release()
    assert shards.flush() and proc.holds_drain() == 0
    assert pinned_shards(proc, keys) == [1, 2, 3, 4]
    ready_r, ready_w = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover (the child)
        # fork() returns here only after the client's at-fork hooks ran in this child:
        # say so, then live on holding whatever descriptors it still has.
        os.write(ready_w, b"1")
        time.sleep(60)
        os._exit(0)
    try:
        os.close(ready_w)
        # Wait for the child's hooks, not for a clock: until they ran, the child shares
        # the parent's lock descriptors as any forked child does.
        assert os.read(ready_r, 1) == b"1"
        shards.close_reader(reader)
        assert pinned_shards(proc, keys) == []
    finally:
        os.close(ready_r)
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        shards.close()
