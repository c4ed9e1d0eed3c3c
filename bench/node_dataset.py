"""`make bench-node`'s dataset: `launcher.generate`'s token shards, written on all cores.

The same schema and content as `shardcache_sidecar.launcher.generate` (`uid` 0..N-1,
`tokens: list<int32>` of 64 to 319 ids), but shards are built and compressed on a
thread per core: 6 GiB written one shard at a time takes minutes of a run that must fit
in a few. pyarrow's compute kernels and Parquet writer release the GIL.
"""

from __future__ import annotations

import concurrent.futures

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from shardcache_sidecar import launcher

from shardcache import source


def shard_name(index: int) -> str:
    return f"part-{index:05d}.parquet"


def _table(index: int, rows: int, pool: pa.Array) -> pa.Table:
    uid = pa.array(range(index * rows, (index + 1) * rows), pa.int64())
    lengths = pc.add(pc.bit_wise_and(pc.multiply(uid, 7), 255), 64).cast(pa.int32())
    offsets = pa.concat_arrays([pa.array([0], pa.int32()), pc.cumulative_sum(lengths)])
    tokens = pa.ListArray.from_arrays(offsets, pool.slice(index % 7, offsets[-1].as_py()))
    return pa.table({"uid": uid, "tokens": tokens})


def generate(
    root: str,
    env: dict[str, str],
    shards: int,
    rows: int,
    *,
    threads: int,
    random_tokens: bool = False,
) -> int:
    """Write `shards` Parquet shards (zstd) of `rows` rows under `root`; the token count.

    The token ids repeat a counting pool, which zstd shrinks about 20 times;
    `random_tokens` draws them at random below 32,768 instead, which it shrinks about
    twice, as real token data (the cold path's source-side work then shows)."""
    # No shards: only the bucket (MinIO) and the directory, made the launcher's way.
    launcher.generate(root, env, 0, 1)
    fs, path = source.filesystem(root, storage_options=env or None)
    if random_tokens:
        uniform = pc.random(rows * 320, initializer=0)
        pool = pc.floor(pc.multiply(uniform, 32768)).cast(pa.int32())
    else:
        pool = pc.bit_wise_and(pa.array(range(rows * 320), pa.int64()), 32767).cast(pa.int32())

    def write(index: int) -> int:
        table = _table(index, rows, pool)
        with fs.open_output_stream(f"{path}/{shard_name(index)}") as out:
            pq.write_table(table, out, compression="zstd")
        return len(table.column("tokens").combine_chunks().flatten())

    with concurrent.futures.ThreadPoolExecutor(max_workers=threads) as workers:
        return sum(workers.map(write, range(shards)))
