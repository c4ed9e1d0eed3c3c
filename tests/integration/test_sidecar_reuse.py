"""The warm path of sidecar mode: a shard handed over before is pinned without asking.

Against a real `shardcache sidecar` process (file:// source). Round trips are counted
with the sidecar's own request metric, memory hits with its status document; entries
are evicted from the test through a `Tier` on the sidecar's memory directory, the way
another process on the node would.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest

import shardcache
from shardcache import plans, sidecar_client
from shardcache.contract import protocol
from shardcache.node import tiers
from tests.support import datasets
from tests.support.locks import exclusively_lockable
from tests.support.sidecar import SidecarProcess

pytestmark = pytest.mark.integration

SHARDS = [300, 0, 170, 512, 45, 260]
NONEMPTY = sum(1 for rows in SHARDS if rows)
BLOCK = 64
SEED = 5
ACQUIRE = protocol.acquire_path("{reader_id}")
PINNED = protocol.pinned_path("{reader_id}")
NOTES = protocol.notes_path("{reader_id}")

Factory = Callable[..., SidecarProcess]


@pytest.fixture
def dataset(tmp_path: Path) -> str:
    root = tmp_path / "ds"
    datasets.write_dataset(pafs.LocalFileSystem(), str(root), SHARDS)
    return f"file://{root}"


def provider(proc: SidecarProcess, **kwargs: Any) -> sidecar_client.SidecarProvider:
    kwargs.setdefault("reconnect_timeout", 10.0)
    return sidecar_client.SidecarProvider.from_env(environ=proc.client_env(), **kwargs)


def uids(ds: shardcache.Dataset, batch_size: int = 50) -> list[int]:
    return [u for b in ds.batches(batch_size) for u in b.column("uid").to_pylist()]


def embedded(uri: str, cache: Path, epochs: int) -> list[list[int]]:
    with shardcache.open(uri, seed=SEED, block_size=BLOCK, cache_dir=cache) as ds:
        streams = []
        for epoch in range(epochs):
            ds.set_epoch(epoch)
            streams.append(uids(ds))
    return streams


def requests(proc: SidecarProcess, route: str) -> int:
    """Answered (200) control requests on `route`, from the sidecar's /metrics."""
    status, text = proc.http_get("/metrics")
    assert status == 200
    total = 0
    for line in text.splitlines():
        if line.startswith("shardcache_control_requests_total{") and (
            f'route="{route}"' in line and 'status="200"' in line
        ):
            total += int(float(line.rsplit(" ", 1)[1]))
    return total


def memory_hits(proc: SidecarProcess) -> int:
    return int(proc.control("GET", protocol.STATUS)[1]["stats"]["hits"]["memory"])


def metric_memory_hits(proc: SidecarProcess) -> int:
    """The memory tier's hits as /metrics counts them."""
    status, text = proc.http_get("/metrics")
    assert status == 200
    (line,) = [
        line
        for line in text.splitlines()
        if line.startswith('shardcache_cache_hits_total{tier="memory"}')
    ]
    return int(float(line.rsplit(" ", 1)[1]))


def eventually(probe: Callable[[], bool], timeout: float = 20.0) -> bool:
    """Polls `probe` until true or `timeout`: notifications reach the sidecar shortly
    after the pin, off the read path."""
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def evict(proc: SidecarProcess, key: str) -> bool:
    memory = tiers.Tier(
        proc.memory_dir, limit_bytes=1 << 40, name="memory", fsync=False, verify="never"
    )
    return memory.evict(key)


def acquired_at(runs: list[plans.Run]) -> list[tuple[int, int]]:
    """(shard, position) of every acquire a `Dataset` makes over `runs`."""
    out: list[tuple[int, int]] = []
    position = 0
    for run in runs:
        if not out or out[-1][0] != run.shard:
            out.append((run.shard, position))
        position += len(run)
    return out


