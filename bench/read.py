"""`make bench-read`: the read path, measured on this machine in one run.

(a) raw: the decoded Arrow IPC files memory-mapped directly (the ceiling);
(b) shardcache through the sidecar, warm (every shard resident);
(c) a cold first pass from the S3-compatible server (fetch, verify, decode);
and time to first batch, cold and warm. Every measurement touches every token (a sum
over the token ids of each batch), the same work for all. This is a benchmark, not a
test: it prints what it measured; the targets are ratio >= 0.9 and ttfb_warm <= 200 ms.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc
from shardcache_sidecar import launcher

import shardcache
from bench import token_passes
from shardcache import contract, formats, plans

GiB = 1 << 30


def raw_batches(files: list[Path], batch_size: int) -> Iterator[pa.RecordBatch]:
    for path in files:
        batch = ipc.open_file(pa.memory_map(str(path))).get_batch(0)
        for start in range(0, batch.num_rows, batch_size):
            yield batch.slice(start, batch_size)


def sidecar_pass(
    trainer_env: dict[str, str], batch_size: int, epoch: int
) -> tuple[float, float, int, int]:
    """(seconds to first batch, seconds for the pass, tokens, checksum)."""
    os.environ.update(trainer_env)
    t0 = time.perf_counter()
    with shardcache.open() as ds:
        ds.set_epoch(epoch)
        stream = ds.batches(batch_size)
        first = next(stream)
        ttfb = time.perf_counter() - t0
        tokens, checksum = token_passes.touch(iter([first]))
        more_tokens, more_sum = token_passes.touch(stream)
        elapsed = time.perf_counter() - t0
    return ttfb, elapsed, tokens + more_tokens, checksum + more_sum


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.1, help="decoded dataset size (1.1 GiB)")
    parser.add_argument("--shards", type=int, default=9)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--minio", type=Path, default=None)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()

    # Rows per shard: a multiple of the block size, so shuffled blocks stay aligned
    # with batches (the recommended layout; see docs/reading-plans.md). ~191 tokens/row.
    block = plans.DEFAULT_BLOCK_SIZE
    rows = max(block, int(args.gib * GiB / 4 / 191 / args.shards) // block * block)
    base_dir = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    work = args.workdir or Path(tempfile.mkdtemp(prefix="shardcache-bench-", dir=base_dir))
    results: list[tuple[str, float, float]] = []
    try:
        with launcher.object_store(args.minio, work) as (root, storage_env):
            t = time.perf_counter()
            total_tokens = launcher.generate(
                root, storage_env, args.shards, rows, compression="zstd"
            )
            print(
                f"dataset: {args.shards} Parquet shards x {rows:,} rows, {total_tokens:,} tokens "
                f"({total_tokens * 4 / GiB:.2f} GiB of int32 tokens) at {root}, "
                f"generated in {time.perf_counter() - t:.1f}s",
                flush=True,
            )
            memory_limit = int(total_tokens * 4 * 1.5) + GiB
            with launcher.sidecar(
                root,
                storage_env,
                work,
                memory_limit=memory_limit,
                disk_limit=8 * GiB,
                wait_ready=False,
                extra_env={contract.ENV_READY_SHARDS: "0", contract.ENV_PREFETCH_DEPTH: "4"},
            ) as (env, _):
                ttfb_cold, cold_s, cold_tokens, cold_sum = sidecar_pass(env, args.batch_size, 0)
                results.append(("(c) shardcache sidecar, cold from S3", cold_s, cold_tokens))
                ttfb_warm, warm_s, warm_tokens, warm_sum = sidecar_pass(env, args.batch_size, 1)
                results.append(("(b) shardcache sidecar, warm", warm_s, warm_tokens))
                mem_dir = contract.memory_dir(env[contract.ENV_RUN_DIR], env[contract.ENV_MOUNT])
                files = sorted(
                    p for p in mem_dir.iterdir() if p.name.endswith(f"-d{formats.DECODE_VERSION}")
                )
                assert len(files) == args.shards, f"expected {args.shards} decoded shards"
                t = time.perf_counter()
                raw_tokens, raw_sum = token_passes.touch(raw_batches(files, args.batch_size))
                raw_s = time.perf_counter() - t
                results.append(("(a) raw mmap of the decoded IPC files", raw_s, raw_tokens))
                # Second warm pass after raw, so neither side is favoured by order.
                ttfb_warm2, warm2_s, _, warm2_sum = sidecar_pass(env, args.batch_size, 2)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)

    for name, tokens_seen, checksum in [
        ("cold", cold_tokens, cold_sum),
        ("warm", warm_tokens, warm_sum),
        ("raw", raw_tokens, raw_sum),
        ("warm2", warm_tokens, warm2_sum),
    ]:
        if tokens_seen != total_tokens or checksum != raw_sum:
            print(
                f"FAILED: the {name} pass saw {tokens_seen} tokens (checksum {checksum}), "
                f"expected {total_tokens} (checksum {raw_sum})"
            )
            return 1
    warm_best = min(warm_s, warm2_s)
    results[1] = ("(b) shardcache sidecar, warm (best of 2)", warm_best, warm_tokens)
    print()
    print(f"{'reader':<44} {'seconds':>8} {'GB/s':>7} {'Mtok/s':>8}")
    for reader, elapsed, tokens in results:
        print(
            f"{reader:<44} {elapsed:8.3f} {tokens * 4 / elapsed / 1e9:7.2f} "
            f"{tokens / elapsed / 1e6:8.1f}"
        )
    print(
        f"time to first batch: cold {ttfb_cold * 1e3:.1f} ms, warm "
        f"{min(ttfb_warm, ttfb_warm2) * 1e3:.1f} ms"
    )
    read_gbps = warm_tokens * 4 / warm_best / 1e9
    raw_gbps = raw_tokens * 4 / raw_s / 1e9
    print(
        f"RESULT read_gbps={read_gbps:.3f} raw_gbps={raw_gbps:.3f} ratio={read_gbps / raw_gbps:.3f} "
        f"ttfb_cold_ms={ttfb_cold * 1e3:.1f} ttfb_warm_ms={min(ttfb_warm, ttfb_warm2) * 1e3:.1f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
