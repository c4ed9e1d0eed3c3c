"""Where one shard's cold fetch goes: each stage timed alone, then the cache's own path.

`make bench-node`'s cold epoch compares the sidecar with an all-core ceiling that only
reads each shard, hashes it, decodes it and writes it (`bench.node_ceiling`). This
times those stages one shard at a time on one thread, beside the stages the node cache
adds (the disk-tier copy, reading it back, the checks before decoding, the memory
tier's insert), and then the node cache's whole fetch -> decode -> insert path
(`CacheNode.warm`, one fetch at a time) on the same shards, so a change to that path
shows as per-shard milliseconds on a machine whose load makes throughput noise.

    .venv/bin/python -m bench.cold_stages                 # 8 shards of 20,480 rows on /dev/shm
    .venv/bin/python -m bench.cold_stages --shards 4 --rows 81920 --repeat 5
    .venv/bin/python -m bench.cold_stages --random-tokens --cache-only   # A/B of the path

Each figure is the median over shards x repeats of one stage, in CPU ms per shard (this
process, all threads: not wall time, which a loaded machine stretches); the source
shard's bytes and its decoded bytes are printed for scale.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from bench import node_dataset
from shardcache import formats, manifests
from shardcache.node import caches, tiers

MiB = 1 << 20


def _work_dir() -> Path:
    shm = Path("/dev/shm")
    return Path(tempfile.mkdtemp(prefix="cold-stages-", dir=shm if shm.is_dir() else None))


def _timed(fn: Callable[[], object]) -> float:
    """CPU ms of this process, every thread (pyarrow's pools too), while `fn` runs: on a
    machine other work keeps busy, wall time measures the load more than the stage."""
    start = time.process_time()
    fn()
    return (time.process_time() - start) * 1e3


def _stages(path: Path, scratch: Path) -> dict[str, float]:
    """One shard through each stage alone, in ms."""
    out: dict[str, float] = {}
    fs = pafs.LocalFileSystem()
    box: dict[str, object] = {}

    def read() -> None:
        with fs.open_input_file(str(path)) as f:
            box["data"] = f.read_buffer()

    out["read source"] = _timed(read)
    data = box["data"]
    assert isinstance(data, pa.Buffer)
    out["sha256 source"] = _timed(lambda: hashlib.sha256(memoryview(data)).hexdigest())
    copy = scratch / "disk-copy"

    def write_copy() -> None:
        with open(copy, "wb") as f:
            f.write(memoryview(data))

    out["write disk-tier copy"] = _timed(write_copy)
    out["read back + sha256 copy"] = _timed(lambda: tiers.sha256_file(copy))
    limit = 1 << 40
    out["decoded_size (footer)"] = _timed(
        lambda: formats.decoded_size("parquet", pa.BufferReader(data), limit=limit)
    )

    def decode(source: pa.NativeFile, *, threads: bool, checksums: bool) -> pa.Table:
        return pq.read_table(
            source, use_threads=threads, page_checksum_verification=checksums
        ).combine_chunks()

    out["decode, from the copy, threads, page crc"] = _timed(
        lambda: decode(pa.OSFile(str(copy)), threads=True, checksums=True)
    )
    out["decode, from memory, threads, page crc"] = _timed(
        lambda: decode(pa.BufferReader(data), threads=True, checksums=True)
    )
    out["decode, from memory, 1 thread, page crc"] = _timed(
        lambda: decode(pa.BufferReader(data), threads=False, checksums=True)
    )
    out["decode, from memory, 1 thread, no crc"] = _timed(
        lambda: box.__setitem__(
            "table", decode(pa.BufferReader(data), threads=False, checksums=False)
        )
    )
    table = box["table"]
    assert isinstance(table, pa.Table)
    batch = table.to_batches()[0]
    decoded = scratch / "decoded.arrow"

    def write_ipc() -> None:
        with ipc.new_file(str(decoded), batch.schema) as writer:
            writer.write_batch(batch)

    out["write Arrow IPC"] = _timed(write_ipc)
    out["sha256 decoded file"] = _timed(lambda: tiers.sha256_file(decoded))
    out["_source MiB"] = len(data) / MiB
    out["_decoded MiB"] = decoded.stat().st_size / MiB
    return out


def _cache_path(root: str, work: Path, repeat: int) -> list[float]:
    """ms per shard of `CacheNode.warm`, one fetch at a time, each repeat on empty tiers."""
    manifest = manifests.resolve(root)
    per_shard: list[float] = []
    for i in range(repeat):
        settings = caches.NodeSettings(
            disk_dir=work / f"disk-{i}",
            memory_dir=work / f"memory-{i}",
            disk_limit=1 << 40,
            memory_limit=1 << 40,
            fetch_concurrency=1,
        )
        node = caches.CacheNode(manifest, settings)
        try:
            for shard in range(len(manifest.shards)):
                per_shard.append(_timed(functools.partial(node.warm, [shard])))
        finally:
            node.close()
        shutil.rmtree(settings.disk_dir)
        shutil.rmtree(settings.memory_dir)
    return per_shard


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--rows", type=int, default=20_480, help="rows per shard")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--random-tokens",
        action="store_true",
        help="token ids at random (zstd shrinks them ~2x, as real tokens), not a pool (~20x)",
    )
    parser.add_argument(
        "--cache-only", action="store_true", help="time only the node cache's path (A/B runs)"
    )
    args = parser.parse_args(argv)
    work = _work_dir()
    try:
        src = work / "source"
        root = f"file://{src}"
        node_dataset.generate(
            root, {}, args.shards, args.rows, threads=1, random_tokens=args.random_tokens
        )
        sources = sorted(src.glob("*.parquet"))
        scratch = work / "scratch"
        scratch.mkdir()
        rows: dict[str, list[float]] = {}
        for _ in range(0 if args.cache_only else args.repeat):
            for path in sources:
                for stage, ms in _stages(path, scratch).items():
                    rows.setdefault(stage, []).append(ms)
        sizes = {k: statistics.median(v) for k, v in rows.items() if k.startswith("_")}
        if sizes:
            print(
                f"{len(sources)} shards of {args.rows} rows: source "
                f"{sizes['_source MiB']:.1f} MiB, decoded {sizes['_decoded MiB']:.1f} MiB "
                f"(medians); CPU ms per shard, median of {len(sources) * args.repeat}:"
            )
        for stage, values in rows.items():
            if not stage.startswith("_"):
                print(f"  {stage:<44} {statistics.median(values):8.2f}")
        cache = _cache_path(root, work, args.repeat)
        print(
            f"  {'node cache: fetch -> decode -> insert':<44} {statistics.median(cache):8.2f}"
            f"   (CacheNode.warm, one shard at a time; min {min(cache):.2f})"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
