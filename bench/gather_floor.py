"""`make bench-gather`: where sample mode's copy stands against its floor, in one run.

`make bench-sample` compares whole passes through `Dataset`. This bench strips the
passes down to the read path on the bench dataset's tokens, decoded once into Arrow
files on /dev/shm and memory-mapped (as the cache serves them), batches of
`--batch-size` rows, every token summed, the variants alternating pass by pass:

- `block`: a zero-copy slice of consecutive rows per batch (block mode's read);
- `sample`: `shardcache.gather` of rows in a random order over all files (sample
  mode's read: ragged rows, one Arrow `take` over the span view);
- `packed`: the same tokens cut into rows of `--packed` tokens, gathered at random: the
  gather's one-length path, one `memmove` per row in one numpy call, with no per-row
  bookkeeping at all, so about the fastest a copy of randomly placed rows runs here;
- `packed-copy`: that gather without the sum: the copy alone;
- `sample-copy`: sample mode's gather without the sum: its copy alone;
- `memcpy`: the same bytes as `sample` copied in the files' order, one numpy copy of
  each batch's contiguous token range into a new array: the floor of any copy of them
  here, with no random access at all (what `sample-copy` is read against).

The gap between `packed` and `block` is what any copying gather pays on this machine for
reading rows at random places instead of one sequential stream (DRAM latency per row);
the gap between `sample` and `packed`, what the ragged rows cost on top; the gap between
`sample-copy` and `memcpy`, what the random placement costs a copy of the same bytes.

    python -m bench.gather_floor [--size 256MiB] [--batch-size 256] [--passes 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from bench import token_passes
from bench.peers import dataset
from shardcache import gather


def mapped(path: Path, batch: pa.RecordBatch) -> pa.RecordBatch:
    with pa.OSFile(str(path), "wb") as f, ipc.new_file(f, batch.schema) as w:
        w.write_batch(batch)
    return ipc.open_file(pa.memory_map(str(path))).get_batch(0)


def packed(batch: pa.RecordBatch, length: int) -> pa.RecordBatch:
    values = batch.column("tokens").flatten()
    rows = len(values) // length
    offsets = pa.array(np.arange(rows + 1, dtype=np.int32) * length)
    return pa.record_batch(
        {
            "uid": pa.array(np.arange(rows, dtype=np.int64)),
            "tokens": pa.ListArray.from_arrays(offsets, values.slice(0, rows * length)),
        }
    )


def summed(batch: pa.RecordBatch) -> int:
    return pc.sum(batch.column("tokens").flatten()).as_py() or 0


def block_pass(sources: list[pa.RecordBatch], size: int) -> int:
    return sum(summed(s.slice(a, size)) for s in sources for a in range(0, len(s), size))


def memcpy_pass(sources: list[pa.RecordBatch], size: int) -> int:
    """The tokens of every `size` consecutive rows copied by one numpy copy each."""
    total = 0
    for s in sources:
        tokens = s.column("tokens")
        values = np.frombuffer(tokens.values.buffers()[1], dtype=np.int32)
        offsets = np.frombuffer(tokens.buffers()[1], dtype=np.int32)
        base = tokens.values.offset
        for a in range(tokens.offset, tokens.offset + len(tokens), size):
            lo = base + int(offsets[a])
            hi = base + int(offsets[min(a + size, tokens.offset + len(tokens))])
            total += len(values[lo:hi].copy())
    return total


def gather_pass(sources: list[pa.RecordBatch], size: int, *, touch: bool = True) -> int:
    """Every row once, in a random order, `size` rows per gathered batch."""
    counts = np.asarray([len(s) for s in sources])
    starts = np.concatenate([[0], np.cumsum(counts)])
    order = np.random.default_rng(0).permutation(int(starts[-1]))
    source_of = np.searchsorted(starts, order, side="right") - 1
    row_of = order - starts[source_of]
    g = gather.Gatherer(sources)
    total = 0
    for a in range(0, len(order), size):
        batch = g.gather(source_of[a : a + size], row_of[a : a + size])
        total += summed(batch) if touch else batch.num_rows
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    token_passes.add_dataset_arguments(p, passes=5, per="variant")
    p.add_argument("--packed", type=int, default=1024, help="tokens per row of `packed`")
    args = p.parse_args(argv)
    spec = token_passes.ensure_dataset(args)
    with tempfile.TemporaryDirectory(prefix="scb-gather-", dir=args.shm_dir) as mem:
        ragged, fixed = [], []
        for i, path in enumerate(dataset.parquet_files(args.root, spec)):
            batch = pa.record_batch(pq.read_table(path).combine_chunks().to_batches()[0])
            ragged.append(mapped(Path(mem) / f"r{i}.arrow", batch))
            fixed.append(mapped(Path(mem) / f"p{i}.arrow", packed(batch, args.packed)))
        size = args.batch_size
        variants: dict[str, Callable[[], int]] = {
            "block": lambda: block_pass(ragged, size),
            "sample": lambda: gather_pass(ragged, size),
            "packed": lambda: gather_pass(fixed, size),
            "packed-copy": lambda: gather_pass(fixed, size, touch=False),
            "sample-copy": lambda: gather_pass(ragged, size, touch=False),
            "memcpy": lambda: memcpy_pass(ragged, size),
        }
        seconds: dict[str, list[float]] = {v: [] for v in variants}
        sums: dict[str, set[int]] = {v: set() for v in variants}
        # Pass 0 faults the mappings in and warms the allocator: not timed.
        for i in range(args.passes + 1):
            for name, run in variants.items():
                t0 = time.perf_counter()
                sums[name].add(run())
                if i:
                    seconds[name].append(time.perf_counter() - t0)
    if len(sums["block"] | sums["sample"]) != 1:
        print(f"FAILED: block and sample read different tokens ({sums})")
        return 1
    tokens = sum(len(s.column("tokens").flatten()) for s in ragged)
    ptokens = sum(len(s.column("tokens").flatten()) for s in fixed)
    rate = {
        v: (ptokens if v.startswith("packed") else tokens) / statistics.median(s)
        for v, s in seconds.items()
    }
    print(
        f"{tokens:,} tokens ({tokens * 4 / (1 << 30):.2f} GiB), batch {size}, packed rows of "
        f"{args.packed} tokens, median of {args.passes} warm passes each"
    )
    for v, r in rate.items():
        print(
            f"  {v:12s} {r / 1e6:8,.1f} M tokens/s  {r * 4 / 1e9:5.2f} GB/s  "
            f"{r / rate['block']:5.2f}x block  "
            f"(passes: {', '.join(f'{s:.3f} s' for s in seconds[v])})"
        )
    print(
        f"RESULT sample_vs_block={rate['sample'] / rate['block']:.2f} "
        f"packed_vs_block={rate['packed'] / rate['block']:.2f} "
        f"sample_copy_vs_memcpy={rate['sample-copy'] / rate['memcpy']:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
