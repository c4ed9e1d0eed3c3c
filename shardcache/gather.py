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
  the column's type (offsets divided by the value width). When every asked row has one
  length L (packed sequences), the span is viewed instead as numpy `V<L>` items, one
  starting at every byte, and one fancy indexing copies the rows straight into the
  output values, one `memmove` each, with no Arrow call (ragged rows copied this way, in
  chunks of a few sizes, measured slower than the `take`: docs/benchmarks.md);
- a fixed-width column (and a fixed-size list of fixed-width values) is viewed, also
  without a copy, as one numpy array of `V<width>` items over the address span of all
  the sources' buffers, with a stride of one byte (item k starts at byte k), and one
  fancy indexing copies each asked row with one `memmove`, whatever shard it is in;
- anything else (nulls, booleans, structs, nested lists, dictionaries) falls back to
  `pyarrow.compute.take` per source, a concatenation and a reordering take; the rows
  are grouped by source (one sort) only when a column needs it. Views (`string_view`,
  `binary_view`: what Polars writes) and run-end encoded columns, which `take` has no
  kernel for, have their rows taken per source by `_take` (the 16-byte views as fixed-
  size binary, a run found per row by a binary search) into `large_string`,
  `large_binary` or the runs' values, and get their own type back once gathered.

No per-row Python in any case: the work per batch is a few numpy calls per column
(plus one per shard for a column that falls back).

