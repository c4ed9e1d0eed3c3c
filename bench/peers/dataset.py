"""The one generated dataset every loader reads: tokenized-text-like rows in Parquet.

Rows are `uid: int64` and `tokens: list<int32>`. Lengths are log-normal (median about
700 tokens, clipped to [16, 8192]) so batches are ragged like real documents; token ids
are Zipf(1.2) draws folded into a GPT-2-sized vocabulary, so they compress like text
rather than like noise. Each Parquet file is generated from (seed, file index) alone,
so generation streams file by file and is reproducible.

`dataset.json` beside the files records the parameters and the expected `Tally`
summary, computed from the generated arrays themselves, which every loader's delivery
is checked against.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bench.peers import tallies

VOCAB = 50257
SPEC_NAME = "dataset.json"
#: Bump when generation changes, so a cached dataset of the old kind is rebuilt.
GENERATOR_VERSION = 1
UID_BASE = 10**12


@dataclasses.dataclass(frozen=True)
class Params:
    #: Target size of the token ids alone (4 bytes each), in bytes.
    size_bytes: int
    seed: int = 0
    #: Token bytes per Parquet file: 64 MiB gives 16 files per GiB, enough for a
    #: shuffled shard order and for two workers to split, few enough to open quickly.
    file_bytes: int = 64 << 20
    #: Rows per Parquet row group: pyarrow's batch readers decode a row group at a time.
    row_group_rows: int = 8192


def _lengths(rng: np.random.Generator, token_budget: int) -> np.ndarray[Any, Any]:
    out: list[np.ndarray[Any, Any]] = []
    total = 0
    while total < token_budget:
        n = rng.lognormal(mean=6.5, sigma=0.9, size=4096).astype(np.int64)
        n = np.clip(n, 16, 8192)
        out.append(n)
        total += int(n.sum())
    lengths: np.ndarray[Any, Any] = np.concatenate(out)
    cut = int(np.searchsorted(np.cumsum(lengths), token_budget)) + 1
    return lengths[:cut]


def generate_file(params: Params, index: int, uid_start: int) -> pa.Table:
    """The rows of Parquet file `index`; uids run on from `uid_start`."""
    rng = np.random.default_rng([params.seed, index, GENERATOR_VERSION])
    lengths = _lengths(rng, params.file_bytes // 4)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    ids = rng.zipf(1.2, size=int(offsets[-1]))
    tokens = ((ids - 1) % VOCAB).astype(np.int32)
    uids = np.arange(uid_start, uid_start + len(lengths), dtype=np.int64) + UID_BASE
    token_lists = pa.ListArray.from_arrays(pa.array(offsets), pa.array(tokens))
    return pa.table({"uid": pa.array(uids), "tokens": token_lists})


def file_count(params: Params) -> int:
    return max(1, -(-params.size_bytes // params.file_bytes))


def load_spec(root: Path) -> dict[str, Any] | None:
    path = root / SPEC_NAME
    if not path.exists():
        return None
    spec: dict[str, Any] = json.loads(path.read_text())
    return spec


def ensure(root: Path, params: Params) -> dict[str, Any]:
    """Generate the Parquet dataset under `root/parquet` unless an identical one is there."""
    wanted = {**dataclasses.asdict(params), "generator_version": GENERATOR_VERSION}
    spec = load_spec(root)
    if (
        spec is not None
        and spec["params"] == wanted
        and all((root / "parquet" / f).exists() for f in spec["files"])
    ):
        return spec
    out = root / "parquet"
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.parquet"):
        stale.unlink()
    started = time.perf_counter()
    expected = tallies.Tally()
    files: list[str] = []
    uid = 0
    for i in range(file_count(params)):
        table = generate_file(params, i, uid)
        uid += table.num_rows
        for batch in table.to_batches():
            expected.add_record_batch(batch)
        name = f"part-{i:05d}.parquet"
        pq.write_table(table, out / name, row_group_size=params.row_group_rows)
        files.append(name)
    spec = {
        "params": wanted,
        "files": files,
        "expected": expected.summary(),
        "parquet_bytes": sum((out / f).stat().st_size for f in files),
        "generate_seconds": round(time.perf_counter() - started, 2),
    }
    (root / SPEC_NAME).write_text(json.dumps(spec, indent=2))
    return spec


def parquet_files(root: Path, spec: dict[str, Any]) -> list[Path]:
    return [root / "parquet" / f for f in spec["files"]]
