"""`make bench-sample`: sample mode's warm tokens/s against block mode's, in one run.

Both modes read the same dataset (bench.peers' generated token rows, Parquet) through
embedded caches whose memory tiers are on /dev/shm, so every shard is resident and
mapped before the timed passes: what is compared is the read path alone, a zero-copy
slice per batch (block) against one gathered copy per batch (sample). Every pass
touches every token (a sum over the token ids of each batch), the same work for both;
the passes alternate (block, then sample at each gather pool size, then block again,
...) so a noisy neighbour weighs on all of them. This is a benchmark, not a test: it
prints what it measured; the target is sample >= 0.5x block.

Sample mode is measured at each pool size of `--threads` (`Dataset.gather_threads`: 0
gathers inline, n >= 2 gathers ahead on n threads; sizes above the CPUs the quota allows
are left out), one line each with the CPU time the process used per wall second, so a
run on a large machine shows how the gather scales. The RESULT line is sample mode at
the default pool size (what `shardcache.open()` gives) against block mode.

After the timed passes, one more pass per sample pool size is made with timers (not
counted in the rates): per batch, the consumer thread's CPU (the sum, the planning and
the handing over), and the gathering's CPU and wall time per batch (gathering ahead
copies chunks of batches at once: a chunk's times over its batches). Gathering whose wall
time is well above its CPU time waited: for the GIL, or, on a machine without a free
core, for one.

    python -m bench.sample_read [--size 256MiB] [--batch-size 256] [--passes 3]
        [--threads 0,1,2,4,8]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pyarrow as pa

import shardcache
from bench import token_passes
from shardcache import gather_ahead, selections
from shardcache.node import quotas


def timed_pass(
    ds: shardcache.Dataset, epoch: int, batch_size: int
) -> tuple[float, float, int, int]:
    """(wall seconds, CPU seconds of the process, tokens, checksum) of one pass."""
    ds.set_epoch(epoch)
    t0, c0 = time.perf_counter(), time.process_time()
    tokens, checksum = token_passes.touch(ds.batches(batch_size))
    return time.perf_counter() - t0, time.process_time() - c0, tokens, checksum


@dataclasses.dataclass
class GatherTimes:
    """CPU and wall seconds spent in `Selection.gather`, over `batches` gathers."""

    batches: int = 0
    cpu: float = 0.0
    wall: float = 0.0
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


@contextlib.contextmanager
def timed_gathers() -> Iterator[GatherTimes]:
    """Every `Selection.gather` (in whatever thread) timed while this is open."""
    times = GatherTimes()
    plain = selections.Selection.gather

    def gather(self: selections.Selection) -> pa.RecordBatch:
        w0, c0 = time.perf_counter(), time.thread_time()
        out = plain(self)
        cpu, wall = time.thread_time() - c0, time.perf_counter() - w0
        with times.lock:
            times.batches += 1
            times.cpu += cpu
            times.wall += wall
        return out

    many = selections.gather_many

    def gather_many(chunk: Sequence[selections.Selection]) -> list[pa.RecordBatch]:
        # A chunk of one is gathered by `Selection.gather`, timed above.
        if len(chunk) == 1:
            return many(chunk)
        w0, c0 = time.perf_counter(), time.thread_time()
        out = many(chunk)
        cpu, wall = time.thread_time() - c0, time.perf_counter() - w0
        with times.lock:
            times.batches += len(chunk)
            times.cpu += cpu
            times.wall += wall
        return out

    selections.Selection.gather = gather  # type: ignore[method-assign]
    selections.gather_many = gather_many
    try:
        yield times
    finally:
        selections.Selection.gather = plain  # type: ignore[method-assign]
        selections.gather_many = many


def where_time_goes(ds: shardcache.Dataset, epoch: int, batch_size: int) -> str:
    """One timed pass's consumer CPU and gather CPU and wall time, per batch."""
    ds.set_epoch(epoch)
    with timed_gathers() as times:
        t0, c0 = time.perf_counter(), time.thread_time()
        token_passes.touch(ds.batches(batch_size))
        wall, consumer = time.perf_counter() - t0, time.thread_time() - c0
    n = max(1, times.batches)
    return (
        f"per batch: {wall / n * 1e6:,.0f} us; consumer thread {consumer / n * 1e6:,.0f} us CPU; "
        f"gathering {times.cpu / n * 1e6:,.0f} us CPU, {times.wall / n * 1e6:,.0f} us wall"
    )