def test_the_acquire_answer_says_the_entry_may_be_reused(
    sidecar_factory: Factory, dataset: str
) -> None:
    proc = sidecar_factory(dataset, args=["--block-size", str(BLOCK)])
    proc.start(wait="ready")
    body = {**protocol.params_to_json(plans.PlanParams(block_size=BLOCK)), "position": 0}
    assert proc.control("PUT", protocol.reader_path("r"), body)[0] == 200
    status, answer = proc.control(
        "POST", protocol.acquire_path("r"), {"shard": 0, "epoch": 0, "position": 0}
    )
    assert status == 200 and answer["reuse"] is True  # the memory tier verifies no sha256
    proc.control("DELETE", protocol.lease_path(answer["lease"]))


def test_a_second_epoch_pins_every_warm_shard_without_an_acquire_round_trip(
    sidecar_factory: Factory, dataset: str, tmp_path: Path
) -> None:
    want = embedded(dataset, tmp_path / "ref", epochs=2)
    proc = sidecar_factory(dataset, args=["--block-size", str(BLOCK)])
    proc.start(wait="ready")
    shards = provider(proc)
    ds = shardcache.Dataset(shards, plans.PlanParams(seed=SEED, block_size=BLOCK))
    assert uids(ds) == want[0]
    # A shard's runs are contiguous in a plan: at most one acquire per shard, fewer
    # where the sidecar granted the next shards ahead (none at all when the
    # registration was answered with every shard: feature `open_ahead`).
    first_epoch = requests(proc, ACQUIRE)
    assert 0 <= first_epoch <= NONEMPTY
    assert shards.flush()
    hits, counted = memory_hits(proc), metric_memory_hits(proc)
    keys = [shards.manifest.decoded_key(i) for i, rows in enumerate(SHARDS) if rows]
    used = {key: (proc.memory_dir / key).stat().st_mtime_ns for key in keys}

    ds.set_epoch(1)
    assert uids(ds) == want[1]
    assert requests(proc, ACQUIRE) == first_epoch  # not one more round trip
    # Marked used for the LRU, as the sidecar's lookup would have.
    assert all((proc.memory_dir / key).stat().st_mtime_ns > used[key] for key in keys)
    assert shards.flush()
    # Each direct pin still counts as the memory hit an acquire would have been (told
    # in batches: `notes`, not one `pinned` request each).
    assert memory_hits(proc) == hits + NONEMPTY
    assert metric_memory_hits(proc) == counted + NONEMPTY
    assert requests(proc, PINNED) == 0 and requests(proc, NOTES) >= 1
    # And the sidecar's view of the reader followed it to the last shard it took.
    _, last_position = acquired_at(ds.runs())[-1]
    (reader,) = shards.status()["readers"]
    assert (reader["epoch"], reader["position"]) == (1, last_position)
    assert proc.holds_drain() == 0  # no hold was made for the direct pins
    ds.close()
    assert proc.control("GET", protocol.STATUS)[1]["readers"] == []


def test_prefetch_follows_a_reader_that_pinned_a_shard_itself(
    sidecar_factory: Factory, dataset: str
) -> None:
    # Prefetch the current shard and the next one; the startup plan warms shard 0 only.
    args = ["--prefetch-depth", "1", "--ready-shards", "1", "--no-shuffle"]
    proc = sidecar_factory(dataset, args=[*args, "--block-size", str(BLOCK)])
    proc.start(wait="ready")
    # No grants ahead: the next shard must stay the sidecar's to evict.
    shards = provider(proc, ahead=0)
    params = plans.PlanParams(shuffle=False, block_size=BLOCK)
    reader = shards.open_reader(params, position=0)
    runs = plans.rank_runs(shards.manifest.shard_rows, shards.manifest.digest, params)
    first, after = plans.upcoming_shards(runs, 0)[:2]
    key = shards.manifest.decoded_key(after)
    shards.acquire(reader, first, epoch=0, position=0).release()  # a round trip
    # The release goes in a later batch of notes, and a note moves the reader too (so
    # prefetch follows it): delivered now, it cannot bring the shard back after the
    # eviction below.
    assert shards.flush()
    # The acquire moved the reader, so the next shard is prefetched; take it away again.
    assert eventually(lambda: (proc.memory_dir / key).exists())
    assert eventually(lambda: evict(proc, key))
    assert not (proc.memory_dir / key).exists()
    # The sidecar is its memory tier's only writer and keeps which entries it holds in
    # memory (`tiers._membership`); removed behind its back, as here in place of its own
    # eviction, an entry is seen gone at its next lookup of it or its next listing of
    # the tier. The status route lists it (its stats): the prefetch below sees it gone.
    memory_hits(proc)

    lease = shards.acquire(reader, first, epoch=1, position=0)
    assert requests(proc, ACQUIRE) == 1  # pinned directly
    # The notification moved the reader, and prefetch went on from there.
    assert eventually(lambda: (proc.memory_dir / key).exists())
    (state,) = shards.status()["readers"]
    assert (state["epoch"], state["position"]) == (1, 0)
    lease.release()
    shards.close()


