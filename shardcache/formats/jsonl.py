"""JSON Lines shards: one JSON object per line; types are inferred by pyarrow."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pyarrow.json as pajson

from shardcache.formats import budgets

EXTENSIONS: tuple[str, ...] = (".jsonl", ".ndjson", ".json")


#: Bytes of text parsed at a time by `inspect` and `read`, whatever the file's size
#: (issue 13, row 3). Parsing takes up to ~20 times its text (arrays of numbers, measured
#: with pyarrow 26), so a piece costs a few MiB beside what it decodes to.
INSPECT_CHUNK = 256 << 10
#: Longest line accepted: one JSON object, beyond a real sample. Its parse alone may
#: take ~20 times this (80 MiB), the largest part of the decode's fixed overhead
#: (docs/security.md); a longer line is refused, naming both lengths.
MAX_LINE = 4 << 20


def _pieces(source: pa.NativeFile, *, max_line: int) -> Iterator[bytes]:
    """The file in pieces of whole lines, about `INSPECT_CHUNK` bytes each: never more
    of it in memory than a piece plus one unfinished line (at most `max_line`)."""
    pending: list[bytes] = []
    pending_size = 0
    while chunk := bytes(source.read(INSPECT_CHUNK)):
        cut = chunk.rfind(b"\n")
        # The unfinished line so far, or the one this chunk finishes (a line inside one
        # chunk is shorter than the chunk, and the chunk than `max_line`).
        line = pending_size + (len(chunk) if cut < 0 else chunk.find(b"\n"))
        if line > max_line:
            raise budgets.OverBudget(budgets.LINE, found=line, limit=max_line)
        if cut < 0:
            pending.append(chunk)
            pending_size += len(chunk)
            continue
        yield b"".join([*pending, chunk[: cut + 1]])
        pending, pending_size = [chunk[cut + 1 :]], len(chunk) - cut - 1
    tail = b"".join(pending)
    if tail.strip():
        yield tail


def _parse(piece: bytes) -> pa.Table | None:
    if not piece.strip():
        return None
    # One block, parsed on this thread: pyarrow's allocator keeps memory per thread,
    # and a piece is too small for its threads to help.
    options = pajson.ReadOptions(use_threads=False, block_size=len(piece) + 1)
    return pajson.read_json(pa.BufferReader(piece), read_options=options)


def inspect(source: pa.NativeFile) -> tuple[int, pa.Schema]:
    """Rows and schema, streaming: a bounded piece of the file in memory at a time.

    Each piece of whole lines is parsed on its own and the schemas are unified the way
    one parse of the whole file would type them (a field null in one piece and a
    string in another is a string).
    """
    rows = 0
    schemas: list[pa.Schema] = []
    for piece in _pieces(source, max_line=MAX_LINE):
        table = _parse(piece)
        if table is not None:
            rows += table.num_rows
            schemas.append(table.schema)
            del table
    if not schemas:
        return 0, pa.schema([])
    return rows, pa.unify_schemas(schemas, promote_options="permissive")


def read(source: pa.NativeFile, *, budget: budgets.Budget = budgets.UNBOUNDED) -> pa.Table:
    """The whole shard, parsed a piece at a time and typed as `inspect` types it.

    Stops with `budgets.OverBudget` as soon as the pieces decoded so far take more than
    `budget.bytes` or hold more than `budget.rows` rows: the file's text is never in
    memory whole, and what is decoded stays within the budget plus one piece.
    """
    tables: list[pa.Table] = []
    decoded = rows = 0
    for piece in _pieces(source, max_line=MAX_LINE):
        table = _parse(piece)
        if table is None:
            continue
        decoded += table.nbytes
        rows += table.num_rows
        over = budgets.over(budget, decoded=decoded, rows=rows)
        if over is not None:
            # Let go of what was decoded before raising: the traceback keeps this frame,
            # and the error may live on (in a future, a status) long after.
            del table
            tables.clear()
            raise over
        tables.append(table)
    if not tables:
        # An empty shard is legal; JSON Lines carries no schema without a row.
        return pa.table({})
    return pa.concat_tables(tables, promote_options="permissive")
