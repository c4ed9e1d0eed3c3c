"""Deterministic test datasets: tokenized-text-like shards with a unique `uid`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

SCHEMA = pa.schema(
    [
        ("uid", pa.int64()),
        ("tokens", pa.list_(pa.int32())),
        ("text", pa.string()),
    ]
)


def make_table(first_uid: int, rows: int) -> pa.Table:
    uids = list(range(first_uid, first_uid + rows))
    tokens = [[(u * 7 + k) % 50_000 for k in range(u % 13 + 1)] for u in uids]
    text = [f"sample {u} " + "x" * (u % 29) for u in uids]
    return pa.table({"uid": uids, "tokens": tokens, "text": text}, schema=SCHEMA)


def write_local(root: Path, shard_rows: Sequence[int]) -> tuple[str, pa.Table]:
    """`write_dataset` of Parquet shards in the local directory `root`: its file:// URI
    and the whole table in manifest order."""
    return f"file://{root}", write_dataset(pafs.LocalFileSystem(), str(root), shard_rows)


def write_sources(
    base: Path, shard_rows: Mapping[str, Sequence[int]], *, first_uids: Mapping[str, int]
) -> dict[str, Path]:
    """The sources of a mixture: under `base/<name>`, Parquet shards `part-00000.parquet`
    … of `shard_rows[name]` rows whose uids count up from `first_uids.get(name, 0)`, so
    a row's uid names its source. The directories, by name."""
    out = {}
    for name, shards in shard_rows.items():
        root = base / name
        root.mkdir()
        uid = first_uids.get(name, 0)
        for i, rows in enumerate(shards):
            pq.write_table(make_table(uid, rows), root / f"part-{i:05d}.parquet")
            uid += rows
        out[name] = root
    return out


def write_dataset(
    fs: pafs.FileSystem,
    root: str,
    shard_rows: Sequence[int],
    *,
    fmt: str = "parquet",
    row_group_size: int | None = None,
) -> pa.Table:
    """Write shards `part-00000.<ext>` … under `root`; return the whole table in
    manifest order (shard names sort in write order)."""
    fs.create_dir(root, recursive=True)
    tables = []
    uid = 0
    for i, rows in enumerate(shard_rows):
        table = make_table(uid, rows)
        uid += rows
        tables.append(table)
        if fmt == "parquet":
            path = f"{root}/part-{i:05d}.parquet"
            with fs.open_output_stream(path) as out:
                pq.write_table(table, out, row_group_size=row_group_size)
        elif fmt == "arrow":
            path = f"{root}/part-{i:05d}.arrow"
            with fs.open_output_stream(path) as out, ipc.new_file(out, SCHEMA) as writer:
                # Several batches and compression: the decoded form must still be one
                # uncompressed batch.
                for batch in table.to_batches(max_chunksize=max(1, rows // 3 or 1)):
                    writer.write_batch(batch)
        elif fmt == "jsonl":
            path = f"{root}/part-{i:05d}.jsonl"
            with fs.open_output_stream(path) as out:
                for rec in table.to_pylist():
                    out.write((_json(rec) + "\n").encode())
        else:
            raise ValueError(fmt)
    return pa.concat_tables(tables)


def _json(rec: dict[str, object]) -> str:
    import json

    return json.dumps(rec)
