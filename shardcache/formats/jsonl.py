"""JSON Lines shards: one JSON object per line; types are inferred by pyarrow."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.json as pajson

from shardcache.formats import budgets, utf8

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


def _read_json(text: bytes, *, explicit: pa.Schema | None = None) -> pa.Table:
    # One block, parsed on this thread: pyarrow's allocator keeps memory per thread,
    # and a piece is too small for its threads to help.
    options = pajson.ReadOptions(use_threads=False, block_size=len(text) + 1)
    parse = pajson.ParseOptions(explicit_schema=explicit, unexpected_field_behavior="infer")
    return pajson.read_json(pa.BufferReader(text), read_options=options, parse_options=parse)


@dataclasses.dataclass(frozen=True)
class _Part:
    """A parsed part of the shard, with where its text lies in the file (to parse it
    again with other types: `read`)."""

    table: pa.Table
    start: int
    size: int


def _parse(piece: bytes, at: int) -> Iterator[_Part]:
    """`piece`, which starts at byte `at` of the file, parsed in parts whose
    `_parse_bound` is under `PARSE_BOUND` (a single line is parsed whole: `MAX_LINE`
    bounds it)."""
    if not piece.strip():
        return
    _check_depth(piece)
    if _parse_bound(piece) > PARSE_BOUND:
        half = piece.rfind(b"\n", 0, len(piece) // 2) + 1 or piece.find(b"\n") + 1
        if 0 < half < len(piece.rstrip(b"\n")):
            yield from _parse(piece[:half], at)
            yield from _parse(piece[half:], at + half)
            return
    yield _Part(_read_json(piece), at, len(piece))


#: Most distinct top-level fields a shard may name: a schema is a few hundred bytes a
#: field, and every row gets a slot for each; real datasets have tens.
MAX_FIELDS = 10_000


def _parts(source: pa.NativeFile) -> Iterator[_Part]:
    """The shard's parsed parts, bounded in text (`MAX_LINE`), parse (`PARSE_BOUND`) and
    fields (`MAX_FIELDS`), its text checked to be UTF-8."""
    names: set[str] = set()
    at, line = 0, 1
    for piece in _pieces(source, max_line=MAX_LINE):
        # pyarrow's parser copies a string's bytes as they are (formats/utf8.py).
        utf8.check_bytes(piece, at=at, line=line)
        for part in _parse(piece, at):
            names.update(part.table.schema.names)
            if len(names) > MAX_FIELDS:
                raise budgets.OverBudget(budgets.FIELDS, found=len(names), limit=MAX_FIELDS)
            yield part
        at += len(piece)
        line += piece.count(b"\n")


#: Where a type holds another: a struct's field by name, a list's values by None.
_Path = tuple[str | None, ...]


def _string_paths(kind: pa.DataType, at: _Path) -> Iterator[_Path]:
    if pa.types.is_string(kind):
        yield at
    elif pa.types.is_struct(kind):
        for i in range(kind.num_fields):
            yield from _string_paths(kind.field(i).type, (*at, kind.field(i).name))
    elif pa.types.is_list(kind):
        yield from _string_paths(kind.value_type, (*at, None))


def _textual(kind: pa.DataType, strings: set[_Path], at: _Path) -> pa.DataType:
    """`kind` with each timestamp at a path in `strings` typed string instead."""
    if pa.types.is_timestamp(kind):
        return pa.string() if at in strings else kind
    if pa.types.is_struct(kind):
        fields = [kind.field(i) for i in range(kind.num_fields)]
        return pa.struct([f.with_type(_textual(f.type, strings, (*at, f.name))) for f in fields])
    if pa.types.is_list(kind):
        field = kind.value_field
        return pa.list_(field.with_type(_textual(field.type, strings, (*at, None))))
    return kind


def _unify(schemas: list[pa.Schema]) -> pa.Schema:
    """The pieces' schemas unified as one parse of the whole file types them: null
    and int64 give way to the other type (`promote_options="permissive"`), and so does
    a timestamp, inferred from strings that look like one, to string where another
    piece has other strings in its place."""
    strings = {
        path for schema in schemas for f in schema for path in _string_paths(f.type, (f.name,))
    }
    textual = [
        pa.schema([f.with_type(_textual(f.type, strings, (f.name,))) for f in schema])
        for schema in schemas
    ]
    return pa.unify_schemas(textual, promote_options="permissive")


def _timestamps_as_text(inferred: pa.DataType, unified: pa.DataType, at: _Path) -> bool:
    """Whether a field inferred as `inferred` has a timestamp where `unified` has a
    string: text that only looked like a time in this part."""
    strings = set(_string_paths(unified, at))
    return bool(_textual(inferred, strings, at) != inferred)


def _retyped(source: pa.NativeFile, part: _Part, schema: pa.Schema) -> _Part:
    """`part` parsed again from its text in `source`, with the fields it has as a
    timestamp where `schema` has a string typed as `schema` types them: a cast would
    give a rendering of the time, not the shard's text."""
    inferred = part.table.schema
    wanted = [
        schema.field(f.name)
        for f in inferred
        if _timestamps_as_text(f.type, schema.field(f.name).type, (f.name,))
    ]
    if not wanted:
        return part
    text = bytes(source.read_at(part.size, part.start))
    table = _read_json(text, explicit=pa.schema(wanted)).select(inferred.names)
    return dataclasses.replace(part, table=table)


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
    one parse of the whole file would type them (`_unify`: a field null in one piece
    and a string in another is a string).
    """
    rows = 0
    schemas: list[pa.Schema] = []
    for part in _parts(source):
        rows += part.table.num_rows
        schemas.append(part.table.schema)
        del part
    if not schemas:
        return 0, pa.schema([])
    return rows, _unify(schemas)


def _no_columns(rows: int) -> pa.Table:
    """A table of `rows` rows and no column (lines that are all `{}`): concatenating
    such tables loses their rows, which the manifest counted."""
    return pa.Table.from_batches([pa.RecordBatch.from_struct_array(pa.nulls(rows, pa.struct([])))])


def read(source: pa.NativeFile, *, budget: budgets.Budget = budgets.UNBOUNDED) -> pa.Table:
    """The whole shard, parsed a piece at a time and typed as `inspect` types it.

    Stops with `budgets.OverBudget` as soon as the pieces decoded so far take more than
    `budget.bytes` or hold more than `budget.rows` rows: the file's text is never in
    memory whole, and what is decoded stays within the budget plus one piece.
    """
    parts: list[_Part] = []
    decoded = rows = 0
    for part in _parts(source):
        decoded += part.table.nbytes
        rows += part.table.num_rows
        over = budgets.over(budget, decoded=decoded, rows=rows)
        if over is not None:
            # Let go of what was decoded before raising: the traceback keeps this frame,
            # and the error may live on (in a future, a status) long after.
            del part
            parts.clear()
            raise over
        parts.append(part)
    if not parts:
        # An empty shard is legal; JSON Lines carries no schema without a row.
        return pa.table({})
    schema = _unify([p.table.schema for p in parts])
    if len(schema) == 0:
        return _no_columns(rows)
    parts = [_retyped(source, p, schema) for p in parts]
    tables = [p.table for p in parts]
    parts.clear()
    # Pieces that lack a field another piece has get a column of nulls for it: sized
    # before it is allocated, which one line of many keys among many empty ones would
    # make far larger than the pieces.
    total = sum(t.nbytes + _filled(t, schema) for t in tables)
    over = budgets.over(budget, decoded=total, rows=rows)
    if over is not None:
        tables.clear()
        raise over
    return pa.concat_tables(tables, promote_options="permissive")
