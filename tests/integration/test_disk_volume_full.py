"""A node disk tier on a nearly full volume serves every row; a full disk is never the
store's failure.

The disk tier's fetch wrote its temp file inside the retried store read, so ENOSPC on a
volume other files filled was retried as a flaky store for a minute, then reached the
trainer as `SourceError ... kind=source` and counted as a fetch failure, while the tier
held unleased entries it could have evicted (the resource-limits explorer's D4: one
reader got 6 of 48 shards). Now the write's ENOSPC goes to the tier, which evicts its own
least recently used entries as it does for its inserts (`tiers._no_space`); and the
sidecar clamps its disk limit (a fixed 50 GiB by default) to the volume's size at start.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pyarrow.fs as pafs
import pytest

import shardcache
from shardcache import contract, errors, manifests, plans, sidecar_client
from shardcache.node import caches
from tests.support import datasets, mounts
from tests.support.sidecar import SidecarProcess

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root"),
]

MiB = 1 << 20
#: 16 shards of about 1.2 MB of source each: about 20 MB through 8 MB of free room.
SHARDS = [40_000] * 16
VOLUME = 16 * MiB
#: Another program's file on the node volume: what the tier may not evict.
FILLER = 8 * MiB


@pytest.mark.timeout(180)
def test_a_dataset_larger_than_the_free_room_of_the_disk_volume_serves_every_row(
    sidecar_factory: Callable[..., SidecarProcess], tmp_path: Path
) -> None:
    uri, table = datasets.write_local(tmp_path / "ds", SHARDS)
    source_bytes = sum(f.stat().st_size for f in (tmp_path / "ds").iterdir())
    assert source_bytes > VOLUME - FILLER  # the tier must evict to get through
    proc = sidecar_factory(uri, env={contract.ENV_PREFETCH_DEPTH: "2"})
    with mounts.tmpfs(proc.disk_dir, VOLUME) as disk:
        (disk / "someone-elses.bin").write_bytes(b"\0" * FILLER)
        try:
            proc.start(wait="ready")
            shards = sidecar_client.SidecarProvider.from_env(
                environ=proc.client_env(), reconnect_timeout=10.0
            )
            ds = shardcache.Dataset(shards, plans.PlanParams(seed=1, shuffle=False))
            try:
                seen = [u for b in ds.batches(4096) for u in b.column("uid").to_pylist()]
            finally:
                ds.close()
            stats = proc.control("GET", "/v1/status")[1]["stats"]
        finally:
            proc.kill()
        log = proc.log_tail(2000)
    # Every row once: the tier made room by evicting its own entries, never the store
    # blamed (no retried fetch, no fetch failure).
    assert sorted(seen) == list(range(table.num_rows))
    assert stats["fetch_failures"] == 0, stats
    assert stats["evictions"]["disk"] > 0, stats
    assert "No space left on device); retrying" not in log, log
    assert "kind=source" not in log, log
    # The default limit (50 GiB) is clamped to the volume, and the log says so.
    assert stats["disk_limit_bytes"] == VOLUME, stats
    assert "exceeds its volume" in log, log


@pytest.mark.timeout(60)
def test_a_disk_volume_with_no_room_and_nothing_to_evict_is_a_cache_error_not_a_fetch_failure(
    tmp_path: Path,
) -> None:
    datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / "ds"), [40_000])
    manifest = manifests.resolve(f"file://{tmp_path / 'ds'}")
    with mounts.tmpfs(tmp_path / "disk", 2 * MiB) as disk:
        (disk / "someone-elses.bin").write_bytes(b"\0" * (3 * MiB // 2))
        settings = caches.NodeSettings(
            disk_dir=disk, memory_dir=tmp_path / "mem", prefetch_depth=0, wait_timeout=1.0
        )
        node = caches.CacheNode(manifest, settings)
        try:
            with pytest.raises(errors.CacheError) as raised:
                node.acquire(0, timeout=30)
            stats = node.stats()
        finally:
            node.close()
    text = str(raised.value)
    assert not isinstance(raised.value, errors.SourceError)
    # Names the volume, its free bytes and the limit to change; counts no fetch failure.
    assert f"disk volume of {disk}" in text and "free)" in text, text
    assert contract.ENV_DISK_LIMIT in text, text
    assert stats.fetch_failures == 0 and stats.last_fetch_error is None, stats
