"""Where a warm pass through the sidecar spends its time, part by part.

    python -m bench.peers.breakdown --root ~/.cache/shardcache-bench-peers [--tier-dir /var/tmp] [--ceiling]

Starts a `shardcache sidecar` on the benchmark's Parquet files (as `shardcache-sidecar`
does; `--tier-dir` puts its memory tier, the run directory, on another filesystem, e.g.
a disk directory for `cache.medium: Disk`), reads one cold epoch, then for each warm
epoch times, with the loop's own work (the tally) in between:

- *tally*: the loop's work on every batch (compare with the ceiling row's whole pass);
- *plain batches*: handing over a batch that is a slice of one mapped shard;
- *stitched batches*: a batch that spans two runs of rows (a shuffle-block or a shard
  boundary), so its rows are copied into one (`pa.concat_batches`: *concat*), and the
  shard switches, which fall on such batches: the direct pin or acquire (*acquire*) and
  the check of kept mappings (*prune*).

With `--ceiling`, the tally is then timed over the same rows decoded into process memory
(the `in-memory-ceiling` row), in the same process. Wrapping the calls costs a little
time of its own, so the parts add up to slightly more
than an unwrapped pass. Timings only; the exactness of every pass is the harness's job.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
from shardcache_sidecar import launcher

import shardcache
from bench.peers import tallies
from shardcache import contract

Clock = dict[str, float]


def _timed(clock: Clock, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            clock[name] = clock.get(name, 0.0) + time.perf_counter() - start

    return wrapper


@contextlib.contextmanager
def _sidecar_dataset(root: Path, tier_dir: Path) -> Iterator[shardcache.Dataset]:
    uri = (root / "parquet").resolve().as_uri()
    work = Path(tempfile.mkdtemp(prefix="scb-breakdown-", dir=tier_dir))
    try:
        with launcher.sidecar(
            uri,
            {},
            work,
            memory_limit=4 << 30,
            disk_limit=50 << 30,
            extra_env={
                contract.ENV_DISK_DIR: str(work / "disk"),
                contract.ENV_READY_SHARDS: "0",
                contract.ENV_SEED: "0",
                contract.ENV_SHUFFLE: "true",
            },
        ) as (trainer_env, _):
            saved = dict(os.environ)
            os.environ.update(trainer_env)
            try:
                with shardcache.open(shuffle=True, seed=0) as ds:
                    yield ds
            finally:
                os.environ.clear()
                os.environ.update(saved)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _mapped_ranges(mappings: Any) -> list[tuple[int, int]]:
    """(start, end) addresses of the first column's data in every shard mapping held."""
    ranges = []
    for _, shard in mappings._maps.values():
        data = shard.column(0).buffers()[1]
        if data is not None:
            ranges.append((data.address, data.address + data.size))
    return ranges


def measure(ds: shardcache.Dataset, epoch: int, batch_size: int) -> dict[str, float]:
    clock: Clock = {}
    provider, mappings = ds.provider, ds._mappings
    # `shardcache.datasets` calls `pa.concat_batches` through the module: patched here, timed there.
    originals = (provider.acquire, mappings.prune, pa.concat_batches)
    provider.acquire = _timed(clock, "acquire", provider.acquire)  # type: ignore[method-assign]
    mappings.prune = _timed(clock, "prune", mappings.prune)  # type: ignore[method-assign]
    pa.concat_batches = _timed(clock, "concat", pa.concat_batches)
    try:
        ds.set_epoch(epoch)
        tally = tallies.Tally()
        handed: list[float] = []
        tallied = 0.0
        addresses: list[int] = []
        batches = ds.batches(batch_size)
        started = time.perf_counter()
        while True:
            t0 = time.perf_counter()
            batch = next(batches, None)
            t1 = time.perf_counter()
            if batch is None:
                break
            tally.add_record_batch(batch)
            tallied += time.perf_counter() - t1
            handed.append(t1 - t0)
            data = batch.column(0).buffers()[1]
            addresses.append(data.address if data is not None else 0)
        total = time.perf_counter() - started
        # Classified after the pass, so that the check costs the timed pass nothing: a
        # plain batch is a slice of a mapped shard, a stitched one owns a copy.
        ranges = _mapped_ranges(mappings)
        parts = {"plain": 0.0, "stitched": 0.0}
        counts = {"plain": 0, "stitched": 0}
        for seconds, address in zip(handed, addresses, strict=True):
            kind = "plain" if any(lo <= address < hi for lo, hi in ranges) else "stitched"
            parts[kind] += seconds
            counts[kind] += 1
        parts["tally"] = tallied
    finally:
        provider.acquire, mappings.prune = originals[0], originals[1]  # type: ignore[method-assign]
        pa.concat_batches = originals[2]
    tally.flush()
    return {
        "total_ms": total * 1e3,
        "mtok_s": tally.tokens / total / 1e6,
        "tally_ms": parts["tally"] * 1e3,
        "plain_batches": counts["plain"],
        "plain_ms": parts["plain"] * 1e3,
        "stitched_batches": counts["stitched"],
        "stitched_ms": parts["stitched"] * 1e3,
        **{f"{k}_ms": v * 1e3 for k, v in clock.items()},
    }


def ceiling_ms(root: Path, batch_size: int, rounds: int) -> list[float]:
    """The tally alone over the same rows decoded into process memory, cut into batches
    and shuffled (the `in-memory-ceiling` row), per round, in ms."""
    import random

    import pyarrow.parquet as pq

    files = sorted((root / "parquet").glob("*.parquet"))
    table = pa.concat_tables([pq.read_table(f) for f in files]).combine_chunks()
    batches = table.to_batches(max_chunksize=batch_size)
    out = []
    for round_ in range(rounds):
        random.Random(round_).shuffle(batches)
        tally = tallies.Tally()
        started = time.perf_counter()
        for batch in batches:
            tally.add_record_batch(batch)
        out.append((time.perf_counter() - started) * 1e3)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", type=Path, default=Path.home() / ".cache/shardcache-bench-peers")
    p.add_argument("--tier-dir", type=Path, default=Path("/dev/shm"))
    p.add_argument("--epochs", type=int, default=3, help="warm epochs to time")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument(
        "--ceiling", action="store_true", help="also time the tally over in-memory batches"
    )
    args = p.parse_args(argv)
    if not (args.root / "parquet").is_dir():
        raise SystemExit(f"no benchmark dataset under {args.root}: run `make bench-peers` first")
    with _sidecar_dataset(args.root, args.tier_dir) as ds:
        ds.set_epoch(0)
        for _ in ds.batches(args.batch_size):
            pass
        for epoch in range(1, args.epochs + 1):
            m = measure(ds, epoch, args.batch_size)
            print(
                f"epoch {epoch}: {m['total_ms']:.1f} ms ({m['mtok_s']:,.0f} M tokens/s); "
                f"tally {m['tally_ms']:.1f} ms; {m['plain_batches']} plain batches "
                f"{m['plain_ms']:.1f} ms; {m['stitched_batches']} stitched batches "
                f"{m['stitched_ms']:.1f} ms (concat {m.get('concat_ms', 0):.1f}, acquire "
                f"{m.get('acquire_ms', 0):.1f}, prune {m.get('prune_ms', 0):.1f})"
            )
    if args.ceiling:
        rounds = ceiling_ms(args.root, args.batch_size, args.epochs)
        print(
            "ceiling (tally over in-memory batches): " + ", ".join(f"{ms:.1f} ms" for ms in rounds)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