Before a variable-width column's copy, one numpy read of each asked row's first and last
byte (`_Span.touch`). The copy goes row after row, and each ~4 KB row of a large
mapping starts with a cache miss and a page walk (two, where it crosses a page) that
the copy waits for, one row at a time; that read asks for all of a batch's at once, so
they overlap, and the copy finds them done: up to a quarter more GB/s for the copy
alone on two cores, a few percent for a whole pass there (docs/benchmarks.md, "Sample
mode's copy: the rows' first and last bytes read first").

The Python around the copies holds the GIL, and gathers run on several threads beside
the consumer (`shardcache.gather_ahead`): what a batch runs under the GIL is kept to a
handful of numpy calls on 256-row arrays. Everything that depends on the sources alone
(the views, each row's length, whether every row has one length) is worked out once per
window, and where every source's fixed-width values lie at multiples of their width
from the span's start (Arrow's buffers are 64-byte aligned, so in practice always) the
column is viewed as unsigned integers of that width, which numpy's indexing copies
several times faster than `V<width>` items (docs/benchmarks.md, "Sample mode under the
GIL").
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.types as patypes

from shardcache import errors

Indices = npt.NDArray[np.int64]

#: Arrow's `take`, looked up once: `pc.take`'s wrapper costs a few µs per call under
#: the GIL (the options object, the function's lookup by name).
_TAKE = pc.get_function("take")
_TAKE_OPTIONS = pc.TakeOptions(boundscheck=True)


def gather(
    sources: Sequence[pa.RecordBatch], source_of: Indices, row_of: Indices
) -> pa.RecordBatch:
    """Row i of the result is row `row_of[i]` of `sources[source_of[i]]`; the sources
    share one schema (the first's is the result's)."""
    return Gatherer(sources).gather(source_of, row_of)


class Gatherer:
    """Gathers rows of one set of sources (a window's shards) batch after batch.

    What depends on the sources alone, the span view of each variable-width column, is
    built once, on the column's first gather, and reused by every batch of the window.
    Batches may be gathered from several threads at once (`shardcache.gather_ahead`):
    the views are built under a lock, and are read-only once built.
    """

    def __init__(self, sources: Sequence[pa.RecordBatch]) -> None:
        self.sources = list(sources)
        self.schema = self.sources[0].schema
        rows = sum(src.num_rows for src in self.sources)
        #: Mean bytes of a row over the sources (the columns they have): what sizes a
        #: chunk of batches gathered at once (`shardcache.gather_ahead`).
        self.row_bytes = sum(src.nbytes for src in self.sources) / max(1, rows)
        self._fixed: dict[int, _Fixed | None] = {}
        self._spans: dict[int, _Span | None] = {}
        self._building = threading.Lock()

    def gather(self, source_of: Indices, row_of: Indices) -> pa.RecordBatch:
        if len(row_of) == 0:
            return self.sources[0].slice(0, 0)
        source_of = np.asarray(source_of, dtype=np.int64)
        row_of = np.asarray(row_of, dtype=np.int64)
        # The rows grouped by source, which only the fallback needs: made at most once.
        split: _Split | None = None
        columns = []
        for i in range(len(self.schema)):
            column = self._column(i, source_of, row_of)
            if column is None:
                split = split or _Split.of(source_of, row_of, len(self.sources))
                column = _fallback([src.column(i) for src in self.sources], split)
            columns.append(column)
        return pa.RecordBatch.from_arrays(columns, schema=self.schema)

    def _column(self, i: int, source_of: Indices, row_of: Indices) -> pa.Array | None:
        """Column i gathered without the fallback, or None where it needs it."""
        if i not in self._spans:
            self._build(i)
        fixed = self._fixed[i]
        if fixed is not None:
            return fixed.take(source_of, row_of)
        span = self._spans[i]
        return span.take(source_of, row_of) if span is not None else None

    def _build(self, i: int) -> None:
        """Column i's views, once (`_spans` is filled last: its key says both are)."""
        with self._building:
            if i in self._spans:
                return
            arrays = [src.column(i) for src in self.sources]
            field = self.schema.field(i)
            if not _gatherable(field.type):
                raise errors.InputError(
                    f"sample mode and take() cannot gather column {field.name!r} of type "
                    f"{field.type}: expected a type Arrow's take handles, views "
                    "(string_view, binary_view) in structs and lists, or run-end encoding "
                    "of a whole column; read in block mode (shuffle='block'), or write the "
                    "column with large_string or large_binary in place of views"
                )
            fixed = _Fixed.build(arrays)
            self._fixed[i] = fixed
            self._spans[i] = _Span.build(arrays) if fixed is None and _no_nulls(arrays) else None


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


@dataclasses.dataclass(frozen=True)
class _Fixed:
    """A fixed-width column (or a fixed-size list of fixed-width values) of every source,
    seen as one array of `width`-byte items over the address span of the sources' value
    buffers, item k starting at byte k: row r of source s is item `base[s] + r * width`.
    One numpy indexing copies a batch's rows from all its shards, each with one
    `memmove` (see the module docstring)."""

    type: pa.DataType
    width: int
    base: Indices
    items: npt.NDArray[np.void]
    #: Where every source with rows starts at a multiple of `width` bytes from the
    #: span's start and `width` is 1, 2, 4 or 8: the span as unsigned integers of that
    #: width, row r of source s at `words[first[s] + r]` (else None).
    words: npt.NDArray[np.unsignedinteger[Any]] | None
    first: Indices

    @classmethod
    def build(cls, arrays: Sequence[pa.Array]) -> _Fixed | None:
        t = arrays[0].type
        width = _fixed_width(t)
        if not width or not _no_nulls(arrays):
            return None
        if patypes.is_fixed_size_list(t) and not _no_nulls([a.flatten() for a in arrays]):
            return None
        starts = [_fixed_address(a, width) for a in arrays]
        # Sources without rows have no bytes to span (and maybe no buffer at all).
        ends = [s + len(a) * width for s, a in zip(starts, arrays, strict=True) if len(a)]
        if not ends:
            return None
        low = min(s for s, a in zip(starts, arrays, strict=True) if len(a))
        high = max(ends)
        span = pa.foreign_buffer(low, high - low, base=list(arrays))
        items: npt.NDArray[np.void] = np.ndarray(
            shape=((high - low) - width + 1,),
            dtype=np.dtype(f"V{width}"),
            buffer=span,
            strides=(1,),
        )
        base = np.asarray(starts, dtype=np.int64) - low
        words = None
        if width in (1, 2, 4, 8) and all(
            int(b) % width == 0 for b, a in zip(base, arrays, strict=True) if len(a)
        ):
            words = np.frombuffer(span, dtype=np.dtype(f"u{width}"), count=(high - low) // width)
        return cls(t, width, base, items, words, base // width)

    def take(self, source_of: Indices, row_of: Indices) -> pa.Array:
        n = len(row_of)
        if self.words is not None:
            data = pa.py_buffer(self.words[self.first[source_of] + row_of])
        else:
            data = pa.py_buffer(
                self.items[self.base[source_of] + row_of * self.width].view(np.uint8)
            )
        t = self.type
        if patypes.is_fixed_size_list(t):
            child = pa.Array.from_buffers(t.value_type, n * t.list_size, [None, data])
            return pa.FixedSizeListArray.from_arrays(child, type=t)
        return pa.Array.from_buffers(t, n, [None, data])


def _fixed_address(arr: pa.Array, width: int) -> int:
    """Address of the first row's bytes (0 for an array without rows or buffer)."""
    if patypes.is_fixed_size_list(arr.type):
        # The child's offset counts values; the list's own offset counts rows.
        child = arr.values
        buf = child.buffers()[1]
        first = (child.offset + arr.offset * arr.type.list_size) * (width // arr.type.list_size)
    else:
        buf = arr.buffers()[1]
        first = arr.offset * width
    return 0 if buf is None else int(buf.address) + first


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


def _byte_offsets(arr: pa.Array, width: int, large: bool) -> Indices:
    """Row boundaries of `arr` as absolute addresses."""
    offsets = np.frombuffer(
        arr.buffers()[1],
        dtype=np.int64 if large else np.int32,
        count=len(arr) + 1,
        offset=arr.offset * (8 if large else 4),
    ).astype(np.int64)
    buf = _values_buffer(arr)
    base: int = 0 if buf is None else buf.address
    if patypes.is_list(arr.type) or patypes.is_large_list(arr.type):
        base += arr.values.offset * width
    out: Indices = offsets * width + base
    return out


@dataclasses.dataclass(frozen=True)
class _Span:
    """A variable-width column of every source as one `large_binary` array over the
    address span of their value buffers (see the module docstring)."""

    type: pa.DataType
    width: int
    large: bool
    view: pa.Array
    #: The view's offsets: row r's bytes are [bounds[r], bounds[r + 1]) of the span.
    bounds: Indices
    #: Row of the view where each source's rows start.
    first: Indices
    #: When every row of every source has one length of L > 0 bytes (packed
    #: sequences): the span as `V<L>` items, one starting at every byte; else None.
    items: npt.NDArray[np.void] | None
    #: The span's bytes.
    data: npt.NDArray[np.uint8]

    @classmethod
    def build(cls, arrays: Sequence[pa.Array]) -> _Span | None:
        t = arrays[0].type
        spec = _byte_rows(t)
        if spec is None:
            return None
        lists = patypes.is_list(t) or patypes.is_large_list(t)
        if lists and not _no_nulls([a.flatten() for a in arrays]):
            return None
        width, large = spec
        bounds = [_byte_offsets(a, width, large) for a in arrays]
        used = [b for b in bounds if int(b[-1]) > int(b[0])]
        if not used:
            return None  # no value bytes at all (every row empty): nothing to span
        low = min(int(b[0]) for b in used)
        high = max(int(b[-1]) for b in used)
        # A source without value bytes (no rows, or only empty ones) may have no buffer,
        # or one at any address: its rows are put at the span's start, where they read
        # nothing.
        bounds = [b if int(b[-1]) > int(b[0]) else np.full_like(b, low) for b in bounds]
        order = sorted(range(len(arrays)), key=lambda s: (int(bounds[s][0]), int(bounds[s][-1])))
        # One offsets array over every source, lowest address first: source s's rows
        # start at row `first[s]`, and the row between two sources (the gap between
        # their mappings) is never taken. Overlapping sources (not separate mappings)
        # cannot be put in one monotone sequence: they take the fallback.
        parts: list[Indices] = []
        first = np.zeros(len(arrays), dtype=np.int64)
        row = 0
        last = low
        for s in order:
            addrs = bounds[s]
            if int(addrs[0]) < last:
                return None
            first[s] = row
            parts.append(addrs - low)
            row += len(addrs)
            last = int(addrs[-1])
        combined = np.concatenate(parts)
        span = pa.foreign_buffer(low, max(1, high - low), base=list(arrays))
        view = pa.Array.from_buffers(
            pa.large_binary(), len(combined) - 1, [None, pa.py_buffer(combined), span]
        )
        # One length for every row (the gaps between sources are no rows) is decided
        # here, once per window, not per batch.
        # (The least and the most, not `np.unique`: its sort or hash cost a millisecond a
        # window of 65,536 rows, every epoch.)
        lengths = np.concatenate([np.diff(b) for b in bounds])
        size = int(lengths[0]) if len(lengths) and lengths.min() == lengths.max() else 0
        items: npt.NDArray[np.void] | None = (
            np.ndarray(
                shape=(span.size - size + 1,),
                dtype=np.dtype(f"V{size}"),
                buffer=span,
                strides=(1,),
            )
            if 0 < size <= span.size
            else None
        )
        data = np.frombuffer(span, dtype=np.uint8)
        return cls(t, width, large, view, combined, first, items, data)

    def touch(self, at: Indices) -> None:
        """Read the first and the last byte of rows `at` of the view, all in one numpy
        call, so the misses and page walks the copy would meet row after row overlap
        (the module docstring). Reads nothing outside the span: an empty row at its
        end starts one past its last byte, so the reads stop there; one at its start
        ends at -1, which numpy reads as the last byte. (`np.minimum`, not `np.clip`
        or `np.take`: measured a third of the gain slower.)"""
        edges = np.concatenate((self.bounds[at], self.bounds[at + 1] - 1))
        np.minimum(edges, len(self.data) - 1, out=edges)
        _ = self.data[edges]

    def take(self, source_of: Indices, row_of: Indices) -> pa.Array | None:
        n = len(row_of)
        at = self.first[source_of] + row_of
        self.touch(at)
        if self.items is not None:
            # Rows of one length (packed sequences): the rows are items of one size,
            # and one numpy indexing copies them straight into the output values.
            size = self.items.dtype.itemsize
            data = pa.py_buffer(self.items[self.bounds[at]].view(np.uint8))
            out_offsets = np.arange(n + 1, dtype=np.int64) * size
        else:
            taken = _TAKE.call([self.view, pa.array(at)], _TAKE_OPTIONS)
            out_offsets = np.frombuffer(taken.buffers()[1], dtype=np.int64, count=n + 1)
            data = taken.buffers()[2]
        if self.width != 1:
            out_offsets = out_offsets // self.width
        if not self.large:
            if int(out_offsets[-1]) >= 2**31:
                return None
            out_offsets = out_offsets.astype(np.int32)
        offsets_buf = pa.py_buffer(out_offsets)
        t = self.type
        if patypes.is_list(t) or patypes.is_large_list(t):
            values = pa.Array.from_buffers(t.value_type, int(out_offsets[-1]), [None, data])
            return pa.Array.from_buffers(t, n, [None, offsets_buf], children=[values])
        return pa.Array.from_buffers(t, n, [None, offsets_buf, data])


@dataclasses.dataclass(frozen=True)
class _Split:
    """A batch's rows grouped by source: `positions[s]` are the output positions of
    source s's rows, `rows[s]` those rows."""

    positions: list[Indices]
    rows: list[Indices]

    @classmethod
    def of(cls, source_of: Indices, row_of: Indices, sources: int) -> _Split:
        # One sort, not one pass per source: a window may span many shards.
        order = np.argsort(source_of, kind="stable")
        cuts = np.cumsum(np.bincount(source_of, minlength=sources))[:-1]
        positions = np.split(order, cuts)
        return cls(positions, [row_of[p] for p in positions])


def _fallback(arrays: Sequence[pa.Array], split: _Split) -> pa.Array:
    used = [s for s, pos in enumerate(split.positions) if len(pos)]
    pieces = [_take(arrays[s], split.rows[s]) for s in used]
    joined = pieces[0] if len(pieces) == 1 else pa.concat_arrays(pieces)
    # Row i of the result is at `where[i]` of the pieces joined in source order.
    where = np.concatenate([split.positions[s] for s in used])
    inverse = np.empty_like(where)
    inverse[where] = np.arange(len(where), dtype=np.int64)
    return _restore(pc.take(joined, pa.array(inverse)), arrays[0].type)


# Types Arrow's `take` has no kernel for (pyarrow 26): string and binary views (what
# Polars writes), and run-end encoded arrays. `_take` takes their rows itself, into the
# "plain" type (`large_string`, `large_binary`, the run-end encoded values), which `take`
# and concatenation handle; `_restore` gives the gathered batch the column's type back.
# Each copies only the rows taken, never a whole shard per batch.
_VIEWS = {pa.string_view(): pa.large_string(), pa.binary_view(): pa.large_binary()}
#: Bytes of one view (length, prefix, buffer index and offset; or up to 12 bytes inline).
_VIEW_WIDTH = 16


def _special(t: pa.DataType) -> bool:
    """Whether `t` holds a type that `take` has no kernel for (`_take`)."""
    if t in _VIEWS or patypes.is_run_end_encoded(t):
        return True
    if patypes.is_dictionary(t):
        return False  # `take` takes the indices alone
    return any(_special(t.field(i).type) for i in range(t.num_fields))


def _gatherable(t: pa.DataType, *, top: bool = True) -> bool:
    """Whether rows of a column of type `t` can be gathered (`Gatherer`): every type
    Arrow's `take` handles, and views inside structs and lists, and run-end encoding
    of a whole column."""
    if not _special(t) or t in _VIEWS:
        return True
    if patypes.is_run_end_encoded(t):
        return top and _gatherable(t.value_type, top=False)
    if patypes.is_struct(t) or patypes.is_list(t) or patypes.is_large_list(t):
        return all(_gatherable(t.field(i).type, top=False) for i in range(t.num_fields))
    return False


def _mask(arr: pa.Array, rows: Indices) -> pa.Array | None:
    """Which of `rows` are null in `arr` (None: none is), read from its validity bitmap
    seen as booleans: the taken rows' bits alone, not a pass over the shard."""
    bitmap = arr.buffers()[0]
    if bitmap is None:
        return None
    valid = pa.Array.from_buffers(pa.bool_(), len(arr), [None, bitmap], offset=arr.offset)
    return pc.invert(pc.take(valid, pa.array(rows)))


def _take(arr: pa.Array, rows: Indices) -> pa.Array:
    """Rows `rows` of `arr`, in its plain type (see `_VIEWS`)."""
    t = arr.type
    if not _special(t):
        return pc.take(arr, pa.array(rows))
    if t in _VIEWS:
        # A view is 16 bytes of its own; the long values it points to stay in the
        # source's buffers: take the views as fixed-size binary, then copy the taken
        # values out into the plain type, so the batch holds no mapping.
        views = pa.Array.from_buffers(
            pa.binary(_VIEW_WIDTH), len(arr), arr.buffers()[:2], offset=arr.offset
        )
        taken = pc.take(views, pa.array(rows))
        own = [taken.buffers()[0], taken.buffers()[1], *arr.buffers()[2:]]
        return pa.Array.from_buffers(t, len(taken), own).cast(_VIEWS[t])
    if patypes.is_run_end_encoded(t):
        # A row's run is the first whose end is past it.
        ends = arr.run_ends.to_numpy(zero_copy_only=False)
        runs = np.searchsorted(ends, rows + arr.offset, side="right")
        return _take(arr.values, runs.astype(np.int64))
    if patypes.is_struct(t):
        children = [_take(arr.field(i), rows) for i in range(t.num_fields)]
        fields = [t.field(i).with_type(c.type) for i, c in enumerate(children)]
        return pa.StructArray.from_arrays(children, fields=fields, mask=_mask(arr, rows))
    # A list (`_gatherable`): the values of each taken row, in order.
    offsets = arr.offsets.to_numpy(zero_copy_only=False)  # a view of the shard's
    starts = offsets[rows].astype(np.int64)
    lengths = offsets[rows + 1].astype(np.int64) - starts
    ends = np.cumsum(lengths)
    total = int(ends[-1]) if len(ends) else 0
    taken = _take(arr.values, np.repeat(starts - (ends - lengths), lengths) + np.arange(total))
    large = patypes.is_large_list(t)
    new_offsets = pa.array(np.concatenate([[0], ends]), pa.int64() if large else pa.int32())
    kind = (pa.large_list if large else pa.list_)(t.value_field.with_type(taken.type))
    cls = pa.LargeListArray if large else pa.ListArray
    return cls.from_arrays(new_offsets, taken, type=kind, mask=_mask(arr, rows))


def _restore(arr: pa.Array, t: pa.DataType) -> pa.Array:
    """`arr`, gathered in its plain type, as type `t`."""
    if arr.type == t:
        return arr
    if patypes.is_run_end_encoded(t):
        encoded = pc.run_end_encode(arr, run_end_type=t.run_end_type)
        values = _restore(encoded.values, t.value_type)
        return pa.RunEndEncodedArray.from_arrays(encoded.run_ends, values, type=t)
    return arr.cast(t)  # views, at any depth (a copy of the gathered rows only)