def test_an_evicted_entry_falls_back_to_the_round_trip_and_yields_the_same_stream(
    sidecar_factory: Factory, dataset: str, tmp_path: Path
) -> None:
    want = embedded(dataset, tmp_path / "ref", epochs=2)
    # Prefetch only the shard a reader is at, so an evicted shard stays out until its
    # own acquire asks for it.
    args = ["--prefetch-depth", "0", "--ready-shards", "1", "--block-size", str(BLOCK)]
    proc = sidecar_factory(dataset, args=args)
    proc.start(wait="ready")
    shards = provider(proc)
    ds = shardcache.Dataset(shards, plans.PlanParams(seed=SEED, block_size=BLOCK))
    assert uids(ds) == want[0]
    # Every shard is an acquire, except the reader's first when it is the ready shard:
    # then the registration itself grants it (wire feature `open_ahead`).
    first_epoch = requests(proc, ACQUIRE)
    assert NONEMPTY - 1 <= first_epoch <= NONEMPTY

    ds.set_epoch(1)
    order = [shard for shard, _ in acquired_at(ds.runs())]
    gone = [order[1], order[3]]
    # The sidecar's hand-over holds go off the read path: wait for them to go.
    assert shards.flush() and proc.holds_drain() == 0
    for shard in gone:
        assert evict(proc, shards.manifest.decoded_key(shard))
    assert uids(ds) == want[1]
    assert requests(proc, ACQUIRE) == first_epoch + len(gone)
    ds.close()


TRAINER = textwrap.dedent(
    """
    import sys, time
    from shardcache import plans, sidecar_client
    shards = sidecar_client.SidecarProvider.from_env()
    reader = shards.open_reader(plans.PlanParams(shuffle=False), position=0)
    shards.acquire(reader, 0, epoch=0, position=0).release()
    print("handed", flush=True)
    sys.stdin.readline()
    lease = shards.acquire(reader, 0, epoch=1, position=0)
    print(lease.lock_path, flush=True)
    time.sleep(600)
    """
)


