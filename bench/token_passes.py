"""What the read-path benches share: every pass touches every token of every batch (a
sum over the token ids, the same work for every path compared), and the sample benches'
(`bench.sample_read`, `bench.gather_floor`) options over bench.peers' generated token
rows."""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from bench.peers import dataset, harness


def touch(batches: Iterator[pa.RecordBatch]) -> tuple[int, int]:
    """(tokens, checksum): reads every token of every batch."""
    tokens = checksum = 0
    for batch in batches:
        values = batch.column("tokens").flatten()
        tokens += len(values)
        checksum += pc.sum(values).as_py() or 0
    return tokens, checksum


def add_dataset_arguments(parser: argparse.ArgumentParser, *, passes: int, per: str) -> None:
    """The generated dataset (its size and where it lives), the memory tier's directory,
    the batch size and how many timed warm passes per `per` (default `passes`)."""
    parser.add_argument("--size", type=harness.parse_size, default=harness.parse_size("256MiB"))
    parser.add_argument("--file-size", type=harness.parse_size, default=harness.parse_size("32MiB"))
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--passes", type=int, default=passes, help=f"timed warm passes per {per}")
    # One dataset for both benches: the second reuses what the first generated.
    parser.add_argument(
        "--root", type=Path, default=Path(tempfile.gettempdir()) / "shardcache-bench-sample"
    )
    parser.add_argument("--shm-dir", type=Path, default=Path("/dev/shm"))


def ensure_dataset(args: argparse.Namespace) -> dict[str, Any]:
    """The dataset `add_dataset_arguments`' options name, generated unless already there;
    its spec (`dataset.ensure`)."""
    return dataset.ensure(
        args.root, dataset.Params(size_bytes=args.size, file_bytes=args.file_size)
    )
