"""Sample-mode batches gathered on the device, from one copy of each window.

A sample-mode batch is rows from all over its window's shards (`shardcache.selections`).
Today's path gathers them on the CPU (one copy of every row, at host memory speed, a
few GB/s) and then stages the batch through pinned memory. Here, instead:

- Each window is copied to the device **once**: its rows in block-level order are a
  few long runs of consecutive rows of its shards (zero-copy slices of the mappings), so
  the copy is a window-sized copy plan (`_copy_plans`, carried out by `_slabs`: DMA
  straight from the registered mappings, runs merged, list offsets rebased on the host
  from the offsets buffers). The result, a *table*, holds every asked column's values on
  the device and its list offsets on the host.
- Each batch is then one gather **on the device** (memory bandwidth two orders above
  the host link): a fixed-width column by row index (`index_select`); a list column by
  the rows' starts and lengths, read from the table's host offsets with numpy (O(rows),
  never a token), from which the batch's offsets are a cumulative sum on the host, and
  the value index is built on the device (`repeat_interleave` of each row's shift plus
  an `arange`). Every index the batch needs travels in one host-to-device copy.

Tensors: exactly the plain path's (`_tensors.collate` of the CPU-gathered batch): the
same keys, dtypes and values, lists as values + int64 offsets from 0 or padded. Values
are gathered through a signed integer view of their width, so every dtype takes the
same kernel.

Device memory: a table is the window's rows of the asked columns (window rows x row
bytes, 64 MiB for 65,536 rows of 256 int32 tokens) plus its offsets. A reader keeps the
tables of the windows its latest batch read (one, two where a batch crosses a window's
end): a table is dropped once a batch of the same reader no longer reads it, and its
memory is reused by the caching allocator after the copy stream's work on it. The
gathered batches are tensors of their own, not views of a table.

What a plan does not cover (booleans, nulls, strings, schemas that differ between
shards) raises `Unsupported`; the prefetcher then gathers on the CPU (today's path).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from shardcache import batching, selections
from shardcache.torch import _copy_plans, _slabs, _tensors

#: Tables kept at most by default, over every reader (a mixture has one reader per
#: source); the prefetcher keeps `depth` + 1.
MAX_TABLES = 16

#: A signed integer type per value width: one gather kernel for every dtype.
_BY_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Unsupported(Exception):
    """A window or batch this path does not cover: gather it on the CPU instead."""


@dataclasses.dataclass
class _Column:
    name: str
    #: The window's values on the device, in block-level row order.
    values: torch.Tensor
    #: List columns: the window's offsets (int64, rows + 1, from 0), on the host.
    offsets: npt.NDArray[Any] | None
    #: List columns: each row's length, computed once per window (a batch then takes
    #: its rows' starts and lengths with one fancy index each).
    lengths: npt.NDArray[Any] | None = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.lengths = None if self.offsets is None else np.diff(self.offsets)


@dataclasses.dataclass
class _Table:
    columns: list[_Column]
    #: Host memory the window's copy reads, alive until the table goes.
    keep: list[Any]


@dataclasses.dataclass
class Gathered:
    """One batch's tensors (queued on the current stream) and what its copies read."""

    tensors: dict[str, torch.Tensor]
    keep: list[Any]
    #: Windows copied for this batch (0 when its windows were on the device already),
    #: and the copies (runs) they took.
    windows: int = 0
    runs: int = 0
    direct_bytes: int = 0
    staged_bytes: int = 0
    #: Row indices, starts and offsets copied for the batch (no token values).
    index_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class Copying:
    """How a window is copied (`_slabs.launch`'s arguments)."""

    mappings: _slabs.Mappings | None
    locate: _copy_plans.Locate | None
    copy_async: _slabs.CopyAsync | None
    stream: int


