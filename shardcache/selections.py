"""A sample-mode batch before it is gathered: which rows of which windows it is.

In sample mode `Dataset.batches()` gathers each batch on the CPU (`shardcache.gather`:
one copy of every row). A consumer that gathers elsewhere (the torch device prefetcher
gathers on the GPU) asks `Dataset.batch_selections()` instead and gets, per batch, a
`Selection`:

- `gather()` makes the batch exactly as `batches()` would: the same `Gatherer` over
  the same mapped shards with the same indices, so the same bytes;
- `parts` say where its rows lie in their *windows*. A `WindowRows` is one sample-mode
  window's rows in block-level order (plans rule 7, before rule 8's permutation), as
  zero-copy slices of the mapped shards: a few long runs of consecutive rows, which a
  consumer copies once per window (by DMA from the mappings) and then gathers each
  batch from with `Part.rows`. The same `WindowRows` object is handed out for every
  batch of the window, so its identity says when a copy can be reused.

A batch lies in one window, or in two where it crosses a window's end (or more after an
elastic resume, whose segments cut the sequence anywhere): one `Part` per window, in
batch order.

numpy is needed here, as for sample mode itself.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from shardcache import gather, sequences

Indices = npt.NDArray[np.int64]


@dataclasses.dataclass(eq=False)
class WindowRows:
    """Window `index` of epoch `epoch`'s sequence, as its reader `owner` maps it:
    row i of the window is row i of the `pieces` concatenated (block-level order).
    Compared by identity (see the module docstring)."""

    owner: str
    epoch: int
    index: int
    pieces: list[pa.RecordBatch]
    rows: int


@dataclasses.dataclass(frozen=True, eq=False)
class Part:
    """Consecutive rows of a batch that lie in one window: row i of the part is row
    `rows[i]` of `window`."""

    window: WindowRows
    rows: Indices


@dataclasses.dataclass(eq=False)
class Selection:
    """One sample-mode batch, not gathered yet (see the module docstring)."""

    gatherer: gather.Gatherer
    #: Manifest (dataset-wide) indices of the batch's rows, in order.
    indices: Indices
    #: The manifest's shard offsets (`Sequence.offsets`) and row count.
    shard_offsets: Indices
    total: int
    #: Per manifest shard, its place among the gatherer's sources (`sequences.slots`).
    slots: Indices
    #: Where the rows lie in their windows, in batch order (empty when not asked for).
    parts: list[Part]

    def __len__(self) -> int:
        return len(self.indices)

    @functools.cached_property
    def _located(self) -> tuple[Indices, Indices]:
        # Only a CPU gather needs them: a consumer of `parts` never pays for them.
        return self._locate()

    def _locate(self) -> tuple[Indices, Indices]:
        # The plan's indices are in range: no check (this runs under the GIL in a
        # gather thread at every batch).
        shard_of, row_of = sequences.locate(
            self.shard_offsets, self.total, self.indices, checked=False
        )
        return self.slots[shard_of], row_of

    @property
    def source_of(self) -> Indices:
        """Per row, its source among the gatherer's (the window's mapped shards)."""
        return self._located[0]

    @property
    def row_of(self) -> Indices:
        """Per row, its row in that source."""
        return self._located[1]

    def gather(self) -> pa.RecordBatch:
        """The batch, gathered on the CPU with one copy (what `batches()` yields)."""
        # Not through the cached properties: a gather thread needs them once, and before
        # Python 3.12 every `cached_property` of a class shares one lock.
        source_of, row_of = self._locate()
        return self.gatherer.gather(source_of, row_of)


def gather_many(chunk: Sequence[Selection]) -> list[pa.RecordBatch]:
    """The batches of `chunk` (consecutive selections of one gatherer) gathered with
    one copy: one gather of all their rows, handed out as zero-copy slices of it, in
    order. Each is the batch `Selection.gather()` makes, row for row and byte for byte;
    the slices share the one gathered batch's buffers, which live while any slice does.

    Why: a gather's fixed cost (the numpy and Arrow calls around the copy, under the
    GIL) is paid once per chunk, not once per batch, and a gather thread runs one long
    copy without the GIL instead of many short ones that each take it back
    (docs/benchmarks.md, "Sample mode, session 7").
    """
    if len(chunk) == 1:
        return [chunk[0].gather()]
    first = chunk[0]
    if any(s.gatherer is not first.gatherer for s in chunk):
        raise ValueError("gather_many: the selections are of different gatherers (windows)")
    # Every selection of one gatherer was planned with the same offsets and slots.
    indices = np.concatenate([s.indices for s in chunk])
    shard_of, row_of = sequences.locate(first.shard_offsets, first.total, indices, checked=False)
    batch = first.gatherer.gather(first.slots[shard_of], row_of)
    out: list[pa.RecordBatch] = []
    at = 0
    for s in chunk:
        out.append(batch.slice(at, len(s)))
        at += len(s)
    return out
