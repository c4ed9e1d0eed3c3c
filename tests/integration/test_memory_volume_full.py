"""A memory tier whose volume fills up below the tier's limit still serves every row.

The tier's limit counts its files, but a reader keeps the shard it just released mapped
(zero-copy slices of a batch that spans two shards) until its next acquire returns, so
an evicted file's pages stay in the volume. A volume exactly as big as the tier's limit
(what the webhook used to make) then fills below the limit, and the next decode failed
with ENOSPC as an internal error: what the node tier's `test_limits.py` found on a real
pod, reproduced here without a cluster on real tmpfs mounts.

Two fixes, one test each: the webhook sizes the volume with headroom over the tier
(`pod_volumes.run_volume_bytes`), and the tier treats ENOSPC as "no room yet": it evicts
unleased entries while that frees room, or waits for readers to unmap, or (readahead)
backs off.

And a reader must unmap: the acquire of a cold shard evicts the shards this reader read
and still maps, so it drops mappings of evicted files while its acquire waits, or the
insert waits for the very reader waiting on it (the mixed-shard tests below).
"""

from __future__ import annotations

import contextlib
import mmap
import os
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
from tests.support import datasets, mounts
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
    with mounts.tmpfs(proc.run_dir, pod_volumes.run_volume_bytes(TIER_BYTES)):
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
    with mounts.tmpfs(tmp_path / "v", 1024 * KiB) as volume:
        tier = tiers.Tier(volume, limit_bytes=1024 * KiB, name="memory", fsync=False)
        with mapped_then_evicted(tier, "a" * 64, 400 * KiB):
            tier.insert("c" * 64, 300 * KiB, _produce(300 * KiB)).release()
            # 700 KiB by the tier's count, 1100 KiB in the volume: ENOSPC, then c goes.
            entry = tier.insert("b" * 64, 400 * KiB, _produce(400 * KiB))
            entry.release()
        assert tier.keys() == ["b" * 64]


def test_enospc_with_every_entry_leased_waits_for_the_reader_to_unmap(tmp_path: Path) -> None:
    with mounts.tmpfs(tmp_path / "v", 1024 * KiB) as volume:
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
    with mounts.tmpfs(tmp_path / "v", 1024 * KiB) as volume:
        tier = tiers.Tier(
            volume, limit_bytes=1024 * KiB, name="memory", fsync=False, wait_timeout=0.3
        )
        with mapped_then_evicted(tier, "a" * 64, 600 * KiB):
            with pytest.raises(errors.CacheError, match=contract.ENV_MEMORY_LIMIT) as caught:
                tier.insert("b" * 64, 600 * KiB, _produce(600 * KiB))
        assert "stayed out of space" in str(caught.value)
        assert not any(p.name.startswith(".tmp-") for p in volume.iterdir())  # no leftovers


#: Small shards read first, then large ones: the acquire of the first large shard
#: evicts several small ones this reader read and still maps (least recently used).
MIXED_SHARDS = [2500] * 16 + [10000] * 6
#: Four large decoded shards (about 711 kB each).
MIXED_TIER_BYTES = 4 * 711_000
#: The webhook's headroom is a quarter of the tier, rounded up to whole MiB
#: (`run_volume_bytes`): exactly a quarter for a tier of GiBs. This small tier gets the
#: exact quarter too, as tight as a real pod's volume, not a whole MiB more.
MIXED_VOLUME_BYTES = MIXED_TIER_BYTES + MIXED_TIER_BYTES // 4
#: A batch far longer than the waits a stalled reader would show: the old code waited
#: the tier's whole `wait_timeout` (300 s) and then failed the epoch with CacheError.
STALL_S = 30.0


def _read_in_order(ds: shardcache.Dataset, what: str) -> list[int]:
    """Every uid of an epoch of `ds` in order, failing if any batch takes `STALL_S`."""
    uids: list[int] = []
    done = threading.Event()
    failure: list[BaseException] = []

    def read() -> None:
        try:
            for b in ds.batches(500):
                uids.extend(b.column("uid").to_pylist())
        except BaseException as exc:
            failure.append(exc)
        finally:
            done.set()

    threading.Thread(target=read, daemon=True).start()
    seen = -1
    while not done.wait(STALL_S):
        assert len(uids) != seen, f"{what}: no batch for {STALL_S:g} s after {len(uids)} rows"
        seen = len(uids)
    if failure:
        raise failure[0]
    return uids