class DeviceGather:
    """The tables of the windows in use, and the gathers from them."""

    def __init__(
        self,
        *,
        device: torch.device,
        lists: str,
        pad_value: int,
        pad_to: int | None,
        max_tables: int = MAX_TABLES,
    ) -> None:
        if max_tables < 2:
            # A batch may read two windows (one ending, one starting): both stay.
            raise ValueError(f"max_tables must be >= 2, got {max_tables}")
        self.max_tables = max_tables
        self.device = device
        self.lists = lists
        self.pad_value = pad_value
        self.pad_to = pad_to
        self._tables: dict[selections.WindowRows, _Table] = {}

    def clear(self) -> None:
        """Drop every table (their memory goes back to the allocator)."""
        self._tables.clear()

    @property
    def resident(self) -> int:
        return len(self._tables)

    def gather(self, chosen: Sequence[selections.Selection], copying: Copying) -> Gathered:
        """The batch made of `chosen` (in order) as tensors on the device, its windows
        copied first where they are not there yet. Runs on the current stream."""
        parts = [part for selection in chosen for part in selection.parts]
        if not parts or sum(len(s) for s in chosen) != sum(len(p.rows) for p in parts):
            raise Unsupported("a selection without its window parts")
        cuda = self.device.type == "cuda"
        done = Gathered({}, [])
        tables = [self._table(part.window, copying, done) for part in parts]
        names = [column.name for column in tables[0].columns]
        for table in tables[1:]:
            if [c.name for c in table.columns] != names or any(
                (a.offsets is None) != (b.offsets is None) or a.values.dtype != b.values.dtype
                for a, b in zip(table.columns, tables[0].columns, strict=True)
            ):
                raise Unsupported("windows of one batch with different schemas")
        for table in tables:
            done.keep.extend(table.keep)
        index = _Index(parts, tables)
        host = torch.empty(index.size, dtype=torch.int64, pin_memory=cuda)
        index.fill(host.numpy())
        done.index_bytes = 8 * index.size
        if cuda:
            done.keep.append(host)
        # On the CPU `to` is the same tensor; on torch's `meta` device (the bench's probe
        # of the host work alone) every op is dispatched with no data.
        moved = host.to(self.device, non_blocking=cuda)
        for position, column in enumerate(tables[0].columns):
            values = [table.columns[position] for table in tables]
            if column.offsets is None:
                done.tensors[column.name] = _cat(
                    [
                        _take(c.values, moved[a:b])
                        for c, (a, b) in zip(values, index.rows, strict=True)
                    ]
                )
                continue
            lists = index.lists[position]
            gathered = _cat(
                [
                    _take(c.values, _value_index(moved, segment, self.device))
                    for c, segment in zip(values, lists.parts, strict=True)
                ]
            )
            a, b = lists.offsets
            offsets = moved[a:b]
            if self.lists == "padded":
                done.tensors[column.name] = _tensors.padded(
                    gathered, offsets, lists.longest, pad_value=self.pad_value, pad_to=self.pad_to
                )
            else:
                done.tensors[column.name] = gathered
                done.tensors[f"{column.name}_offsets"] = offsets
        self._evict({part.window for part in parts})
        return done

    def _table(self, window: selections.WindowRows, copying: Copying, done: Gathered) -> _Table:
        table = self._tables.get(window)
        if table is not None:
            return table
        plan = _copy_plans.plan([batching.HostBatch(pieces=window.pieces)], locate=copying.locate)
        if plan is None:
            raise Unsupported(
                f"window {window.index}: a column without a plain tensor form (booleans, "
                "nulls, strings) or shards with different schemas"
            )
        launched = _slabs.launch(
            plan,
            device=self.device,
            mappings=copying.mappings,
            lists="offsets",
            pad_value=0,
            pad_to=None,
            copy_async=copying.copy_async,
            stream=copying.stream,
        )
        tensors = launched.batches[0]
        host_offsets = launched.host_offsets
        columns: list[_Column] = []
        for column in plan.batches[0]:
            offsets = None
            if column.offsets is not None:
                first, last = column.offsets
                offsets = host_offsets[first:last]
            columns.append(_Column(column.name, tensors[column.name], offsets))
        table = _Table(columns, [*launched.keep, host_offsets])
        done.windows += 1
        done.runs += len(plan.runs)
        done.direct_bytes += launched.direct_bytes
        done.staged_bytes += launched.staged_bytes
        self._tables[window] = table
        return table

    def _evict(self, used: set[selections.WindowRows]) -> None:
        """Drop the tables of windows the latest batch of their reader left behind."""
        owners = {window.owner for window in used}
        for window in list(self._tables):
            if window not in used and window.owner in owners:
                del self._tables[window]
        # Oldest first; the latest batch's own windows stay (it may read more).
        spare = [w for w in self._tables if w not in used]
        for window in spare[: max(0, len(self._tables) - self.max_tables)]:
            del self._tables[window]


