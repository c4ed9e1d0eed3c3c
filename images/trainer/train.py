"""A small trainer for the node tests: reads its rank's rows once, reports what it read.

    python3 /opt/shardcache/train.py                   # through the injected sidecar
    python3 train.py --source file:///data --cache-dir /tmp/c   # embedded, no sidecar

The "model" is the running tally of what was read: row count, the sum and the sum of
squares of an integer column (`--id-column`, default `id`). With ids 0..N-1 spread
over the ranks, the ranks' tallies add up to N, N(N-1)/2 and (N-1)N(2N-1)/6 exactly
when every row was read exactly once: a lost row lowers them, a repeated one raises
them. The tally is saved in every checkpoint with the data state
(`shardcache.checkpoint.commit(..., data_state=ds.state_dict())`), and a restarted
trainer opens with `resume_from="latest"` and reloads the tally from the same
checkpoint, so model and data resume together.

Rank and world size: $SHARDCACHE_RANK / $SHARDCACHE_WORLD_SIZE (the webhook writes
them; for an Indexed Job the rank is the completion index), else
$JOB_COMPLETION_INDEX, else $RANK / $WORLD_SIZE, else 0 of 1. The plan settings
($SHARDCACHE_SEED, $SHARDCACHE_SHUFFLE, $SHARDCACHE_BLOCK_SIZE) come from the
DatasetMount the same way.

Output: `train: ...` progress lines, then one line `SHARDCACHE_RESULT {json}` on
stdout (and the same JSON in --result-file when given).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

import shardcache
import shardcache.checkpoint

RESULT_PREFIX = "SHARDCACHE_RESULT "
TALLY_FILE = "tally.json"


def _env_int(*names: str, default: int) -> int:
    for name in names:
        value = os.environ.get(name)
        if value:
            return int(value)
    return default


def _log(message: str) -> None:
    print(f"train: {message}", flush=True)


def _tally(batch: pa.RecordBatch, column: str) -> tuple[int, int]:
    ids = batch.column(column).cast(pa.int64())
    total = pc.sum(ids).as_py() or 0
    squares = pc.sum(pc.multiply(ids, ids)).as_py() or 0
    return int(total), int(squares)


def _open_options(args: argparse.Namespace, rank: int, world_size: int) -> dict[str, Any]:
    options: dict[str, Any] = {
        "rank": rank,
        "world_size": world_size,
        "seed": _env_int("SHARDCACHE_SEED", default=0),
        "shuffle": os.environ.get("SHARDCACHE_SHUFFLE", "true").lower() != "false",
    }
    block = _env_int("SHARDCACHE_BLOCK_SIZE", default=0)
    if block:
        options["block_size"] = block
    if args.cache_dir:
        options["cache_dir"] = args.cache_dir
    return options


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", help="dataset URI (embedded mode); default: the sidecar")
    parser.add_argument("--cache-dir", help="embedded mode's cache directory")
    parser.add_argument("--id-column", default="id")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument(
        "--checkpoint-every", type=int, default=0,
        help="commit a checkpoint every N batches (needs $SHARDCACHE_CHECKPOINT_DIR)",
    )  # fmt: skip
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds per batch")
    parser.add_argument("--result-file", type=Path)
    parser.add_argument(
        "--fail-after-batches", type=int, default=0,
        help="exit with status 3 after N batches of this run, as a preempted trainer",
    )  # fmt: skip
    args = parser.parse_args(argv)

    rank = _env_int("SHARDCACHE_RANK", "JOB_COMPLETION_INDEX", "RANK", default=0)
    world_size = _env_int("SHARDCACHE_WORLD_SIZE", "WORLD_SIZE", default=1)
    ckpt_dir = os.environ.get("SHARDCACHE_CHECKPOINT_DIR")
    tally = {"rows": 0, "id_sum": 0, "id_sq_sum": 0, "batches": 0, "step": 0}
    resumed_step: int | None = None
    if ckpt_dir:
        restored = shardcache.checkpoint.restore()
        if restored is not None:
            tally = json.loads((restored / TALLY_FILE).read_text())
            resumed_step = int(tally["step"])
    options = _open_options(args, rank, world_size)
    if ckpt_dir:
        options["resume_from"] = "latest"
    ds = shardcache.open(args.source, **options)
    start = {"epoch": ds.epoch, "position": ds.position}
    run_batches = 0
    _log(
        f"rank {rank} of {world_size}, {len(ds)} rows per epoch, starting at epoch "
        f"{ds.epoch} position {ds.position}"
        + (f" (resumed from checkpoint step {resumed_step})" if resumed_step is not None else "")
    )
    try:
        for epoch in range(ds.epoch, args.epochs):
            ds.set_epoch(epoch)
            for batch in ds.batches(args.batch_size):
                total, squares = _tally(batch, args.id_column)
                tally["rows"] += batch.num_rows
                tally["id_sum"] += total
                tally["id_sq_sum"] += squares
                tally["batches"] += 1
                run_batches += 1
                if args.sleep:
                    time.sleep(args.sleep)
                if (
                    ckpt_dir
                    and args.checkpoint_every
                    and tally["batches"] % args.checkpoint_every == 0
                ):
                    tally["step"] += 1
                    path = Path(ckpt_dir) / f"step-{tally['step']:08d}"
                    path.mkdir()
                    (path / TALLY_FILE).write_text(json.dumps(tally))
                    shardcache.checkpoint.commit(
                        path, step=tally["step"], data_state=ds.state_dict()
                    )
                    _log(f"committed checkpoint step {tally['step']} at row {tally['rows']}")
                if args.fail_after_batches and run_batches >= args.fail_after_batches:
                    _log(f"failing on purpose after {run_batches} batches")
                    return 3
    finally:
        ds.close()
    result = {
        "rank": rank,
        "world_size": world_size,
        "rows": tally["rows"],
        "id_sum": tally["id_sum"],
        "id_sq_sum": tally["id_sq_sum"],
        "epochs": args.epochs,
        "start": start,
        "resumed_from_step": resumed_step,
        "digest": ds.manifest.digest,
    }
    line = json.dumps(result, sort_keys=True)
    print(RESULT_PREFIX + line, flush=True)
    if args.result_file:
        args.result_file.write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
