"""Arrow IPC shards: the file format (Feather v2), or the stream format."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.ipc as ipc

EXTENSIONS: tuple[str, ...] = (".arrow", ".feather", ".ipc", ".arrows")


def _open(source: pa.NativeFile) -> ipc.RecordBatchFileReader | ipc.RecordBatchStreamReader:
    try:
        return ipc.open_file(source)
    except pa.ArrowInvalid:
        # Not the file format (no footer): read it as a stream from the start.
        source.seek(0)
        return ipc.open_stream(source)


def inspect(source: pa.NativeFile) -> tuple[int, pa.Schema]:
    reader = _open(source)
    if isinstance(reader, ipc.RecordBatchFileReader):
        rows = sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
    else:
        rows = sum(batch.num_rows for batch in reader)
    return rows, reader.schema


def read(source: pa.NativeFile) -> pa.Table:
    return _open(source).read_all()
