"""Gather rows of several memory-mapped shards into one record batch: one copy.

Sample mode and `Dataset.take` hand out rows in an order no slice follows. Arrow's
`take` on a `list<int32>` column copies about 1 GB/s here (it expands every row to one
index per value, then takes the values), and on a chunked array it first concatenates
the chunks, a copy of every shard. A variable-width row, though, is one contiguous
byte range, and Arrow's `take` on a `large_binary` array copies each taken row with
one memcpy (5-6 GB/s here). So:

- a list of fixed-width values, a string or a binary column is viewed, without a copy,
  as one `large_binary` array over the address span of all the sources' value buffers:
  its offsets are the rows' byte addresses relative to the lowest buffer (rows that
  fall in the gaps between two shards' mappings are never taken), one `take` copies
  each asked row once, in the asked order, and the result's buffers are viewed back as
  the column's type (offsets divided by the value width);
- a fixed-width column (and a fixed-size list of fixed-width values) is copied by numpy
  fancy indexing, one vectorised copy per source shard into one output array;
- anything else (nulls, booleans, structs, nested lists, dictionaries) falls back to
  `pyarrow.compute.take` per source, a concatenation and a reordering take.

No per-row Python in any case: the work per batch is a few numpy calls per shard.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.types as patypes

Indices = npt.NDArray[np.int64]


def gather(
    sources: Sequence[pa.RecordBatch], source_of: Indices, row_of: Indices
) -> pa.RecordBatch:
    """Row i of the result is row `row_of[i]` of `sources[source_of[i]]`; the sources
    share one schema (the first's is the result's)."""
    schema = sources[0].schema
    if len(row_of) == 0:
        return sources[0].slice(0, 0)
    positions = [np.flatnonzero(source_of == s) for s in range(len(sources))]
    rows = [row_of[p] for p in positions]
    columns = [
        _column([src.column(i) for src in sources], positions, rows, len(row_of))
        for i in range(len(schema))
    ]
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def _fixed_width(t: pa.DataType) -> int | None:
    """Bytes per value of a fixed-width type stored as plain bytes, else None."""
    if patypes.is_boolean(t) or patypes.is_dictionary(t) or patypes.is_null(t):
        return None
    if patypes.is_fixed_size_list(t):
        inner = _fixed_width(t.value_type)
        return (
            None
            if inner is None or patypes.is_fixed_size_list(t.value_type)
            else inner * t.list_size
        )
    try:
        bits = t.bit_width
    except ValueError:
        return None
    return bits // 8 if bits % 8 == 0 and bits > 0 else None


def _no_nulls(arrays: Sequence[pa.Array]) -> bool:
    return all(a.null_count == 0 for a in arrays)


def _column(
    arrays: Sequence[pa.Array], positions: list[Indices], rows: list[Indices], n: int
) -> pa.Array:
    t = arrays[0].type
    if _no_nulls(arrays):
        width = _fixed_width(t)
        if width is not None and (
            not patypes.is_fixed_size_list(t) or _no_nulls([a.flatten() for a in arrays])
        ):
            return _fixed(arrays, positions, rows, n, width)
        if _byte_rows(t) is not None and (
            not (patypes.is_list(t) or patypes.is_large_list(t))
            or _no_nulls([a.flatten() for a in arrays])
        ):
            spanned = _spanned(arrays, positions, rows, n)
            if spanned is not None:
                return spanned
    return _fallback(arrays, positions, rows)


def _fixed(
    arrays: Sequence[pa.Array],
    positions: list[Indices],
    rows: list[Indices],
    n: int,
    width: int,
) -> pa.Array:
    out = np.empty((n, width), dtype=np.uint8)
    for arr, pos, take in zip(arrays, positions, rows, strict=True):
        if len(pos):
            out[pos] = _row_bytes(arr, width)[take]
    t = arrays[0].type
    if patypes.is_fixed_size_list(t):
        child = pa.Array.from_buffers(t.value_type, n * t.list_size, [None, pa.py_buffer(out)])
        return pa.FixedSizeListArray.from_arrays(child, type=t)
    return pa.Array.from_buffers(t, n, [None, pa.py_buffer(out)])


def _row_bytes(arr: pa.Array, width: int) -> npt.NDArray[np.uint8]:
    """The array's values as an (len, width) byte matrix, without a copy."""
    if patypes.is_fixed_size_list(arr.type):
        # The child's offset counts values; the list's own offset counts rows.
        child = arr.values
        buf = child.buffers()[1]
        first = (child.offset + arr.offset * arr.type.list_size) * (width // arr.type.list_size)
    else:
        buf = arr.buffers()[1]
        first = arr.offset * width
    flat = np.frombuffer(buf, dtype=np.uint8, count=len(arr) * width, offset=first)
    return flat.reshape(len(arr), width)


def _byte_rows(t: pa.DataType) -> tuple[int, bool] | None:
    """(bytes per value, 64-bit offsets) of a type whose rows are contiguous byte ranges:
    strings, binaries and lists of fixed-width values."""
    if patypes.is_string(t) or patypes.is_binary(t):
        return 1, False
    if patypes.is_large_string(t) or patypes.is_large_binary(t):
        return 1, True
    if patypes.is_list(t) or patypes.is_large_list(t):
        inner = t.value_type
        if patypes.is_fixed_size_list(inner):
            return None
        width = _fixed_width(inner)
        return None if width is None else (width, patypes.is_large_list(t))
    return None


def _values_buffer(arr: pa.Array) -> pa.Buffer | None:
    if patypes.is_list(arr.type) or patypes.is_large_list(arr.type):
        return arr.values.buffers()[1]
    return arr.buffers()[2]


def _byte_offsets(arr: pa.Array, width: int, large: bool) -> tuple[Indices, int]:
    """Row boundaries of `arr` as absolute addresses, and the address of its values."""
    offsets = np.frombuffer(
        arr.buffers()[1],
        dtype=np.int64 if large else np.int32,
        count=len(arr) + 1,
        offset=arr.offset * (8 if large else 4),
    ).astype(np.int64)
    buf = _values_buffer(arr)
    assert buf is not None
    if patypes.is_list(arr.type) or patypes.is_large_list(arr.type):
        base = buf.address + arr.values.offset * width
    else:
        base = buf.address
    return offsets * width + base, base


def _spanned(
    arrays: Sequence[pa.Array], positions: list[Indices], rows: list[Indices], n: int
) -> pa.Array | None:
    t = arrays[0].type
    spec = _byte_rows(t)
    assert spec is not None
    width, large = spec
    if any(_values_buffer(a) is None for a in arrays):
        return None  # no value bytes at all (every row empty): nothing to span
    bounds = [_byte_offsets(a, width, large) for a in arrays]
    order = sorted(range(len(arrays)), key=lambda s: int(bounds[s][0][0]))
    low = int(bounds[order[0]][0][0])
    high = max(int(b[0][-1]) for b in bounds)
    # One offsets array over every source, lowest address first: source s's rows start
    # at row `first[s]`, and the row between two sources (the gap between their
    # mappings) is never taken. Overlapping sources (not separate mappings) cannot be
    # put in one monotone sequence: they take the fallback.
    parts: list[Indices] = []
    first = [0] * len(arrays)
    row = 0
    last = low
    for s in order:
        addrs = bounds[s][0]
        if int(addrs[0]) < last:
            return None
        first[s] = row
        parts.append(addrs - low)
        row += len(addrs)
        last = int(addrs[-1])
    combined = np.concatenate(parts)
    take = np.empty(n, dtype=np.int64)
    for s, (pos, r) in enumerate(zip(positions, rows, strict=True)):
        take[pos] = r + first[s]
    span = pa.foreign_buffer(low, max(1, high - low), base=list(arrays))
    view = pa.Array.from_buffers(
        pa.large_binary(), len(combined) - 1, [None, pa.py_buffer(combined), span]
    )
    taken = pc.take(view, pa.array(take))
    out_offsets = np.frombuffer(taken.buffers()[1], dtype=np.int64, count=n + 1)
    data = taken.buffers()[2]
    if width != 1:
        out_offsets = out_offsets // width
    if not large:
        if int(out_offsets[-1]) >= 2**31:
            return None
        out_offsets = out_offsets.astype(np.int32)
    offsets_buf = pa.py_buffer(out_offsets)
    if patypes.is_list(t) or patypes.is_large_list(t):
        values = pa.Array.from_buffers(t.value_type, int(out_offsets[-1]), [None, data])
        return pa.Array.from_buffers(t, n, [None, offsets_buf], children=[values])
    return pa.Array.from_buffers(t, n, [None, offsets_buf, data])


def _fallback(
    arrays: Sequence[pa.Array], positions: list[Indices], rows: list[Indices]
) -> pa.Array:
    used = [s for s, pos in enumerate(positions) if len(pos)]
    pieces = [pc.take(arrays[s], pa.array(rows[s])) for s in used]
    joined = pieces[0] if len(pieces) == 1 else pa.concat_arrays(pieces)
    # Row i of the result is at `where[i]` of the pieces joined in source order.
    where = np.concatenate([positions[s] for s in used])
    inverse = np.empty_like(where)
    inverse[where] = np.arange(len(where), dtype=np.int64)
    return pc.take(joined, pa.array(inverse))
