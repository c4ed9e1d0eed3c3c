"""K rank processes on one sidecar (issue 14): correctness, not timing.

Against a real `shardcache sidecar` process (file:// source) and real rank processes:
while a memory tier smaller than the dataset evicts and re-fetches shards, every rank
reads exactly its plan and together they read every row once per epoch, in block mode
and in sample mode (whose ranks each lease a whole window of shards); a memory tier
too small for the ranks' windows together is said at once, not waited on; a rank
killed in the middle of a shard leaves nothing that keeps the shard from being
evicted, and leases granted ahead of a reader go when it closes or dies.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest

import shardcache
from shardcache import plans, sidecar_client, windows
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


def reference(
    uri: str, cache: Path, rank: int, world: int, epochs: int, **mode: Any
) -> list[list[int]]:
    """What `rank` must read: the same plan (`mode`: more of `shardcache.open`'s options)
    in embedded mode."""
    streams = []
    with shardcache.open(
        uri, cache_dir=cache, rank=rank, world_size=world, seed=SEED, block_size=BLOCK, **mode
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
    read_every_row_once(
        proc,
        RANK,
        k,
        epochs,
        sum(rows),
        limit,
        lambda rank: reference(uri, tmp_path / "ref", rank, k, epochs),
    )


def read_every_row_once(
    proc: SidecarProcess,
    script: str,
    k: int,
    epochs: int,
    rows: int,
    limit: int,
    expected: Callable[[int], list[list[int]]],
) -> None:
    """k ranks of `script` at once read `expected(rank)` each, and every one of the
    dataset's `rows` once per epoch, while the memory tier (of `limit` bytes) evicts."""
    done = run_ranks(
        script, proc.client_env(), k, epochs, timeout=240, context=lambda: proc.log_tail(40)
    )
    each_read_its_plan(done, epochs, rows, expected, lambda: proc.log_tail(40))
    stats = proc.control("GET", "/v1/status")[1]["stats"]
    assert stats["evictions"]["memory"] > 0, "the memory tier never evicted: the test is moot"
    assert stats["memory_resident_bytes"] <= limit


def each_read_its_plan(
    done: list[tuple[int, str, str]],
    epochs: int,
    rows: int,
    expected: Callable[[int], list[list[int]]],
    context: Callable[[], str] = str,
) -> None:
    """Every rank of `done` (`run_ranks`) read `expected(rank)`, and together every one
    of the dataset's `rows` once per epoch."""
    for rank, (code, _, err) in enumerate(done):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}\n{context()}"
    streams = [json.loads(out) for _, out, _ in done]
    for rank in range(len(done)):
        assert streams[rank] == expected(rank), rank
    for epoch in range(epochs):
        every = sorted(u for stream in streams for u in stream[epoch])
        assert every == list(range(rows)), f"epoch {epoch}: rows missing or repeated"


def sample_dataset(tmp_path: Path, k: int, epochs: int) -> tuple[str, list[int], list[int]]:
    """SAMPLE_ROWS as a dataset, each shard's decoded bytes, and what each of k ranks'
    two windows take at most (`window_bytes`)."""
    root = tmp_path / "ds"
    datasets.write_dataset(pafs.LocalFileSystem(), str(root), SAMPLE_ROWS)
    uri = f"file://{root}"
    sizes, largest = window_bytes(uri, tmp_path / "size", k, epochs, span=2)
    return uri, sizes, largest


def room_for_every_window(sizes: list[int], largest: list[int]) -> int:
    """A memory limit with room for every rank's two windows at once and nothing more,
    under the dataset's size: an acquire holds what its own insert or the attempt it
    waited on inserted from the insert on, so no shard of a window can be evicted before
    its reader leases it. (Three shards more before acquires kept their inserts.)"""
    limit = sum(largest)
    assert limit < sum(sizes), "the memory tier holds the whole dataset: the test is moot"
    return limit


def room_for_one_ranks_windows(
    uri: str, tmp_path: Path, k: int, epochs: int, sizes: list[int], largest: list[int]
) -> int:
    """A memory limit with room for any one rank's window and the next (what the
    sidecar keeps resident for it), and a shard more, where the k ranks' first windows
    at once do not fit."""
    _, first = window_bytes(uri, tmp_path / "size", k, epochs, span=1, first_only=True)
    limit = max(largest) + max(sizes)
    assert sum(first) > limit, "the ranks' first windows fit together: the test is moot"
    return limit


