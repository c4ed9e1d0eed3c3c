"""Faults around the sidecar: SIGKILL and restart mid-epoch, a trainer killed with -9.

Real processes throughout: MinIO as the source, `shardcache sidecar` as a subprocess,
and for the trainer-death test a trainer subprocess.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

import shardcache
from shardcache import plans, sidecar_client
from tests.support import datasets, waiting
from tests.support.locks import exclusively_lockable
from tests.support.s3server import S3Server
from tests.support.sidecar import SidecarProcess

pytestmark = pytest.mark.integration

SHARDS = [400, 350, 0, 420, 380, 300, 410, 390]
BLOCK = 64
BATCH = 48
SEED = 11

Factory = Callable[..., SidecarProcess]


@pytest.fixture
def s3_dataset(s3_server: S3Server, s3_bucket: str) -> tuple[str, pa.Table]:
    table = datasets.write_dataset(s3_server.filesystem(), f"{s3_bucket}/ds", SHARDS)
    return f"s3://{s3_bucket}/ds", table


def uids(batch: pa.RecordBatch) -> list[int]:
    return list(batch.column("uid").to_pylist())


def reference(
    uri: str, s3_server: S3Server, cache: Path, epochs: int
) -> tuple[list[list[int]], int]:
    """The uninterrupted stream per epoch (embedded mode), and the largest decoded shard."""
    with shardcache.open(
        uri, seed=SEED, block_size=BLOCK, cache_dir=cache, storage_options=s3_server.env()
    ) as ds:
        streams = []
        for epoch in range(epochs):
            ds.set_epoch(epoch)
            streams.append([u for b in ds.batches(BATCH) for u in uids(b)])
    largest = max(p.stat().st_size for p in (cache / "mem").iterdir() if "." not in p.name)
    return streams, largest


def sidecar_args(memory_limit: int) -> list[str]:
    return [
        "--block-size", str(BLOCK),
        "--seed", str(SEED),
        "--memory-limit", str(memory_limit),
        "--prefetch-depth", "2",
    ]  # fmt: skip


def test_sigkill_mid_epoch_and_restart_loses_and_repeats_no_row(
    s3_server: S3Server,
    s3_dataset: tuple[str, pa.Table],
    sidecar_factory: Factory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="shardcache.sidecar_client")
    uri, _ = s3_dataset
    want, largest = reference(uri, s3_server, tmp_path / "ref", epochs=2)
    assert sorted(want[0]) == sorted(want[1]) == list(range(sum(SHARDS)))
    # Room for about three decoded shards: the restarted sidecar must evict and fetch.
    proc = sidecar_factory(uri, env=s3_server.env(), args=sidecar_args(3 * largest + 1024))
    proc.start(wait="ready")
    for key, value in proc.client_env().items():
        monkeypatch.setenv(key, value)

    restarted = threading.Event()

    def restart_later() -> None:
        # Only once the trainer has found the socket dead and is retrying.
        waiting.wait_until(
            "the trainer to find the killed sidecar not answering",
            lambda: any("is not answering" in r.getMessage() for r in caplog.records),
        )
        proc.start(wait="none")
        restarted.set()

    got: list[list[int]] = []
    with shardcache.open(seed=SEED, block_size=BLOCK) as ds:
        stream: list[int] = []
        for i, batch in enumerate(ds.batches(BATCH)):
            stream += uids(batch)
            if i == 12:  # mid-epoch, mid-shard
                proc.kill(signal.SIGKILL)
                assert proc.socket_path.exists()  # a stale socket the restart must clear
                threading.Thread(target=restart_later, daemon=True).start()
        got.append(stream)
        assert restarted.wait(60), proc.log_tail()
        ds.set_epoch(1)
        got.append([u for b in ds.batches(BATCH) for u in uids(b)])
    assert got == want
    # The trainer really met the dead sidecar, waited, and registered its reader again.
    messages = [r.getMessage() for r in caplog.records]
    assert any("is not answering" in m for m in messages), messages
    assert any("registering again" in m for m in messages), messages
    status = proc.control("GET", "/v1/status")[1]
    # The restarted sidecar had to bring shards into memory again: a real recovery.
    assert status["stats"]["misses"]["memory"] > 0
    assert proc.stop() == 0
    assert not proc.socket_path.exists()


def test_a_shard_the_trainer_holds_survives_a_sidecar_restart_under_memory_pressure(
    s3_server: S3Server,
    s3_dataset: tuple[str, pa.Table],
    sidecar_factory: Factory,
    tmp_path: Path,
) -> None:
    uri, table = s3_dataset
    _, largest = reference(uri, s3_server, tmp_path / "ref", epochs=1)
    proc = sidecar_factory(uri, env=s3_server.env(), args=sidecar_args(int(3.5 * largest)))
    proc.start(wait="ready")
    shards = sidecar_client.SidecarProvider.from_env(
        environ=proc.client_env(), reconnect_timeout=60
    )
    reader = shards.open_reader(plans.PlanParams(shuffle=False, block_size=BLOCK), position=0)
    held = shards.acquire(reader, 0, epoch=0, position=0)
    with pa.memory_map(str(held.path)) as mapped:
        batch = ipc.open_file(mapped).get_batch(0)

    proc.kill(signal.SIGKILL)
    proc.start(wait="ready")
    # Walk every other shard through the small memory tier: each needs evictions.
    for shard in range(1, len(SHARDS)):
        shards.acquire(reader, shard, epoch=0, position=0).release()
    stats = proc.control("GET", "/v1/status")[1]["stats"]
    assert stats["evictions"]["memory"] > 0
    assert held.path.exists() and not exclusively_lockable(held.lock_path)
    assert batch.to_pydict() == table.slice(0, SHARDS[0]).to_pydict()
    held.release()
    assert exclusively_lockable(held.lock_path)


TRAINER = textwrap.dedent(
    """
    import sys, time
    from shardcache import plans, sidecar_client
    shards = sidecar_client.SidecarProvider.from_env()
    reader = shards.open_reader(plans.PlanParams(shuffle=False), position=0)
    lease = shards.acquire(reader, 0, epoch=0, position=0)
    print(lease.lock_path, flush=True)
    time.sleep(600)
    """
)


def test_a_trainer_killed_with_sigkill_leaks_no_pin(
    s3_server: S3Server, s3_dataset: tuple[str, pa.Table], sidecar_factory: Factory
) -> None:
    proc = sidecar_factory(s3_dataset[0], env=s3_server.env())
    proc.start(wait="ready")
    with subprocess.Popen(
        [sys.executable, "-c", TRAINER],
        env={**os.environ, **proc.client_env()},
        stdout=subprocess.PIPE,
        text=True,
    ) as trainer:
        try:
            assert trainer.stdout is not None
            line = trainer.stdout.readline().strip()
            assert line, f"the trainer exited with {trainer.poll()} before acquiring"
            lock = Path(line)
            assert not exclusively_lockable(lock)
            assert proc.holds_drain() == 0  # only the trainer's own lock pins it
        finally:
            trainer.kill()
            trainer.wait(timeout=30)
    assert exclusively_lockable(lock)
