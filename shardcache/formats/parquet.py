"""Parquet shards."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

EXTENSIONS: tuple[str, ...] = (".parquet", ".pq")


def inspect(source: pa.NativeFile) -> tuple[int, pa.Schema]:
    meta = pq.ParquetFile(source)
    return meta.metadata.num_rows, meta.schema_arrow


def read(source: pa.NativeFile) -> pa.Table:
    return pq.read_table(source, use_threads=True)
