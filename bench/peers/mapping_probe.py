"""Why the memory tier's backing matters: the loop's speed over one memory-mapped file.

    python -m bench.peers.mapping_probe [--root DIR] [--huge-mount DIR]

The same decoded rows (one Arrow IPC record batch) are tallied as the benchmark loop
does (`tallies.Tally`, batches of 256 rows) from: process memory; a fresh
`pyarrow.memory_map` of a file on /dev/shm (what a shardcache reader does for each shard
of each epoch); the same mapping read again; a file in the page cache of the local
disk; and, with `--huge-mount` (root only; it mounts a tmpfs there with `huge=always`
and unmounts it afterwards), a huge-page tmpfs. Best and median GB/s of five rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from bench.peers import dataset, tallies

ROUNDS = 5


def loop_gbps(batch: pa.RecordBatch, batch_size: int = 256) -> float:
    t = tallies.Tally()
    started = time.perf_counter()
    for offset in range(0, batch.num_rows, batch_size):
        t.add_record_batch(batch.slice(offset, batch_size))
    return t.tokens * 4 / (time.perf_counter() - started) / 1e9


def _write(batch: pa.RecordBatch, path: Path) -> None:
    with pa.OSFile(str(path), "wb") as sink, ipc.new_file(sink, batch.schema) as w:
        w.write_batch(batch)


def _mapped(path: Path) -> pa.RecordBatch:
    return ipc.open_file(pa.memory_map(str(path), "r")).get_batch(0)


def probe(batch: pa.RecordBatch, places: dict[str, Path]) -> dict[str, list[float]]:
    files = {}
    for name, directory in places.items():
        files[name] = directory / "probe.arrow"
        _write(batch, files[name])
    results: dict[str, list[float]] = {}
    try:
        for _ in range(ROUNDS):
            results.setdefault("process memory", []).append(loop_gbps(batch))
            for name, path in files.items():
                mapped = _mapped(path)
                results.setdefault(f"{name}, fresh mapping", []).append(loop_gbps(mapped))
                results.setdefault(f"{name}, same mapping again", []).append(loop_gbps(mapped))
    finally:
        for path in files.values():
            path.unlink(missing_ok=True)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument(
        "--root", type=Path, default=Path(tempfile.gettempdir()) / "shardcache-bench-peers"
    )
    p.add_argument("--huge-mount", type=Path, help="mount a huge=always tmpfs here (root)")
    args = p.parse_args(argv)
    spec = dataset.load_spec(args.root)
    if spec is None:
        p.error(f"no dataset under {args.root}: run the harness (or --prepare-only) first")
    table = pq.read_table(dataset.parquet_files(args.root, spec)[0]).combine_chunks()
    batch = table.to_batches()[0]
    shm = Path(tempfile.mkdtemp(prefix="scb-probe-", dir="/dev/shm"))
    disk = Path(tempfile.mkdtemp(prefix="scb-probe-", dir=args.root))
    places = {"/dev/shm (tmpfs, 4 KiB pages)": shm, "local disk page cache": disk}
    mounted = False
    if args.huge_mount is not None:
        args.huge_mount.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "huge=always,size=4G", "tmpfs", str(args.huge_mount)],
            check=True,
        )
        mounted = True
        places["tmpfs huge=always"] = args.huge_mount
    try:
        results = probe(batch, places)
    finally:
        if mounted:
            subprocess.run(["umount", str(args.huge_mount)], check=False)
        os.rmdir(shm)
        os.rmdir(disk)
    print(
        f"{batch.num_rows:,} rows, {batch.column('tokens').values.nbytes / 2**20:,.0f} MiB of tokens"
    )
    print("| backing | best GB/s | median GB/s |\n|---|---|---|")
    for name, values in results.items():
        print(f"| {name} | {max(values):.2f} | {statistics.median(values):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
