"""JSON Lines shards: one JSON object per line; types are inferred by pyarrow."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.json as pajson

EXTENSIONS: tuple[str, ...] = (".jsonl", ".ndjson", ".json")


def read(source: pa.NativeFile) -> pa.Table:
    data = source.read()
    if not data.strip():
        # An empty shard is legal; JSON Lines carries no schema without a row.
        return pa.table({})
    return pajson.read_json(pa.BufferReader(data))


def inspect(source: pa.NativeFile) -> tuple[int, pa.Schema]:
    table = read(source)
    return table.num_rows, table.schema
