"""A cache forked while its threads work (a DataLoader worker using the Dataset its
parent opened and read from) goes on in the child: none of what the parent's threads
held at the fork (fetch slots, attempts in flight, the tiers' locks) is held there."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.ipc as ipc
import pytest

from shardcache import manifests
from shardcache.node import caches
from tests.support import datasets

pytestmark = pytest.mark.integration

SHARDS = [300, 200, 100]


def test_a_child_forked_mid_decode_reads_every_shard_and_the_parent_finishes_its_own(
    tmp_path: Path,
) -> None:
    expected = datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / "ds"), SHARDS)
    manifest = manifests.resolve(f"file://{tmp_path / 'ds'}")
    settings = caches.NodeSettings(
        disk_dir=tmp_path / "disk",
        memory_dir=tmp_path / "mem",
        prefetch_depth=0,
        # One slot: the parent's readahead holds it at the fork.
        fetch_concurrency=1,
    )
    node = caches.CacheNode(manifest, settings)
    gate, decoding = threading.Event(), threading.Event()
    real = node._decode

    def decode(*args: Any, **kwargs: Any) -> Any:
        # Only the parent's readahead: the child's acquires make theirs on threads of
        # their own too.
        if threading.current_thread().name == "parent's readahead":
            decoding.set()
            assert gate.wait(60)
        return real(*args, **kwargs)

    node._decode = decode  # type: ignore[method-assign]
    readahead = threading.Thread(
        target=node._prefetch, args=(0, "readahead"), name="parent's readahead"
    )
    readahead.start()
    try:
        assert decoding.wait(30)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: reads every shard, the one the parent decodes first
            try:
                os.close(read)
                rows = []
                for shard in range(len(SHARDS)):
                    with node.acquire(shard, timeout=20) as entry:
                        batch = ipc.open_file(pa.memory_map(str(entry.path))).read_all()
                        rows.extend(batch.column("uid").to_pylist())
                os.write(write, b"ok" if rows == expected.column("uid").to_pylist() else b"no")
            except BaseException as exc:
                os.write(write, repr(exc).encode()[:200])
            finally:
                os._exit(0)
        os.close(write)
        reaped = False
        deadline = time.monotonic() + 60
        while not reaped and time.monotonic() < deadline:
            reaped = os.waitpid(pid, os.WNOHANG) != (0, 0)
            time.sleep(0 if reaped else 0.05)
        if not reaped:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        said = os.read(read, 200)
        os.close(read)
        # Before, the child waited on the parent's slot and attempt forever.
        assert said == b"ok"
    finally:
        gate.set()
        readahead.join(30)
    # The parent's own attempt finished, its tier lock not held by the child's copies.
    with node.acquire(0, timeout=20) as entry:
        assert ipc.open_file(pa.memory_map(str(entry.path))).read_all().num_rows == SHARDS[0]
    node.close()
