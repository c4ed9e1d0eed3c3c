"""The storage tier shared by real processes: crashes, leases, deduplication, the limit.

Workers are started with the spawn method, so each is a fresh interpreter that shares
nothing with the test but the tier directory, as two sidecars on one node do.
"""

from __future__ import annotations

import fcntl
import multiprocessing
import multiprocessing.context
import multiprocessing.queues
import multiprocessing.synchronize
import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from shardcache.node import names, tiers

pytestmark = pytest.mark.integration

KIB = 1024
SPAWN = multiprocessing.get_context("spawn")


def payload(key: str, size: int) -> bytes:
    return (key.encode() * (size // max(len(key), 1) + 1))[:size]


def wait_for(path: Path, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"worker did not create {path} in {timeout} s"
        time.sleep(0.01)


def start(target: Callable[..., object], *args: object) -> multiprocessing.context.SpawnProcess:
    process = SPAWN.Process(target=target, args=args, daemon=True)
    process.start()
    return process


def stop(process: multiprocessing.context.SpawnProcess, *, kill: bool = False) -> None:
    """Let a worker finish (or SIGKILL it first); a worker still alive after 20 s is killed."""
    if kill:
        process.kill()
    process.join(timeout=20)
    if process.is_alive():
        process.kill()
        process.join(timeout=20)


# --- workers (run in spawned processes) ----------------------------------------------
def _insert_then_hang(root: str, key: str, size: int, marker: str) -> None:
    t = tiers.Tier(Path(root), limit_bytes=1024 * KIB, name="disk")

    def produce(path: Path) -> None:
        with open(path, "wb") as f:
            f.write(payload(key, size)[: size // 2])
            f.flush()
            Path(marker).touch()
            time.sleep(60)  # killed here

    t.insert(key, size, produce)


def _lease_then_hang(root: str, key: str, marker: str) -> None:
    t = tiers.Tier(Path(root), limit_bytes=1024 * KIB, name="disk")
    entry = t.lookup(key)
    assert entry is not None
    Path(marker).touch()
    time.sleep(60)  # killed while holding the lease


def _get_or_insert(
    root: str,
    key: str,
    size: int,
    log: str,
    barrier: multiprocessing.synchronize.Barrier,
    results: multiprocessing.queues.Queue[tuple[int, bool, str, bytes]],
) -> None:
    t = tiers.Tier(Path(root), limit_bytes=1024 * KIB, name="disk")

    def produce(path: Path) -> None:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.5)  # long enough that the other process arrives while we produce
        path.write_bytes(payload(key, size))

    barrier.wait(timeout=20)
    entry, hit = t.get_or_insert(key, size, produce)
    with entry:
        results.put((os.getpid(), hit, entry.sha256, entry.path.read_bytes()))


def _insert_many(
    root: str,
    limit: int,
    prefix: str,
    count: int,
    seed: int,
    barrier: multiprocessing.synchronize.Barrier,
    results: multiprocessing.queues.Queue[tuple[str, int]],
) -> None:
    t = tiers.Tier(Path(root), limit_bytes=limit, name="disk", wait_timeout=30.0)
    rng = random.Random(seed)
    held: list[tiers.Entry] = []
    barrier.wait(timeout=20)
    for i in range(count):
        key = f"{prefix}{i}"
        size = rng.randrange(8 * KIB, 64 * KIB)

        def produce(path: Path, key: str = key, size: int = size) -> None:
            data = payload(key, size)
            with open(path, "wb") as f:
                for start in range(0, size, size // 4 + 1):
                    f.write(data[start : start + size // 4 + 1])
                    f.flush()
                    time.sleep(0.001)

        entry, _ = t.get_or_insert(key, size, produce)
        assert entry.path.read_bytes() == payload(key, size)
        held.append(entry)
        # Keep the previous lease while inserting the next, as a reader holding a shard
        # does; two workers can then pin at most half the limit, so neither starves.
        if len(held) > 1:
            held.pop(0).release()
    for entry in held:
        entry.release()
    results.put((prefix, count))


# --- tests -----------------------------------------------------------------------------
def test_sigkill_during_produce_leaves_no_entry_and_scan_removes_its_temp_file(
    tmp_path: Path,
) -> None:
    root = tmp_path / "disk"
    marker = tmp_path / "producing"
    worker = start(_insert_then_hang, str(root), "k1", 64 * KIB, str(marker))
    try:
        wait_for(marker)
        t = tiers.Tier(root, limit_bytes=1024 * KIB, name="disk")
        assert t.used_bytes() == 64 * KIB, "the reservation counts while producing"
        assert t.scan().removed_tmp == 0, "a live writer's temp file is left alone"
    finally:
        stop(worker, kill=True)
    assert worker.exitcode == -9

    leftovers = [p for p in root.iterdir() if p.name.startswith(names.TMP_PREFIX)]
    assert len(leftovers) == 1 and f"{names.TMP_PREFIX}{worker.pid}-" in leftovers[0].name
    assert not t.contains("k1")
    assert t.lookup("k1") is None
    assert t.keys() == []

    report = t.scan()
    assert report.removed_tmp == 1
    assert report.entries == 0
    assert [p for p in root.iterdir() if p.name.startswith(names.TMP_PREFIX)] == []
    assert t.used_bytes() == 0
    entry, hit = t.get_or_insert("k1", 64 * KIB, lambda p: p.write_bytes(payload("k1", 64 * KIB)))
    assert not hit
    entry.release()


def test_lease_held_by_a_killed_process_is_released_by_the_kernel(tmp_path: Path) -> None:
    root = tmp_path / "disk"
    t = tiers.Tier(root, limit_bytes=1024 * KIB, name="disk")
    t.insert("k1", 4 * KIB, lambda p: p.write_bytes(payload("k1", 4 * KIB))).release()
    marker = tmp_path / "leased"
    worker = start(_lease_then_hang, str(root), "k1", str(marker))
    try:
        wait_for(marker)
        assert t.leased_bytes() == 4 * KIB
        assert not t.evict("k1"), "another process's lease pins the entry"
    finally:
        stop(worker, kill=True)
    assert t.leased_bytes() == 0
    assert t.evict("k1")


def test_two_processes_getting_the_same_key_produce_it_once(tmp_path: Path) -> None:
    root = tmp_path / "disk"
    log = tmp_path / "produced.log"
    barrier = SPAWN.Barrier(2)
    results: multiprocessing.queues.Queue[tuple[int, bool, str, bytes]] = SPAWN.Queue()
    workers = [
        start(_get_or_insert, str(root), "shared", 32 * KIB, str(log), barrier, results)
        for _ in range(2)
    ]
    try:
        outcomes = [results.get(timeout=30) for _ in workers]
    finally:
        for worker in workers:
            stop(worker)
    assert [w.exitcode for w in workers] == [0, 0]
    assert len(log.read_text().splitlines()) == 1, "exactly one process produced the entry"
    assert sorted(hit for _, hit, _, _ in outcomes) == [False, True]
    assert len({sha for _, _, sha, _ in outcomes}) == 1
    assert all(data == payload("shared", 32 * KIB) for _, _, _, data in outcomes)


def _bytes_on_disk(root: Path) -> int:
    """Data and temp files actually in the directory, counted without the Tier class."""
    total = 0
    for item in os.scandir(root):
        if item.name.endswith((names.LOCK_SUFFIX, names.META_SUFFIX)):
            continue
        if item.is_dir(follow_symlinks=False):  # `.limits/`: the processes' limits
            continue
        try:
            total += item.stat(follow_symlinks=False).st_size
        except FileNotFoundError:
            continue
    return total


def test_byte_limit_holds_under_concurrent_inserts_from_two_processes(tmp_path: Path) -> None:
    root = tmp_path / "disk"
    limit = 256 * KIB
    t = tiers.Tier(root, limit_bytes=limit, name="disk")
    barrier = SPAWN.Barrier(2)
    results: multiprocessing.queues.Queue[tuple[str, int]] = SPAWN.Queue()
    workers = [
        start(_insert_many, str(root), limit, prefix, 40, seed, barrier, results)
        for prefix, seed in (("a", 1), ("b", 2))
    ]
    peaks = {"on_disk": 0, "used": 0}
    samples = 0
    done = threading.Event()

    def watch() -> None:
        nonlocal samples
        lock_path = root / tiers.TIER_LOCK_NAME
        while not done.is_set():
            # Changes that grow the tier happen under the tier lock (docs/cache-format.md);
            # a shared lock gives a consistent snapshot of the directory.
            fd = os.open(lock_path, os.O_RDONLY | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
                peaks["on_disk"] = max(peaks["on_disk"], _bytes_on_disk(root))
            finally:
                os.close(fd)
            peaks["used"] = max(peaks["used"], t.used_bytes())
            samples += 1
            time.sleep(0.001)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        finished = sorted(results.get(timeout=60) for _ in workers)
    finally:
        done.set()
        watcher.join(timeout=10)
        for worker in workers:
            stop(worker)
    assert finished == [("a", 40), ("b", 40)]
    assert [w.exitcode for w in workers] == [0, 0]
    assert samples > 20, "the watcher must have observed the inserts"
    assert peaks["on_disk"] <= limit, peaks
    assert peaks["used"] <= limit, peaks
    # The tier was actually under pressure (eviction happened), so the bound was tested.
    assert peaks["on_disk"] > limit // 2, peaks
    assert len(t.keys()) < 80
    assert t.resident_bytes() <= limit
