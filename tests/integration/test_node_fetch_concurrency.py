"""The cache node decodes at most its fetch concurrency at once, readahead and acquires
together (issue 14: a pod with 2 CPUs must not run 16 decoders)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest

from shardcache import formats, manifests
from shardcache.node import caches, quotas
from tests.support import datasets

pytestmark = pytest.mark.integration

SHARDS = [200] * 6


def node_over(
    tmp_path: Path, *, fetch_concurrency: int, prefetch_depth: int = 4
) -> caches.CacheNode:
    datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / "ds"), SHARDS)
    manifest = manifests.resolve(f"file://{tmp_path / 'ds'}")
    settings = caches.NodeSettings(
        disk_dir=tmp_path / "disk",
        memory_dir=tmp_path / "mem",
        fetch_concurrency=fetch_concurrency,
        prefetch_depth=prefetch_depth,
    )
    return caches.CacheNode(manifest, settings)


@pytest.mark.parametrize("concurrency", [1, 2])
def test_acquires_of_cold_shards_decode_no_more_than_the_fetch_concurrency_at_once(
    tmp_path: Path, concurrency: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = node_over(tmp_path, fetch_concurrency=concurrency, prefetch_depth=0)
    decode = caches.CacheNode._decode
    running, most = 0, 0
    lock = threading.Lock()

    def counted(
        self: caches.CacheNode,
        shard: int,
        path: Path,
        reserved: contextlib.ExitStack,
        **options: Any,
    ) -> formats.Decoded | None:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        try:
            time.sleep(0.1)  # long enough for every acquire to be waiting at once
            return decode(self, shard, path, reserved, **options)
        finally:
            with lock:
                running -= 1

    monkeypatch.setattr(caches.CacheNode, "_decode", counted)
    try:
        # Six readers' acquires, each on its own thread as in the sidecar's pool.
        with concurrent.futures.ThreadPoolExecutor(len(SHARDS)) as pool:
            entries = list(pool.map(lambda s: node.acquire(s, timeout=60), range(len(SHARDS))))
        for entry in entries:
            entry.release()
    finally:
        node.close()
    assert most == concurrency


def test_fetch_concurrency_0_is_sized_from_the_cgroup(tmp_path: Path) -> None:
    node = node_over(tmp_path, fetch_concurrency=0)
    try:
        quota = quotas.read()
        room = quotas.decode_room(
            quota,
            volume_bytes=quotas.volume_bytes(
                node.settings.memory_limit,
                tmpfs_size=quotas.tmpfs_size(node.settings.memory_dir),
                memory_limit=quota.memory_limit,
            ),
        )
        expected = quotas.fetch_concurrency(
            quota,
            decoded_bytes=quotas.FETCH_MEMORY_FACTOR * max(s.size for s in node.manifest.shards),
            room=room,
        )
        assert node.fetch_concurrency == expected >= 1
    finally:
        node.close()