def told_at_once(
    script: str,
    env: Mapping[str, str],
    uri: str,
    tmp_path: Path,
    k: int,
    epochs: int,
    limit: int,
    prefix: str,
    *said: str,
    context: Callable[[], str] | None = None,
) -> None:
    """k ranks of the lockstep `script` on a memory tier of `limit` bytes too small for
    their windows: some fail with the windows error (its last line starting with
    `prefix` and saying each of `said`), and any that got through read exactly their
    plan. Before, the rank left without room waited out the memory tier's five minutes
    and was told about leases: the message tells the two apart, and `run_ranks` gives
    up (with every rank's stack) well before five minutes."""
    steps = tmp_path / "steps"
    steps.mkdir()
    done = run_ranks(script, env, k, epochs, 240, str(steps), context=context)
    failed = [err for code, _, err in done if code != 0]
    assert failed, f"every rank read its epoch within a memory tier of {limit} bytes"
    for err in failed:
        last = err.strip().splitlines()[-1]
        assert last.startswith(prefix), err[-3000:]
        assert "cannot hold every sample-mode reader's current and next window" in last
        assert f"the limit is {limit} bytes" in last
        for words in said:
            assert words in last, last
    # Ranks that got their windows after the others gave up read them exactly.
    for rank, (code, out, _) in enumerate(done):
        if code == 0:
            assert json.loads(out) == sample_reference(uri, tmp_path / "ref", rank, k, epochs)


WINDOW = 300
# A sample-mode rank: it gathers ahead on two threads, as a pod with CPUs to spare does.
SAMPLE_RANK = textwrap.dedent(
    f"""
    import json, sys
    import shardcache
    rank, world, epochs = (int(x) for x in sys.argv[1:4])
    streams = []
    with shardcache.open(rank=rank, world_size=world, seed={SEED}, block_size={BLOCK},
                         shuffle="sample", window={WINDOW}, gather_threads=2) as ds:
        for epoch in range(epochs):
            ds.set_epoch(epoch)
            streams.append(
                [u for b in ds.batches({BATCH}) for u in b.column("uid").to_pylist()]
            )
    print(json.dumps(streams))
    """
)
SAMPLE_ROWS = [256, 192, 256, 128, 256, 200, 256, 64, 256, 160, 100, 220] * 2
# The same, in lockstep as ranks of one job are (each step's collectives): after each
# batch a rank waits until every rank still reading has read as many (`argv[4]`, a
# directory, holds each rank's count; a rank that ends, or fails, is "done").
LOCKSTEP_SAMPLE_RANK = textwrap.dedent(
    f"""
    import json, os, sys, time
    import shardcache
    rank, world, epochs = (int(x) for x in sys.argv[1:4])
    steps = sys.argv[4]

    def mark(value):
        tmp = os.path.join(steps, f"{{rank}}.tmp")
        with open(tmp, "w") as f:
            f.write(value)
        os.replace(tmp, os.path.join(steps, str(rank)))

    def barrier(n):
        mark(str(n))
        while True:
            counts = []
            for other in range(world):
                try:
                    with open(os.path.join(steps, str(other))) as f:
                        counts.append(f.read())
                except FileNotFoundError:
                    counts.append("0")
            if all(c == "done" or int(c) >= n for c in counts):
                return
            time.sleep(0.002)

    streams, n = [], 0
    try:
        with shardcache.open(rank=rank, world_size=world, seed={SEED}, block_size={BLOCK},
                             shuffle="sample", window={WINDOW}, gather_threads=2) as ds:
            for epoch in range(epochs):
                ds.set_epoch(epoch)
                stream = []
                for b in ds.batches({BATCH}):
                    stream.extend(b.column("uid").to_pylist())
                    n += 1
                    barrier(n)
                streams.append(stream)
    finally:
        mark("done")
    print(json.dumps(streams))
    """
)


def sample_reference(uri: str, cache: Path, rank: int, world: int, epochs: int) -> list[list[int]]:
    return reference(
        uri, cache, rank, world, epochs, shuffle="sample", window=WINDOW, gather_threads=0
    )