def test_a_direct_pin_blocks_eviction_and_dies_with_the_trainer(
    sidecar_factory: Factory, tmp_path: Path
) -> None:
    # Equal shards and room for about two: reading the others forces evictions.
    rows = [200] * 6
    root = tmp_path / "eq"
    datasets.write_dataset(pafs.LocalFileSystem(), str(root), rows)
    uri = f"file://{root}"
    embedded(uri, tmp_path / "ref", epochs=1)
    size = max(p.stat().st_size for p in (tmp_path / "ref" / "mem").iterdir() if "." not in p.name)
    args = ["--memory-limit", str(int(2.5 * size)), "--prefetch-depth", "0"]
    proc = sidecar_factory(uri, args=[*args, "--ready-shards", "1"])
    proc.start(wait="ready")
    with subprocess.Popen(
        [sys.executable, "-c", TRAINER],
        env={**os.environ, **proc.client_env()},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as trainer:
        try:
            assert trainer.stdin is not None and trainer.stdout is not None
            assert trainer.stdout.readline().strip() == "handed", trainer.poll()
            round_trips = requests(proc, ACQUIRE)
            trainer.stdin.write("\n")
            trainer.stdin.flush()
            line = trainer.stdout.readline().strip()
            assert line, f"the trainer exited with {trainer.poll()} before pinning again"
            lock = Path(line)
            data = lock.with_name(lock.name.removesuffix(".lock"))
            inode = data.stat().st_ino
            assert requests(proc, ACQUIRE) == round_trips  # pinned without asking
            assert not exclusively_lockable(lock)
            # The sidecar walks every other shard through a memory tier with room for
            # about two: it must evict, and cannot take the pinned one.
            shards = provider(proc)
            reader = shards.open_reader(plans.PlanParams(shuffle=False), position=0)
            for shard in range(1, len(rows)):
                shards.acquire(reader, shard, epoch=0, position=0).release()
            assert shards.status()["stats"]["evictions"]["memory"] > 0
            assert data.stat().st_ino == inode and not exclusively_lockable(lock)
            shards.close()
        finally:
            trainer.kill()
            trainer.wait(timeout=30)
    assert exclusively_lockable(lock)


def test_the_pinned_route_refuses_bad_requests(sidecar_factory: Factory, dataset: str) -> None:
    proc = sidecar_factory(dataset, args=["--block-size", str(BLOCK)])
    proc.start(wait="ready")
    body = {**protocol.params_to_json(plans.PlanParams(block_size=BLOCK)), "position": 0}
    assert proc.control("PUT", protocol.reader_path("r"), body)[0] == 200
    good = {"shard": 0, "epoch": 0, "position": 0}
    cases: list[tuple[str, Any, int, str, str]] = [
        ("nobody", good, 404, protocol.CODE_UNKNOWN_READER, "unknown reader 'nobody'"),
        ("r", {**good, "shard": 6}, 400, protocol.CODE_UNKNOWN_SHARD, "out of range"),
        ("r", {**good, "shard": -1}, 400, protocol.CODE_UNKNOWN_SHARD, "out of range"),
        ("r", {"epoch": 0, "position": 0}, 400, protocol.CODE_BAD_REQUEST, "field 'shard'"),
        ("r", {**good, "position": -3}, 400, protocol.CODE_BAD_REQUEST, "field 'position'"),
        ("r", [0], 400, protocol.CODE_BAD_REQUEST, "expected a JSON object"),
    ]
    for reader, payload, status, code, message in cases:
        got_status, got = proc.control("POST", protocol.pinned_path(reader), payload)
        assert (got_status, got["error"]["code"]) == (status, code), (reader, payload, got)
        assert message in got["error"]["message"], got
    got_status, got = proc.control("POST", protocol.pinned_path("r"), raw=b"{not json")
    assert (got_status, got["error"]["code"]) == (400, protocol.CODE_BAD_REQUEST)
    assert "request body is not JSON" in got["error"]["message"]
    # A good one moves the reader and counts a hit.
    hits = memory_hits(proc)
    answer = proc.control("POST", protocol.pinned_path("r"), {**good, "epoch": 2, "position": 7})
    assert answer == (200, {"reader": "r", "shard": 0, "epoch": 2, "position": 7})
    assert memory_hits(proc) == hits + 1
    (state,) = proc.control("GET", protocol.STATUS)[1]["readers"]
    assert (state["epoch"], state["position"]) == (2, 7)


def test_direct_pins_survive_a_sidecar_restart_between_epochs(
    sidecar_factory: Factory,
    dataset: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="shardcache.sidecar_client")
    want = embedded(dataset, tmp_path / "ref", epochs=2)
    proc = sidecar_factory(dataset, args=["--block-size", str(BLOCK)])
    proc.start(wait="ready")
    shards = provider(proc, reconnect_timeout=60.0)
    ds = shardcache.Dataset(shards, plans.PlanParams(seed=SEED, block_size=BLOCK))
    got = [uids(ds)]
    # SIGKILL and restart; the memory tier (the shared volume) stays.
    proc.kill(signal.SIGKILL)
    proc.start(wait="ready")
    ds.set_epoch(1)
    got.append(uids(ds))
    assert got == want
    # Every shard pinned directly: the new sidecar never answered an acquire...
    assert requests(proc, ACQUIRE) == 0
    # ...but heard of them, after its first notification re-registered the reader.
    assert shards.flush()
    assert requests(proc, NOTES) >= 1
    assert any(
        "registering again" in r.getMessage() and r.threadName == "shardcache-notifier"
        for r in caplog.records
    ), [r.getMessage() for r in caplog.records]
    (reader,) = shards.status()["readers"]
    assert reader["epoch"] == 1
    ds.close()
    # Unregistered after the notifications, which cannot bring it back.
    assert proc.control("GET", protocol.STATUS)[1]["readers"] == []
    assert proc.stop() == 0
