"""Copy plans: a window of batches as a few byte runs and one array of offsets.

The device prefetcher's per-batch path issues a copy, a reinterpretation, a
concatenation and an offsets rebase per piece of every batch: on a 16 MiB batch that
Python and launch work (0.5-0.7 ms) costs more than the copy itself (0.3 ms at
54.8 GB/s). A plan does that work once per *window* of consecutive batches, on the
host, with no framework in the loop:

- Every column's values of every batch in the window land in one byte buffer, the
  *slab*, column by column and batch by batch in order, so each batch's column is one
  contiguous view of the slab (no concatenation anywhere). The slab is filled by
  `runs`: host byte ranges (zero-copy slices of the shard mappings) and where they land.
  Ranges adjacent in host memory that land adjacent in the slab are merged into one run
  when `locate` says they lie in the same registered mapping: a batch's pieces, and
  consecutive batches, are often neighbours in a shard (the rows of one shuffle block),
  so a window is a few large copies instead of one per piece.
- List offsets are rebased on the host from the offsets buffers (not the token values:
  those are never touched by the CPU) with one numpy subtraction per piece, written
  straight into the buffer the caller gives (pinned memory, copied once per window).

Only what the plain path turns into tensors without a copy is planned: fixed-width
numeric columns and lists of them, with no nulls. Anything else (booleans, nulls,
strings) makes `plan` return None and the caller uses the per-batch path, which also
raises the plain path's errors for what it refuses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.types as patypes

from shardcache import batching, columns

#: Says which registered mapping covers [address, address + size) (its start), or
#: None. Runs are merged only inside one mapping: a copy that spans two registrations
#: is not one DMA transfer.
Locate = Callable[[int, int], int | None]

_OFFSET_TYPES: dict[int, type[np.signedinteger[Any]]] = {4: np.int32, 8: np.int64}


@dataclasses.dataclass
class Run:
    """Host bytes [address, address + size) that land at `at` in the window's slab."""

    address: int
    size: int
    at: int
    #: The mapping's start when the bytes lie in a registered mapping, else None.
    mapping: int | None
    #: The Arrow buffers the bytes belong to, alive until the copy is done.
    buffers: list[pa.Buffer]

    def buffer(self) -> pa.Buffer:
        """The run's bytes as one zero-copy buffer (merged runs span several)."""
        only = self.buffers[0]
        if len(self.buffers) == 1 and (only.address, only.size) == (self.address, self.size):
            return only
        return pa.foreign_buffer(self.address, self.size, base=list(self.buffers))


@dataclasses.dataclass(frozen=True)
class Column:
    """Where one column of one batch lands."""

    name: str
    #: numpy-style dtype name of the values (`columns.DTYPES`).
    dtype: str
    #: Byte range of the values in the slab.
    start: int
    size: int
    #: Index range of `rows + 1` int64 offsets in the window's offsets (list columns).
    offsets: tuple[int, int] | None = None
    #: [sequences, length] of a packed batch.
    shape: tuple[int, int] | None = None


@dataclasses.dataclass(slots=True)
class _OffsetsPiece:
    source: npt.NDArray[Any]  # n + 1 offsets of a piece, a view of its offsets buffer
    at: int  # where offsets[1:] land in the window's offsets
    base: int  # the piece's first value's index in the batch


@dataclasses.dataclass
class Plan:
    """A window of batches: what to copy where, and what each batch is made of."""

    batches: list[list[Column]]
    runs: list[Run]
    slab_bytes: int
    #: int64 offsets in the window (all list columns of all batches).
    offsets_count: int
    _pieces: list[_OffsetsPiece] = dataclasses.field(default_factory=list)
    _starts: list[int] = dataclasses.field(default_factory=list)

    def fill_offsets(self, out: npt.NDArray[Any]) -> None:
        """Write the window's rebased offsets (`offsets_count` int64) into `out`: each
        batch's list column from 0, one numpy subtraction per piece."""
        for index in self._starts:
            out[index] = 0
        for piece in self._pieces:
            source = piece.source
            # In int64 whatever the source's width: the rebased offsets of a batch
            # may pass what the shard's int32 offsets could hold.
            np.subtract(
                source[1:],
                np.int64(int(source[0]) - piece.base),
                out=out[piece.at : piece.at + len(source) - 1],
                dtype=np.int64,
            )

    def longest(self, offsets: npt.NDArray[Any], column: Column) -> int:
        """The longest list of `column` (after `fill_offsets` wrote `offsets`)."""
        assert column.offsets is not None
        first, last = column.offsets
        if last - first < 2:
            return 0
        return int(np.diff(offsets[first:last]).max())


class _Unplannable(Exception):
    """A column the plan does not cover: the per-batch path takes the window."""


@dataclasses.dataclass(slots=True)
class _Span:
    address: int
    size: int
    #: The whole Arrow buffer the bytes lie in (kept alive; never sliced: a slice is a
    #: pyarrow call per piece, the address arithmetic is not).
    buffer: pa.Buffer


@dataclasses.dataclass(frozen=True, slots=True)
class _Kind:
    """What a column's type says once per window, not once per piece."""

    #: numpy-style dtype name of the values (`columns.DTYPES`).
    dtype: str
    #: Bytes per value.
    width: int
    #: List columns: the offsets' numpy type and width (None: a fixed-width column).
    offsets: type[np.signedinteger[Any]] | None = None
    offset_width: int = 0


