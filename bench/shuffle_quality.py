"""`make bench-shuffle-quality`: how well each loader's shuffle mixes a batch.

Every loader reads bench.peers' generated dataset (the same samples, each loader in its
own format) for one epoch; the delivered uids are cut into batches of `--batch-size`
in delivery order, and two figures are taken per batch, then averaged over the epoch:

- mean |uid distance| between neighbours in the batch: uids number the samples in the
  order the Parquet files hold them, so a batch of consecutive rows scores about 1 and
  a uniform shuffle of N samples about N/3;
- source files per batch: how many of the Parquet files the batch's samples come from
  (the same files for every loader, whatever its own shard layout).

The peers are measured, not modelled: MosaicML Streaming (`py1e`, its default, and
`py1s`) and LitData iterate their own conversions, in one process, with the settings
of `make bench-peers`; shardcache reads through `shardcache.open` in block and sample
mode. A uniform permutation of all samples is the reference row.

    python -m bench.shuffle_quality [--size 1GiB] [--batch-size 256]
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

import shardcache
from bench.peers import dataset, harness
from shardcache import plans

UID_BASE = dataset.UID_BASE


def shardcache_uids(
    root: Path, shuffle: str, seed: int, window: int = plans.DEFAULT_WINDOW
) -> Iterator[int]:
    uri = (root / "parquet").resolve().as_uri()
    with tempfile.TemporaryDirectory(prefix="scb-quality-") as cache:
        with shardcache.open(uri, shuffle=shuffle, seed=seed, window=window, cache_dir=cache) as ds:
            for batch in ds.batches(4096, columns=["uid"]):
                yield from batch.column("uid").to_pylist()


def in_subprocess(read: Callable[..., list[int]], *args: Any) -> Iterator[int]:
    """`read(*args)` in a fresh process: Streaming keeps shared memory per local
    directory, and a second dataset over the same directory in one process (py1s after
    py1e) does not start clean."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        yield from pool.apply(read, args)


def mosaic_uids(root: Path, algo: str, seed: int, batch_size: int) -> list[int]:
    import streaming
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    ds = streaming.StreamingDataset(
        local=str(root / "mds"),
        shuffle=True,
        shuffle_algo=algo,
        shuffle_seed=seed + 1,
        batch_size=batch_size,
    )
    return [int(sample["uid"]) for sample in ds]


def litdata_uids(root: Path, seed: int) -> list[int]:
    import litdata

    with tempfile.TemporaryDirectory(prefix="scb-quality-litdata-") as cache:
        ds = litdata.StreamingDataset(
            input_dir=str(root / "litdata"), cache_dir=cache, shuffle=True, seed=seed
        )
        ds.set_epoch(1)
        return [int(sample["uid"]) for sample in ds]


def pyarrow_uids(root: Path, files: list[Path], seed: int) -> Iterator[int]:
    # bench.peers' pyarrow loader: the file order shuffled, rows in file order.
    import random

    order = list(files)
    random.Random(seed * 1000).shuffle(order)
    for path in order:
        yield from pq.read_table(path, columns=["uid"]).column("uid").to_pylist()


def figures(
    uids: np.ndarray[Any, Any], file_starts: np.ndarray[Any, Any], batch: int
) -> tuple[float, float]:
    """(mean |uid distance| between neighbours, mean source files) per batch."""
    n = len(uids) // batch * batch
    batches = uids[:n].reshape(-1, batch)
    distance = float(np.abs(np.diff(batches, axis=1)).mean())
    files = np.searchsorted(file_starts, batches, side="right") - 1
    per_batch = [len(np.unique(row)) for row in files]
    return distance, float(np.mean(per_batch))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size", type=harness.parse_size, default=harness.parse_size("1GiB"))
    p.add_argument("--file-size", type=harness.parse_size, default=harness.parse_size("64MiB"))
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--root", type=Path, default=Path(tempfile.gettempdir()) / "shardcache-shuffle-quality"
    )
    p.add_argument("--peers", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--large-window",
        type=int,
        default=262_144,
        help="a second sample-mode row with this window (rows)",
    )
    p.add_argument("--only", default="", help="comma-separated row names to run (default all)")
    args = p.parse_args(argv)
    params = dataset.Params(size_bytes=args.size, seed=args.seed, file_bytes=args.file_size)
    names = ["shardcache-embedded"] + (["mosaic", "litdata"] if args.peers else [])
    spec = harness.prepare(args.root, params, names)
    files = dataset.parquet_files(args.root, spec)
    rows = [pq.ParquetFile(f).metadata.num_rows for f in files]
    starts = np.cumsum([0, *rows])[:-1] + UID_BASE
    total = sum(rows)
    runs: list[tuple[str, str, Callable[[], Iterator[int]]]] = [
        (
            "shardcache block",
            "block: 4,096-row runs",
            lambda: shardcache_uids(args.root, "block", args.seed),
        ),
        (
            "shardcache sample",
            "sample: 65,536-row windows",
            lambda: shardcache_uids(args.root, "sample", args.seed),
        ),
        (
            "pyarrow (bench-peers)",
            "file order only",
            lambda: pyarrow_uids(args.root, files, args.seed),
        ),
        (
            f"shardcache sample (window {args.large_window})",
            f"sample: {args.large_window:,}-row windows",
            lambda: shardcache_uids(args.root, "sample", args.seed, args.large_window),
        ),
    ]
    if args.peers:
        runs += [
            (
                "Streaming py1e",
                "sample (py1e)",
                lambda: in_subprocess(mosaic_uids, args.root, "py1e", args.seed, args.batch_size),
            ),
            (
                "Streaming py1s",
                "sample (py1s)",
                lambda: in_subprocess(mosaic_uids, args.root, "py1s", args.seed, args.batch_size),
            ),
            (
                "LitData",
                "sample (within a chunk)",
                lambda: in_subprocess(litdata_uids, args.root, args.seed),
            ),
        ]
    rng = np.random.default_rng(args.seed)
    print(
        f"{total:,} samples in {len(files)} Parquet files ({args.file_size >> 20} MiB of tokens "
        f"each), batch {args.batch_size}; uniform shuffle: mean distance ~{total / 3:,.0f}"
    )
    print("| loader | shuffle | mean uid distance between neighbours | source files per batch |")
    print("|---|---|---|---|")
    wanted = {n.strip() for n in args.only.split(",") if n.strip()}
    for name, granularity, read in runs:
        if wanted and name not in wanted:
            continue
        uids = np.fromiter(read(), dtype=np.int64)
        distinct = len(np.unique(uids))
        note = ""
        if distinct != len(uids) or distinct != total:
            # Still measured: the figures describe what the loop was handed.
            note = f" ({len(uids):,} delivered, {distinct:,} distinct of {total:,})"
        distance, per_batch = figures(uids, starts, args.batch_size)
        print(f"| {name}{note} | {granularity} | {distance:,.0f} | {per_batch:.2f} |", flush=True)
    uniform = rng.permutation(total) + UID_BASE
    distance, per_batch = figures(uniform, starts, args.batch_size)
    print(f"| uniform permutation (reference) | global | {distance:,.0f} | {per_batch:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
