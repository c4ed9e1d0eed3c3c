"""`make bench-sample`: sample mode's warm tokens/s against block mode's, in one run.

Both modes read the same dataset (bench.peers' generated token rows, Parquet) through
embedded caches whose memory tiers are on /dev/shm, so every shard is resident and
mapped before the timed passes: what is compared is the read path alone, a zero-copy
slice per batch (block) against one gathered copy per batch (sample). Every pass
touches every token (a sum over the token ids of each batch), the same work for both;
the passes alternate (block, sample, block, sample, ...) so a noisy neighbour weighs on
both. This is a benchmark, not a test: it prints what it measured; the target is
sample >= 0.5x block.

    python -m bench.sample_read [--size 256MiB] [--batch-size 256] [--passes 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import shardcache
from bench import token_passes


def timed_pass(ds: shardcache.Dataset, epoch: int, batch_size: int) -> tuple[float, int, int]:
    ds.set_epoch(epoch)
    t0 = time.perf_counter()
    tokens, checksum = token_passes.touch(ds.batches(batch_size))
    return time.perf_counter() - t0, tokens, checksum


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    token_passes.add_dataset_arguments(p, passes=3, per="mode")
    args = p.parse_args(argv)
    spec = token_passes.ensure_dataset(args)
    uri = (args.root / "parquet").resolve().as_uri()
    with tempfile.TemporaryDirectory(prefix="scb-sample-", dir=args.shm_dir) as mem:
        # A cache of its own per mode, so neither waits on the other's locks.
        modes = {
            mode: shardcache.open(
                uri,
                shuffle=mode,
                seed=0,
                cache_dir=args.root / f"cache-{mode}",
                memory_dir=Path(mem) / mode,
            )
            for mode in ("block", "sample")
        }
        try:
            seconds: dict[str, list[float]] = {m: [] for m in modes}
            sums: dict[str, set[int]] = {m: set() for m in modes}
            tokens = 0
            # Pass 0 of each mode fetches, decodes and maps every shard: not timed.
            for epoch in range(args.passes + 1):
                for mode, ds in modes.items():
                    took, tokens, checksum = timed_pass(ds, epoch, args.batch_size)
                    sums[mode].add(checksum)
                    if epoch:
                        seconds[mode].append(took)
        finally:
            for ds in modes.values():
                ds.close()
    if len(sums["block"] | sums["sample"]) != 1:
        print(f"FAILED: the modes read different tokens (checksums {sums})")
        return 1
    rate = {m: tokens / statistics.median(s) for m, s in seconds.items()}
    e = spec["expected"]
    print(
        f"{e['samples']:,} samples, {tokens:,} tokens ({tokens * 4 / (1 << 30):.2f} GiB), "
        f"batch {args.batch_size}, median of {args.passes} warm passes each"
    )
    for mode in modes:
        print(
            f"  {mode:6s} {rate[mode] / 1e6:8,.1f} M tokens/s  {rate[mode] * 4 / 1e9:5.2f} GB/s  "
            f"(passes: {', '.join(f'{s:.3f} s' for s in seconds[mode])})"
        )
    print(f"RESULT sample_vs_block={rate['sample'] / rate['block']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