@dataclasses.dataclass
class _ListIndex:
    #: Per part: its rows' shifts and lengths in the index buffer, and its value count.
    parts: list[_Segment]
    #: The batch's offsets (rows + 1) in the index buffer.
    offsets: tuple[int, int]
    #: Every part's lengths, one after another (the parts' `lengths` ranges).
    lengths: tuple[int, int]
    #: The longest list (set by `_Index.fill`).
    longest: int = 0


@dataclasses.dataclass
class _Segment:
    shift: tuple[int, int]
    lengths: tuple[int, int]
    #: Values the part's rows hold in all (known on the host: no device sync; set by
    #: `_Index.fill`).
    total: int = 0


class _Index:
    """Every index a batch's gather needs, laid out in one int64 buffer: per part its
    rows (fixed-width columns), and per list column the batch's offsets and, per part,
    each row's shift (its start in the window minus its start in the batch) and
    length. Computed from the tables' host offsets and row lengths (made once a window)
    straight into the buffer (`fill`): a few O(rows) numpy passes, no token read."""

    def __init__(self, parts: Sequence[selections.Part], tables: Sequence[_Table]) -> None:
        self._parts = parts
        self._tables = tables
        self.size = 0
        self.rows = [self._reserve(len(part.rows)) for part in parts]
        n = sum(len(part.rows) for part in parts)
        self.lists: dict[int, _ListIndex] = {}
        for position, column in enumerate(tables[0].columns):
            if column.offsets is None:
                continue
            offsets = self._reserve(n + 1)
            first = self.size
            lengths = [self._reserve(len(part.rows)) for part in parts]
            every = (first, self.size)
            segments = [
                _Segment(self._reserve(len(part.rows)), span)
                for part, span in zip(parts, lengths, strict=True)
            ]
            self.lists[position] = _ListIndex(segments, offsets, every)

    def _reserve(self, count: int) -> tuple[int, int]:
        start = self.size
        self.size += count
        return start, self.size

    def fill(self, out: npt.NDArray[Any]) -> None:
        """Write the index into `out` (`size` int64), and set the totals and longest."""
        for part, (a, b) in zip(self._parts, self.rows, strict=True):
            out[a:b] = part.rows
        for position, lists in self.lists.items():
            for part, table, segment in zip(self._parts, self._tables, lists.parts, strict=True):
                window = table.columns[position]
                assert window.lengths is not None
                a, b = segment.lengths
                np.take(window.lengths, part.rows, out=out[a:b])
            a, b = lists.offsets
            offsets = out[a:b]
            offsets[0] = 0
            first, last = lists.lengths
            np.cumsum(out[first:last], out=offsets[1:])
            lists.longest = int(out[first:last].max()) if last > first else 0
            row = 0
            for part, table, segment in zip(self._parts, self._tables, lists.parts, strict=True):
                window = table.columns[position]
                assert window.offsets is not None
                a, b = segment.shift
                shift = out[a:b]
                count = b - a
                np.take(window.offsets, part.rows, out=shift)
                # Part-local: each part's values are gathered into a tensor of their own,
                # so a row's shift is its start in the window less its start in the part.
                shift -= offsets[row : row + count]
                shift += offsets[row]
                segment.total = int(offsets[row + count] - offsets[row])
                row += count


def _value_index(moved: torch.Tensor, segment: _Segment, device: torch.device) -> torch.Tensor:
    """Positions in the window's values of a part's rows' values, in batch order."""
    shift = moved[segment.shift[0] : segment.shift[1]]
    lengths = moved[segment.lengths[0] : segment.lengths[1]]
    # output_size is known on the host: no device synchronisation to size the result.
    index = torch.repeat_interleave(shift, lengths, output_size=segment.total)
    return index.add_(torch.arange(segment.total, dtype=torch.int64, device=device))


def _take(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    raw = values.view(_BY_WIDTH[values.element_size()])
    return raw.index_select(0, index).view(values.dtype)


def _cat(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(list(parts))