def pool_sizes(text: str, cpus: int, default: int) -> list[int]:
    """The pool sizes to try: those of `text` (comma-separated) the CPUs allow, and the
    default, in ascending order."""
    sizes = {int(t) for t in text.split(",") if t.strip()}
    return sorted({t for t in sizes if t <= cpus} | {default})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    token_passes.add_dataset_arguments(p, passes=3, per="mode")
    p.add_argument("--threads", default="0,1,2,4,8", help="gather pool sizes to try")
    args = p.parse_args(argv)
    quota = quotas.read()
    default = gather_ahead.default_threads(quota)
    sizes = pool_sizes(args.threads, quota.cpus, default)
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
        # Every pass is one (dataset, gather pool size): block mode has nothing to gather.
        runs = [("block", modes["block"], 0)] + [
            (f"sample t={t}", modes["sample"], t) for t in sizes
        ]
        try:
            seconds: dict[str, list[float]] = {name: [] for name, _, _ in runs}
            cpu: dict[str, list[float]] = {name: [] for name, _, _ in runs}
            sums: set[int] = set()
            tokens = 0
            # Pass 0 fetches, decodes and maps every shard: not timed. Every pass of a
            # dataset reads an epoch of its own (a pass reads the rest of its epoch).
            epochs = {id(ds): 0 for ds in modes.values()}
            for n in range(args.passes + 1):
                for name, ds, threads in runs if n else runs[:2]:
                    ds.gather_threads = threads
                    epoch = epochs[id(ds)]
                    epochs[id(ds)] += 1
                    took, used, tokens, checksum = timed_pass(ds, epoch, args.batch_size)
                    sums.add(checksum)
                    if n:
                        seconds[name].append(took)
                        cpu[name].append(used / took)
            where: dict[str, str] = {}
            for name, ds, threads in runs[1:]:
                ds.gather_threads = threads
                where[name] = where_time_goes(ds, epochs[id(ds)], args.batch_size)
                epochs[id(ds)] += 1
        finally:
            for ds in modes.values():
                ds.close()
    if len(sums) != 1:
        print(f"FAILED: the passes read different tokens (checksums {sorted(sums)})")
        return 1
    rate = {name: tokens / statistics.median(s) for name, s in seconds.items()}
    e = spec["expected"]
    print(
        f"{e['samples']:,} samples, {tokens:,} tokens ({tokens * 4 / (1 << 30):.2f} GiB), "
        f"batch {args.batch_size}, median of {args.passes} warm passes each; "
        f"{quota.cpus} CPUs (affinity {quota.affinity}, quota {quota.cpu_limit}), "
        f"default gather pool {default} threads"
    )
    for name, _, threads in runs:
        pool = "" if name == "block" else ("  inline" if threads <= 1 else f"  {threads} threads")
        print(
            f"  {name:11s} {rate[name] / 1e6:8,.1f} M tokens/s  {rate[name] * 4 / 1e9:5.2f} GB/s  "
            f"x{rate[name] / rate['block']:.2f} block  CPU {statistics.median(cpu[name]):.2f} "
            f"cores{pool}  (passes: {', '.join(f'{s:.3f} s' for s in seconds[name])})"
        )
        if name in where:
            print(f"      {where[name]}")
    print(
        f"RESULT sample_vs_block={rate[f'sample t={default}'] / rate['block']:.2f} "
        f"(default pool {default}) best="
        f"{max(rate[f'sample t={t}'] for t in sizes) / rate['block']:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