@pytest.mark.timeout(120)
def test_a_reader_of_mixed_shard_sizes_through_a_sidecar_on_a_webhook_sized_volume_never_stalls(
    sidecar_factory: Callable[..., SidecarProcess], tmp_path: Path
) -> None:
    """The acquire of a cold large shard evicted the small shards the trainer still
    mapped; their pages kept the run volume full, and the sidecar waited for readers to
    unmap while the one reader waited on that acquire: 300 s, then CacheError."""
    uri, table = datasets.write_local(tmp_path / "ds", MIXED_SHARDS)
    proc = sidecar_factory(uri, env={contract.ENV_MEMORY_LIMIT: str(MIXED_TIER_BYTES)})
    with mounts.tmpfs(proc.run_dir, MIXED_VOLUME_BYTES):
        try:
            proc.start(wait="ready")
            shards = sidecar_client.SidecarProvider.from_env(
                environ=proc.client_env(), reconnect_timeout=10.0
            )
            ds = shardcache.Dataset(shards, plans.PlanParams(shuffle=False))
            try:
                uids = _read_in_order(ds, "a trainer through a sidecar")
            finally:
                ds.close()
        finally:
            proc.kill()
        log = proc.log_tail(2000)
    assert uids == table.column("uid").to_pylist()
    assert "stayed out of space" not in log, log
    # A wait, if one came at all, was logged once for its insert, not at every poll.
    waits = [line for line in log.splitlines() if "out of space for" in line]
    keys = [line.split("out of space for ")[1].split()[0] for line in waits]
    assert len(keys) == len(set(keys)), waits


@pytest.mark.timeout(120)
def test_an_embedded_reader_of_mixed_shard_sizes_on_a_tight_memory_volume_never_stalls(
    tmp_path: Path,
) -> None:
    uri, table = datasets.write_local(tmp_path / "ds", MIXED_SHARDS)
    volume = tmp_path / "shm"
    with mounts.tmpfs(volume, MIXED_VOLUME_BYTES):
        with shardcache.open(
            uri,
            cache_dir=tmp_path / "cache",
            memory_dir=volume,
            shuffle=False,
            memory_limit=MIXED_TIER_BYTES,
        ) as ds:
            uids = _read_in_order(ds, "an embedded reader")
    assert uids == table.column("uid").to_pylist()


def test_enospc_evicts_no_more_than_the_mapped_files_it_waits_for(tmp_path: Path) -> None:
    """Evicting entries a reader still maps frees nothing: the old code evicted one more
    at every retry, down to an empty tier, before it waited."""
    with mounts.tmpfs(tmp_path / "v", 1024 * KiB) as volume:
        tier = tiers.Tier(
            volume, limit_bytes=1024 * KiB, name="memory", fsync=False, wait_timeout=30.0
        )
        views = []
        for key in "abcd":
            entry = tier.insert(key * 64, 200 * KiB, _produce(200 * KiB))
            with entry.path.open("rb") as f:  # a reader maps every entry
                views.append(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ))
            entry.release()
        # 800 KiB of entries + 400 KiB: the limit takes one entry; the volume is full
        # while it stays mapped, and that one covers what is missing.
        threading.Timer(0.5, lambda: [v.close() for v in views]).start()
        tier.insert("e" * 64, 400 * KiB, _produce(400 * KiB)).release()
        assert sorted(tier.keys()) == ["b" * 64, "c" * 64, "d" * 64, "e" * 64]


def test_enospc_never_deletes_a_file_the_tier_did_not_make(tmp_path: Path) -> None:
    """A foreign file named like a key in the tier's directory (NCCL's `nccl-…` in
    /dev/shm) was deleted when the volume ran out of space."""
    with mounts.tmpfs(tmp_path / "v", 1024 * KiB) as volume:
        precious = volume / "precious"
        precious.write_bytes(b"y" * (300 * KiB))
        os.utime(precious, ns=(0, 0))  # the oldest file there
        tier = tiers.Tier(volume, limit_bytes=8 << 20, name="memory", fsync=False, wait_timeout=1)
        for i in range(4):
            with contextlib.suppress(errors.CacheError):
                tier.insert(f"k{i}", 300 * KiB, _produce(300 * KiB)).release()
        assert precious.read_bytes() == b"y" * (300 * KiB)
        assert tier.keys()  # the tier made its room from its own entries
