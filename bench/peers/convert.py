"""Each peer's own on-disk format, written with that peer's own writer from the Parquet.

- MosaicML Streaming: `streaming.MDSWriter`, columns `uid: int64`, `tokens:
  ndarray:int32` (a fixed dtype, so no per-sample dtype header), no compression (the
  documented fastest read path for local data), default 64 MiB shards.
- LitData: `litdata.optimize`, one input per Parquet file, 64 MB chunks, no
  compression, two workers (the machine has two cores).
- torch map-style dataset: one uncompressed Arrow IPC file, the layout Hugging Face
  `datasets` memory-maps; torch has no writer of its own.

Conversions are cached: a directory holding `_done.json` for the same dataset digest
is reused. Imports of the peers are local, so the torch-free paths never load them.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

_DONE = "_done.json"


def _samples(path: str) -> Iterator[dict[str, Any]]:
    """Rows of one Parquet file as {uid: int, tokens: int32 ndarray}."""
    for batch in pq.ParquetFile(path).iter_batches(batch_size=8192):
        uids = batch.column("uid").to_numpy()
        col = batch.column("tokens")
        offsets = col.offsets.to_numpy()
        values = col.values.to_numpy()
        for i in range(len(uids)):
            yield {"uid": int(uids[i]), "tokens": values[offsets[i] : offsets[i + 1]]}


def _cached(out: Path, key: str) -> bool:
    done = out / _DONE
    return done.exists() and json.loads(done.read_text()).get("key") == key


def _finish(out: Path, key: str, started: float) -> float:
    seconds = round(time.perf_counter() - started, 2)
    (out / _DONE).write_text(json.dumps({"key": key, "seconds": seconds}))
    return seconds


def _fresh(out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)


def conversion_seconds(out: Path) -> float | None:
    done = out / _DONE
    return float(json.loads(done.read_text())["seconds"]) if done.exists() else None


def to_mds(files: list[Path], out: Path, key: str) -> None:
    if _cached(out, key):
        return
    import streaming

    _fresh(out)
    started = time.perf_counter()
    columns = {"uid": "int64", "tokens": "ndarray:int32"}
    with streaming.MDSWriter(out=str(out), columns=columns, compression=None) as writer:
        for f in files:
            for sample in _samples(str(f)):
                writer.write(sample)
    _finish(out, key, started)


def to_litdata(files: list[Path], out: Path, key: str) -> None:
    if _cached(out, key):
        return
    import litdata

    _fresh(out)
    started = time.perf_counter()
    litdata.optimize(
        fn=_samples,
        inputs=[str(f) for f in files],
        output_dir=str(out),
        chunk_bytes="64MB",
        num_workers=min(2, len(files)),
        verbose=False,
        mode="overwrite",
    )
    _finish(out, key, started)


def to_arrow_ipc(files: list[Path], out: Path, key: str) -> None:
    if _cached(out, key):
        return
    _fresh(out)
    started = time.perf_counter()
    schema = pq.read_schema(files[0])
    with pa.OSFile(str(out / "data.arrow"), "wb") as sink, pa.ipc.new_file(sink, schema) as w:
        for f in files:
            for batch in pq.ParquetFile(f).iter_batches(batch_size=8192):
                w.write_batch(batch)
    _finish(out, key, started)
