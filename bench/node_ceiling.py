"""The all-core decode ceiling of `make bench-node`'s cold epoch.

What a cold epoch must do per shard, with nothing else: read the source object, hash
it (sha256, as the cache verifies content identity), decode the Parquet and write it
as one uncompressed Arrow IPC record batch (the memory tier's form). One thread per
usable core, each taking the next shard; pyarrow and hashlib release the GIL for this
work, and each decode is single-threaded (`use_threads=False`) so that a thread is
one core, as a decoder in the sidecar is.
"""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.ipc as ipc
import pyarrow.parquet as pq


@dataclasses.dataclass(frozen=True)
class Ceiling:
    seconds: float
    #: CPU seconds of this process (every thread) over those `seconds`: beside the
    #: sidecar's CPU through the cold epoch, a measure the machine's load moves less.
    cpu_seconds: float
    #: What the decoded files hold, counted after the clock stopped: the reference the
    #: benchmark's passes are checked against.
    rows: int
    uid_sum: int
    tokens: int
    token_sum: int


def _one(fs: pafs.FileSystem, source: str, out: Path) -> None:
    with fs.open_input_file(source) as f:
        data = f.read()
    hashlib.sha256(data).hexdigest()
    table = pq.read_table(pa.BufferReader(data), use_threads=False)
    batch = table.combine_chunks().to_batches()[0]
    with pa.OSFile(str(out), "wb") as sink, ipc.new_file(sink, batch.schema) as writer:
        writer.write_batch(batch)


def _count(files: list[Path]) -> tuple[int, int, int, int]:
    rows = uid_sum = tokens = token_sum = 0
    for path in files:
        batch = ipc.open_file(pa.memory_map(str(path))).get_batch(0)
        values = batch.column("tokens").flatten()
        rows += batch.num_rows
        uid_sum += pc.sum(batch.column("uid")).as_py() or 0
        tokens += len(values)
        token_sum += pc.sum(values).as_py() or 0
    return rows, uid_sum, tokens, token_sum


def measure(fs: pafs.FileSystem, sources: list[str], out_dir: Path, threads: int) -> Ceiling:
    """All `sources` on `threads` threads; the decoded files are written under `out_dir`
    and removed afterwards."""
    out_dir.mkdir(parents=True, exist_ok=True)
    todo = list(enumerate(sources))
    lock = threading.Lock()
    failures: list[BaseException] = []

    def work() -> None:
        while True:
            with lock:
                if not todo or failures:
                    return
                index, source = todo.pop(0)
            try:
                _one(fs, source, out_dir / f"{index:05d}.arrow")
            except BaseException as exc:  # re-raised in the caller
                with lock:
                    failures.append(exc)
                return

    pool = [threading.Thread(target=work, name=f"ceiling-{i}") for i in range(threads)]
    start, cpu_start = time.perf_counter(), time.process_time()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    try:
        if failures:
            raise failures[0]
        counts = _count(sorted(out_dir.iterdir()))
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    return Ceiling(seconds, cpu_seconds, *counts)
