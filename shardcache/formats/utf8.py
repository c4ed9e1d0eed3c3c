"""Text that is not UTF-8, refused at decode.

Neither pyarrow's Parquet reader nor its JSON parser checks the bytes of a string:
scraped text in Latin-1 reaches the memory tier as a `string` column that is not valid
Arrow, and the trainer fails later, in `to_pylist()`, pandas or a tokenizer, with a bare
`UnicodeDecodeError` that names no shard. So every string a shard decodes to is checked
here, and a shard with one that is not UTF-8 is an `InputError` naming the column and
row (Parquet, Arrow IPC) or the byte and line (JSON Lines).

The cost, measured on the 2-core dev machine on a Parquet shard of 117 MB of mostly
English text (100,000 rows, 26 MB zstd): 26 ms (4.5 GB/s, bound by memory) beside the
115 ms pyarrow takes to read it. A JSON Lines piece is checked whole, as one string,
while it is in cache: about 20 µs a 256 KiB piece, 4% of its parse.
"""

from __future__ import annotations

import struct

import pyarrow as pa

from shardcache import errors


def _whole(text: bytes) -> pa.Array:
    """`text` as one `large_string` value, without a copy."""
    offsets = pa.py_buffer(struct.pack("<qq", 0, len(text)))
    return pa.Array.from_buffers(pa.large_string(), 1, [None, offsets, pa.py_buffer(text)])


def _valid(array: pa.Array) -> bool:
    try:
        array.validate(full=True)
    except pa.ArrowInvalid:
        return False
    return True


def check_bytes(text: bytes, *, at: int, line: int) -> None:
    """Raise `InputError` if `text`, which starts at byte `at` and line `line` (from 1)
    of a file, is not UTF-8, naming the byte and line where it stops being so."""
    # Arrow's validator first: several times faster than Python's decode, which also
    # builds the string; the decode only finds the place once the text is known bad.
    if _valid(_whole(text)):
        return
    try:
        text.decode("utf-8")
    except UnicodeDecodeError as exc:
        where = line + text.count(b"\n", 0, exc.start)
        raise errors.InputError(
            f"invalid UTF-8 at byte {at + exc.start} (line {where}): {exc.reason}; "
            "expected text in UTF-8"
        ) from None


def _holds_text(kind: pa.DataType) -> bool:
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return True
    if pa.types.is_string_view(kind):
        return True
    if pa.types.is_dictionary(kind):
        return _holds_text(kind.value_type)
    if isinstance(kind, pa.BaseExtensionType):
        return _holds_text(kind.storage_type)
    return any(_holds_text(kind.field(i).type) for i in range(kind.num_fields))


def _first_invalid(array: pa.Array) -> int | None:
    """The first row of `array` (which fails full validation) that fails alone, found
    by halving: the halves validated read the column about twice."""
    low, high = 0, len(array)
    while high - low > 1:
        middle = (low + high) // 2
        if _valid(array.slice(low, middle - low)):
            low = middle
        else:
            high = middle
    return low if not _valid(array.slice(low, 1)) else None


def check_table(table: pa.Table) -> None:
    """Raise `InputError` naming the column and row if a string in `table` (at any
    depth) is not UTF-8. Arrow's full validation checks exactly that (and, for a nested
    column, its offsets); columns without text are not read."""
    for field, column in zip(table.schema, table.columns, strict=True):
        if not _holds_text(field.type):
            continue
        row = 0
        for chunk in column.chunks:
            try:
                chunk.validate(full=True)
            except pa.ArrowInvalid as exc:
                found = _first_invalid(chunk)
                where = f" at row {row + found}" if found is not None else ""
                raise errors.InputError(
                    f"column {field.name!r} ({field.type}) is not valid{where}: {exc}; "
                    "expected UTF-8 text in a string column (bytes that are not text "
                    "belong in a binary column)"
                ) from exc
            row += len(chunk)