def window_bytes(
    uri: str, cache: Path, world: int, epochs: int, span: int, *, first_only: bool = False
) -> tuple[list[int], list[int]]:
    """Decoded bytes of each shard, and the most bytes of `span` consecutive windows
    (their shards, each once) of each rank over `epochs` (or from its first window)."""
    with shardcache.open(uri, cache_dir=cache, shuffle=False) as ds:
        for _ in ds.batches(1000):
            pass
        m = ds.manifest
    sizes = [(cache / "mem" / m.decoded_key(s)).stat().st_size for s in range(len(m.shards))]
    largest = [
        max(
            sum(sizes[s] for s in {s for w in wins[i : i + span] for s in w.shards})
            for epoch in range(epochs)
            for wins in [
                windows.rank_windows(
                    m.shard_rows,
                    m.digest,
                    plans.PlanParams(
                        seed=SEED,
                        epoch=epoch,
                        rank=rank,
                        world_size=world,
                        block_size=BLOCK,
                        granularity="sample",
                        window=WINDOW,
                    ),
                )
            ]
            for i in range(1 if first_only else len(wins))
        )
        for rank in range(world)
    ]
    return sizes, largest


def run_ranks(
    script: str,
    env: Mapping[str, str],
    k: int,
    epochs: int,
    timeout: float,
    *args: str,
    context: Callable[[], str] | None = None,
) -> list[tuple[int, str, str]]:
    """(exit status, stdout, stderr) of each of k rank processes run at once, with the
    variables `env` besides this process's. Past `timeout` (all ranks together) every
    rank still running dumps its threads' stacks (faulthandler, on SIGABRT) and the
    test fails with each rank's stderr and `context()` (the sidecar's log)."""
    env = {**os.environ, **env}
    # faulthandler: SIGABRT prints every thread's stack (see `stuck_ranks`).
    python = [sys.executable, "-X", "faulthandler", "-c", script]
    ranks = [
        subprocess.Popen(
            [*python, str(rank), str(k), str(epochs), *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(k)
    ]
    deadline = time.monotonic() + timeout
    done = []
    try:
        for p in ranks:
            try:
                out, err = p.communicate(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(stuck_ranks(ranks, timeout, context), pytrace=False)
            done.append((p.returncode, out, err))
    finally:
        for p in ranks:
            p.kill()
            p.wait()
            for pipe in (p.stdout, p.stderr):
                if pipe is not None:
                    pipe.close()
    return done


def stuck_ranks(
    ranks: list[subprocess.Popen[str]], timeout: float, context: Callable[[], str] | None
) -> str:
    """What each rank was doing when `run_ranks` gave up on them."""
    for p in ranks:
        if p.poll() is None:
            p.send_signal(signal.SIGABRT)
    parts = [f"the ranks were not done within {timeout:.0f} s"]
    for rank, p in enumerate(ranks):
        try:
            _, err = p.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            err = "(no stack: it did not die on SIGABRT)"
        except ValueError:
            err = "(done; its output was read)"
        parts.append(f"-- rank {rank} (exit {p.returncode}), stderr:\n{(err or '')[-4000:]}")
    if context is not None:
        parts.append(context())
    return "\n".join(parts)


def test_k_sample_mode_ranks_read_every_row_once_while_a_small_memory_tier_evicts(
    sidecar_factory: Factory, tmp_path: Path
) -> None:
    k, epochs = 3, 2
    # A rank leases at most the window it reads and the next, gathering ahead too
    # (`Dataset._selections`): the windows always fit, and the dataset does not.
    uri, sizes, largest = sample_dataset(tmp_path, k, epochs)
    limit = room_for_every_window(sizes, largest)
    proc = sidecar_factory(uri, args=["--memory-limit", str(limit), "--ready-shards", "0"])
    proc.start()
    read_every_row_once(
        proc,
        SAMPLE_RANK,
        k,
        epochs,
        sum(SAMPLE_ROWS),
        limit,
        lambda rank: sample_reference(uri, tmp_path / "ref", rank, k, epochs),
    )


def test_a_memory_tier_too_small_for_the_sample_ranks_windows_is_said_at_once(
    sidecar_factory: Factory, tmp_path: Path
) -> None:
    """Ranks in lockstep, each holding its window while it waits for the others: before,
    the rank left without room waited for room the others held until the memory tier's
    wait ran out (five minutes, then a message about leases)."""
    k, epochs = 4, 1
    uri, sizes, largest = sample_dataset(tmp_path, k, epochs)
    limit = room_for_one_ranks_windows(uri, tmp_path, k, epochs, sizes, largest)
    proc = sidecar_factory(uri, args=["--memory-limit", str(limit), "--ready-shards", "0"])
    proc.start()
    told_at_once(
        LOCKSTEP_SAMPLE_RANK,
        proc.client_env(),
        uri,
        tmp_path,
        k,
        epochs,
        limit,
        "shardcache.errors.CacheError: sidecar: shard ",
        "spec.sharding.window",
        context=lambda: f"-- the sidecar's log:\n{proc.log_tail(60)}",
    )
    # The sidecar serves on: a block-mode rank reads every row.
    [(code, out, err)] = run_ranks(RANK, proc.client_env(), 1, 1, timeout=120)
    assert code == 0, err[-3000:]
    assert sorted(json.loads(out)[0]) == list(range(sum(SAMPLE_ROWS)))


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


# The same ranks without a sidecar: each process runs its own embedded cache, and all
# of them share one cache directory (a launcher's ranks on one machine calling
# `shardcache.open()`); the dataset, directory and memory limit come from the
# environment.
EMBEDDED_OPEN = (
    'shardcache.open(os.environ["RANK_URI"], cache_dir=os.environ["RANK_CACHE"], '
    'memory_limit=int(os.environ["RANK_LIMIT"]), rank=rank,'
)
EMBEDDED_SAMPLE_RANK = SAMPLE_RANK.replace("import json, sys", "import json, os, sys").replace(
    "shardcache.open(rank=rank,", EMBEDDED_OPEN
)
EMBEDDED_LOCKSTEP_SAMPLE_RANK = LOCKSTEP_SAMPLE_RANK.replace(
    "shardcache.open(rank=rank,", EMBEDDED_OPEN
)


def claims_left(cache: Path) -> list[str]:
    """Window claims files still in the shared memory tier (`window_claims`)."""
    return sorted(p.name for p in (cache / "mem" / ".windows").glob("*.json"))


def test_embedded_sample_ranks_sharing_a_cache_directory_read_every_row_once(
    tmp_path: Path,
) -> None:
    """Each process counts the others' windows too: where they all fit, none is refused."""
    k, epochs = 3, 2
    uri, sizes, largest = sample_dataset(tmp_path, k, epochs)
    limit = room_for_every_window(sizes, largest)
    cache = tmp_path / "shared"
    env = {"RANK_URI": uri, "RANK_CACHE": str(cache), "RANK_LIMIT": str(limit)}
    done = run_ranks(EMBEDDED_SAMPLE_RANK, env, k, epochs, 240)
    each_read_its_plan(
        done,
        epochs,
        sum(SAMPLE_ROWS),
        lambda rank: sample_reference(uri, tmp_path / "ref", rank, k, epochs),
    )
    assert claims_left(cache) == []


def test_embedded_sample_ranks_whose_windows_do_not_fit_their_shared_tier_are_told_at_once(
    tmp_path: Path,
) -> None:
    """Before, each process counted its own readers' windows only, which fit: ranks in
    lockstep waited for each other's room until the memory tier's wait ran out (five
    minutes)."""
    k, epochs = 4, 1
    uri, sizes, largest = sample_dataset(tmp_path, k, epochs)
    limit = room_for_one_ranks_windows(uri, tmp_path, k, epochs, sizes, largest)
    cache = tmp_path / "shared"
    told_at_once(
        EMBEDDED_LOCKSTEP_SAMPLE_RANK,
        {"RANK_URI": uri, "RANK_CACHE": str(cache), "RANK_LIMIT": str(limit)},
        uri,
        tmp_path,
        k,
        epochs,
        limit,
        "shardcache.errors.CacheError: shard ",
        "reader(s) of other processes sharing the memory tier",
    )
    assert claims_left(cache) == []
