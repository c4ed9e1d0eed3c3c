"""A memory tier whose volume fills up below the tier's limit still serves every row.

The tier's limit counts its files, but a reader keeps the shard it just released mapped
(zero-copy slices of a batch that spans two shards) until its next acquire returns, so
an evicted file's pages stay in the volume. A volume exactly as big as the tier's limit
(what the webhook used to make) then fills below the limit, and the next decode failed
with ENOSPC as an internal error: what the node tier's `test_limits.py` found on a real
pod, reproduced here without a cluster on real tmpfs mounts.

Two fixes, one test each: the webhook sizes the volume with headroom over the tier
(`pod_volumes.run_volume_bytes`), and the tier treats ENOSPC as "no room yet": it evicts
one more unleased entry, or waits for readers to unmap, or (readahead) backs off.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from shardcache_operator import pod_volumes

import shardcache
from shardcache import contract, errors, plans, sidecar_client
from shardcache.node import tiers
from tests.support import datasets
from tests.support.sidecar import SidecarProcess

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root"),
]

KiB = 1 << 10
#: Eight shards of ~1 MiB decoded each through a 4 MiB tier: it evicts all epoch long.
SHARDS = [15_000] * 8
TIER_BYTES = 4 << 20
BLOCK = 1024
SEED = 3
#: Batches span shard boundaries, so a reader holds slices of the previous shard.
BATCH = 4096


@contextlib.contextmanager
def tmpfs(path: Path, size: int) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


@pytest.mark.timeout(240)
def test_a_cold_epoch_through_a_run_volume_sized_like_the_webhook_serves_every_row(
    sidecar_factory: Callable[..., SidecarProcess], tmp_path: Path
) -> None:
    root = tmp_path / "ds"
    datasets.write_dataset(pafs.LocalFileSystem(), str(root), SHARDS)
    total = sum(SHARDS)
    proc = sidecar_factory(
        f"file://{root}",
        env={
            contract.ENV_MEMORY_LIMIT: str(TIER_BYTES),
            contract.ENV_PREFETCH_DEPTH: "2",
        },
        args=["--block-size", str(BLOCK)],
    )
    with tmpfs(proc.run_dir, pod_volumes.run_volume_bytes(TIER_BYTES)):
        try:
            proc.start(wait="ready")
            shards = sidecar_client.SidecarProvider.from_env(
                environ=proc.client_env(), reconnect_timeout=10.0
            )
            ds = shardcache.Dataset(shards, plans.PlanParams(seed=SEED, block_size=BLOCK))
            seen: list[int] = []
            try:
                for epoch in range(2):
                    ds.set_epoch(epoch)
                    seen += [u for b in ds.batches(BATCH) for u in b.column("uid").to_pylist()]
            finally:
                ds.close()
            stats = proc.control("GET", "/v1/status")[1]["stats"]
        finally:
            proc.kill()
        log = proc.log_tail(2000)
    # Every row of both epochs, exactly once each: nothing failed, nothing repeated.
    assert sorted(seen) == sorted(list(range(total)) * 2)
    assert stats["evictions"]["memory"] > 0  # the bound was exercised
    assert "internal error" not in log, log


def _produce(size: int) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        with path.open("r+b") as f:
            f.write(b"x" * size)

    return write


@contextlib.contextmanager
def mapped_then_evicted(tier: tiers.Tier, key: str, size: int) -> Iterator[mmap.mmap]:
    """An entry a reader still maps after releasing it and eviction unlinked it: its
    pages stay in the volume while the tier no longer counts them."""
    entry = tier.insert(key, size, _produce(size))
    with entry.path.open("rb") as f:
        view = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    entry.release()
    assert tier.evict(key)
    try:
        yield view
    finally:
        view.close()


def test_enospc_below_the_tier_limit_evicts_one_more_unleased_entry(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "v", 1024 * KiB) as volume:
        tier = tiers.Tier(volume, limit_bytes=1024 * KiB, name="memory", fsync=False)
        with mapped_then_evicted(tier, "a" * 64, 400 * KiB):
            tier.insert("c" * 64, 300 * KiB, _produce(300 * KiB)).release()
            # 700 KiB by the tier's count, 1100 KiB in the volume: ENOSPC, then c goes.
            entry = tier.insert("b" * 64, 400 * KiB, _produce(400 * KiB))
            entry.release()
        assert tier.keys() == ["b" * 64]


def test_enospc_with_every_entry_leased_waits_for_the_reader_to_unmap(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "v", 1024 * KiB) as volume:
        tier = tiers.Tier(
            volume, limit_bytes=1024 * KiB, name="memory", fsync=False, wait_timeout=30.0
        )
        with mapped_then_evicted(tier, "a" * 64, 600 * KiB) as view:
            # Readahead does not wait: the volume is full for now.
            with pytest.raises(tiers.TierFullError, match="out of space"):
                tier.insert("b" * 64, 600 * KiB, _produce(600 * KiB), evict=False)
            threading.Timer(0.5, view.close).start()  # the reader moves on
            started = time.monotonic()
            tier.insert("b" * 64, 600 * KiB, _produce(600 * KiB)).release()
            assert time.monotonic() - started >= 0.4
        assert tier.keys() == ["b" * 64]


def test_enospc_that_outlasts_the_wait_names_the_volume_and_the_setting(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "v", 1024 * KiB) as volume:
        tier = tiers.Tier(
            volume, limit_bytes=1024 * KiB, name="memory", fsync=False, wait_timeout=0.3
        )
        with mapped_then_evicted(tier, "a" * 64, 600 * KiB):
            with pytest.raises(errors.CacheError, match=contract.ENV_MEMORY_LIMIT) as caught:
                tier.insert("b" * 64, 600 * KiB, _produce(600 * KiB))
        assert "stayed out of space" in str(caught.value)
        assert not any(p.name.startswith(".tmp-") for p in volume.iterdir())  # no leftovers
