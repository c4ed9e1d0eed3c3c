"""JSON Lines shards: one JSON object per line; types are inferred by pyarrow."""

from __future__ import annotations

import re
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


#: Most bytes one parse may allocate by `_parse_bound`; a piece over it is parsed in
#: halves. Parsing gives every row a slot for every field any line of the piece names
#: (nulls included): 10,000 lines of `{}` after one line of 1,000 keys are 80 MB.
PARSE_BOUND = 16 << 20


def _parse_bound(piece: bytes) -> int:
    """An upper bound of what parsing `piece` allocates: each row a slot of at most 12
    bytes (value or offset, validity) for each field, of which there are at most as
    many as colons (every key has one); and the values, at most 8 times the text."""
    rows = piece.count(b"\n") + 1
    return rows * piece.count(b":") * 12 + 8 * len(piece)


#: Deepest nesting of arrays and objects accepted. pyarrow's parser recurses per level
#: and crashes the process (SIGSEGV) somewhere between 5,000 and 20,000 levels: a 40 KB
#: line would take the operator down. Real samples nest a few levels.
MAX_DEPTH = 1000
_STRUCTURE = re.compile(rb'\\.|["\[\]{}]')


def _check_depth(piece: bytes) -> None:
    """Refuse a piece with a line nested deeper than `MAX_DEPTH`, before pyarrow parses it.

    Only lines with that many opening brackets are scanned, bracket by bracket (quotes
    and escapes followed, so brackets inside strings do not count)."""
    if piece.count(b"[") + piece.count(b"{") < MAX_DEPTH:
        return
    for line in piece.split(b"\n"):
        if line.count(b"[") + line.count(b"{") < MAX_DEPTH:
            continue
        depth, in_string = 0, False
        for token in _STRUCTURE.finditer(line):
            char = token.group()
            if char == b'"':
                in_string = not in_string
            elif in_string or len(char) == 2:
                continue
            elif char in (b"[", b"{"):
                depth += 1
                if depth > MAX_DEPTH:
                    raise budgets.OverBudget(budgets.DEPTH, found=depth, limit=MAX_DEPTH)
            else:
                depth -= 1


def _parse(piece: bytes) -> Iterator[pa.Table]:
    """`piece` parsed, in parts whose `_parse_bound` is under `PARSE_BOUND` (a single
    line is parsed whole: `MAX_LINE` bounds it)."""
    if not piece.strip():
        return
    _check_depth(piece)
    if _parse_bound(piece) > PARSE_BOUND:
        half = piece.rfind(b"\n", 0, len(piece) // 2) + 1 or piece.find(b"\n") + 1
        if 0 < half < len(piece.rstrip(b"\n")):
            yield from _parse(piece[:half])
            yield from _parse(piece[half:])
            return
    # One block, parsed on this thread: pyarrow's allocator keeps memory per thread,
    # and a piece is too small for its threads to help.
    options = pajson.ReadOptions(use_threads=False, block_size=len(piece) + 1)
    yield pajson.read_json(pa.BufferReader(piece), read_options=options)


#: Most distinct top-level fields a shard may name: a schema is a few hundred bytes a
#: field, and every row gets a slot for each; real datasets have tens.
MAX_FIELDS = 10_000


def _tables(source: pa.NativeFile) -> Iterator[pa.Table]:
    """The shard's parsed parts, bounded in text (`MAX_LINE`), parse (`PARSE_BOUND`) and
    fields (`MAX_FIELDS`)."""
    names: set[str] = set()
    for piece in _pieces(source, max_line=MAX_LINE):
        for table in _parse(piece):
            names.update(table.schema.names)
            if len(names) > MAX_FIELDS:
                raise budgets.OverBudget(budgets.FIELDS, found=len(names), limit=MAX_FIELDS)
            yield table


def _row_width(kind: pa.DataType) -> int:
    """Most bytes a row of a null of type `kind` takes, filled in by a concatenation."""
    if pa.types.is_null(kind):
        return 0
    if pa.types.is_struct(kind):
        return 1 + sum(_row_width(kind.field(i).type) for i in range(kind.num_fields))
    try:
        return (int(kind.bit_width) + 7) // 8 + 1
    except ValueError:  # not fixed-width: an offset (lists, strings)
        return 9


def _filled(table: pa.Table, schema: pa.Schema) -> int:
    """Bytes the concatenation adds to `table` to give it `schema`: a column of nulls
    for every field it lacks or has with another type."""
    extra = 0
    for field in schema:
        index = table.schema.get_field_index(field.name)
        if index < 0 or table.schema.field(index).type != field.type:
            extra += table.num_rows * _row_width(field.type)
    return extra


def inspect(source: pa.NativeFile) -> tuple[int, pa.Schema]:
    """Rows and schema, streaming: a bounded piece of the file in memory at a time.

    Each piece of whole lines is parsed on its own and the schemas are unified the way
    one parse of the whole file would type them (a field null in one piece and a
    string in another is a string).
    """
    rows = 0
    schemas: list[pa.Schema] = []
    for table in _tables(source):
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
    for table in _tables(source):
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
    # Pieces that lack a field another piece has get a column of nulls for it: sized
    # before it is allocated, which one line of many keys among many empty ones would
    # make far larger than the pieces.
    schema = pa.unify_schemas([t.schema for t in tables], promote_options="permissive")
    total = sum(t.nbytes + _filled(t, schema) for t in tables)
    over = budgets.over(budget, decoded=total, rows=rows)
    if over is not None:
        tables.clear()
        raise over
    return pa.concat_tables(tables, promote_options="permissive")
