"""Arrow IPC shards: the file format (Feather v2), or the stream format."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.ipc as ipc

from shardcache.formats import ipc_messages

EXTENSIONS: tuple[str, ...] = (".arrow", ".feather", ".ipc", ".arrows")


def _open(source: pa.NativeFile) -> ipc.RecordBatchFileReader | ipc.RecordBatchStreamReader:
    try:
        return ipc.open_file(source)
    except pa.ArrowInvalid:
        # Not the file format (no footer): read it as a stream from the start.
        source.seek(0)
        return ipc.open_stream(source)


def inspect(source: pa.NativeFile) -> tuple[int, pa.Schema]:
    """Rows and schema from metadata only: no batch is read or decompressed."""
    schema = _open(source).schema
    return ipc_messages.totals(source).rows, schema


def decoded_size(source: pa.NativeFile) -> int:
    """Bytes the shard takes once decoded, from metadata only."""
    return ipc_messages.totals(source).decoded_bytes


def read(source: pa.NativeFile) -> pa.Table:
    return _open(source).read_all()
