"""JSON Lines shards: one JSON object per line; types are inferred by pyarrow."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.json as pajson

EXTENSIONS = (".jsonl", ".ndjson", ".json")


def read(source: pa.NativeFile) -> pa.Table:
    return pajson.read_json(source)


def inspect(source: pa.NativeFile) -> tuple[int, pa.Schema]:
    table = read(source)
    return table.num_rows, table.schema
