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


#: Bytes parsed at a time by `inspect`: its memory stays a small multiple of this,
#: whatever the file's size (issue 13, row 3).
INSPECT_CHUNK = 1 << 20
#: Longest line `inspect` accepts: one JSON object, far beyond a real sample.
MAX_LINE = 64 << 20


def inspect(source: pa.NativeFile) -> tuple[int, pa.Schema]:
    """Rows and schema, streaming: a bounded piece of the file in memory at a time.

    Each piece of whole lines is parsed on its own and the schemas are unified the way
    one parse of the whole file would type them (a field null in one piece and a
    string in another is a string).
    """
    rows = 0
    schemas: list[pa.Schema] = []
    pending = b""
    while True:
        chunk = source.read(INSPECT_CHUNK)
        data = pending + bytes(chunk)
        if not chunk:
            pending, lines = b"", data
        else:
            cut = data.rfind(b"\n")
            if cut < 0:
                if len(data) > MAX_LINE:
                    raise ValueError(f"a JSON Lines line longer than {MAX_LINE} bytes")
                pending = data
                continue
            pending, lines = data[cut + 1 :], data[: cut + 1]
        if lines.strip():
            table = pajson.read_json(pa.BufferReader(lines))
            rows += table.num_rows
            schemas.append(table.schema)
            del table
        if not chunk:
            break
    if not schemas:
        return 0, pa.schema([])
    return rows, pa.unify_schemas(schemas, promote_options="permissive")