def _kind(kind: pa.DataType) -> _Kind:
    """The plan's view of a column type, or _Unplannable."""
    if columns.is_list(kind):
        value_type = kind.value_type
        dtype = columns.DTYPES.get(value_type)
        if dtype is None or dtype == "bool":
            raise _Unplannable
        offset_width = 8 if patypes.is_large_list(kind) else 4
        return _Kind(dtype, value_type.byte_width, _OFFSET_TYPES[offset_width], offset_width)
    dtype = columns.DTYPES.get(kind)
    if dtype is None or dtype == "bool":
        raise _Unplannable
    return _Kind(dtype, kind.byte_width)


def _values(array: pa.Array, kind: _Kind) -> _Span | None:
    """A fixed-width array's value bytes, or _Unplannable."""
    buffers = array.buffers()
    if buffers[0] is not None and array.null_count:
        raise _Unplannable
    n = len(array)
    if not n:
        return None
    data = buffers[1]
    return _Span(data.address + array.offset * kind.width, n * kind.width, data)


def _list_values(array: pa.Array, kind: _Kind) -> tuple[_Span | None, npt.NDArray[Any]]:
    """A list array's value bytes and its n + 1 offsets (a zero-copy numpy view)."""
    buffers = array.buffers()
    if buffers[0] is not None and array.null_count:
        raise _Unplannable
    raw = np.frombuffer(
        buffers[1],
        dtype=kind.offsets,
        count=len(array) + 1,
        offset=array.offset * kind.offset_width,
    )
    first, last = int(raw[0]), int(raw[-1])
    if last == first:
        return None, raw
    values = array.values  # the child, unsliced: its own offset applies
    if buffers[2] is not None and values.slice(first, last - first).null_count:
        raise _Unplannable
    data = buffers[3]
    address = data.address + (values.offset + first) * kind.width
    return _Span(address, (last - first) * kind.width, data), raw


class _Builder:
    def __init__(self, locate: Locate | None) -> None:
        self.locate = locate
        self.runs: list[Run] = []
        self.slab = 0
        self.offsets = 0
        self.pieces: list[_OffsetsPiece] = []
        self.starts: list[int] = []

    def align(self, width: int) -> None:
        self.slab += -self.slab % width

    def add(self, span: _Span | None) -> None:
        if span is None:
            return
        mapping = self.locate(span.address, span.size) if self.locate is not None else None
        last = self.runs[-1] if self.runs else None
        if (
            last is not None
            and last.mapping == mapping
            and last.address + last.size == span.address
            and last.at + last.size == self.slab
        ):
            last.size += span.size
            last.buffers.append(span.buffer)
        else:
            self.runs.append(Run(span.address, span.size, self.slab, mapping, [span.buffer]))
        self.slab += span.size


def plan(window: Sequence[batching.HostBatch], *, locate: Locate | None = None) -> Plan | None:
    """The copy plan of `window` (consecutive batches of one reader), or None when a
    column needs the per-batch path (see the module docstring)."""
    try:
        return _plan(window, locate)
    except _Unplannable:
        return None


def _plan(window: Sequence[batching.HostBatch], locate: Locate | None) -> Plan:
    built = _Builder(locate)
    laid: list[list[Column]] = [[] for _ in window]
    if all(batch.packed for batch in window):
        for i, batch in enumerate(window):
            assert batch.column is not None and batch.shape is not None
            kinds = [_kind(array.type) for array in batch.tokens]
            dtype = kinds[0].dtype if kinds else "int64"
            if any(kind.dtype != dtype for kind in kinds):
                raise _Unplannable
            built.align(np.dtype(dtype).itemsize)
            start = built.slab
            for array, kind in zip(batch.tokens, kinds, strict=True):
                built.add(_values(array, kind))
            laid[i].append(
                Column(batch.column, dtype, start, built.slab - start, shape=batch.shape)
            )
        return Plan(laid, built.runs, built.slab, 0)
    if any(batch.packed or not batch.pieces for batch in window):
        raise _Unplannable
    schema = window[0].pieces[0].schema
    if any(piece.schema != schema for batch in window for piece in batch.pieces):
        raise _Unplannable
    # Column by column, then batch by batch: a column's values of consecutive batches
    # are neighbours in the slab, as they often are in the shard.
    for index, field in enumerate(schema):
        kind = _kind(field.type)
        itemsize = np.dtype(kind.dtype).itemsize
        for i, batch in enumerate(window):
            built.align(itemsize)
            start = built.slab
            if kind.offsets is None:
                for piece in batch.pieces:
                    built.add(_values(piece.column(index), kind))
                laid[i].append(Column(field.name, kind.dtype, start, built.slab - start))
                continue
            first = built.offsets
            built.starts.append(first)
            at, base = first + 1, 0
            for piece in batch.pieces:
                span, raw = _list_values(piece.column(index), kind)
                built.add(span)
                built.pieces.append(_OffsetsPiece(raw, at, base))
                n = len(raw) - 1
                at += n
                base += int(raw[n]) - int(raw[0])
            built.offsets = at
            laid[i].append(
                Column(field.name, kind.dtype, start, built.slab - start, offsets=(first, at))
            )
    return Plan(laid, built.runs, built.slab, built.offsets, built.pieces, built.starts)
