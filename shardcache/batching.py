"""Batches for the framework adapters (`shardcache.torch`, `shardcache.numpy`).

A `Reader` turns one rank's stream into batches of zero-copy Arrow pieces, for one of
`Split.count` loader processes (DataLoader workers), and packs a token-list column into
fixed-length sequences when asked. It knows no framework: the adapters turn the pieces
into tensors or arrays, on the host or straight on a device.

The split is by batch: the rank's stream, cut into batches of `batch_size` rows from
where the reader started, deals batch j to worker j mod count. A DataLoader collects
from its workers in that same round-robin order, so the batches it yields are the ones
a single process would yield, in the same order: nothing read twice, nothing skipped,
whatever the number of workers. Packed, each worker packs the tokens of its own batches:
every token still once, but the sequences depend on the number of workers and each
worker ends with a remainder of its own (docs/adapters.md).

State (`state_dict()`, a small JSON dict) is this worker's cursor: the first row of the
batch it reads next and, when packing, how many tokens of that batch were already
emitted; the remainder carried to the next packed batch is re-read from there on resume
instead of being stored. Every worker resumes at its own cursor; the number of workers
must match the run that saved the state (as torchdata's StatefulDataLoader requires).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Generator, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.types as patypes

from shardcache import _integers, datasets, errors, states

if TYPE_CHECKING:
    from shardcache import selections as selections_

STATE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Options:
    """How a reader cuts its batches."""

    #: Rows per batch; with `pack`, sequences per batch.
    batch_size: int
    #: Columns to read (all when None).
    columns: tuple[str, ...] | None = None
    #: Drop the last, short batch of the epoch (and, when packing, the last partial
    #: sequence) instead of yielding it.
    drop_last: bool = False
    #: Pack the token lists of `pack_column` into sequences of this many tokens.
    pack: int | None = None
    #: The list column to pack; default: the dataset's only list column.
    pack_column: str | None = None
    #: Fills the end of the epoch's last packed sequence.
    pad_value: int = 0

    def __post_init__(self) -> None:
        # Plain ints: they go into every state dict, which must stay JSON.
        object.__setattr__(
            self, "batch_size", _integers.integer(self.batch_size, "batch_size", minimum=1)
        )
        if self.pack is not None:
            object.__setattr__(self, "pack", _integers.integer(self.pack, "pack", minimum=1))


@dataclasses.dataclass(frozen=True)
class Split:
    """This process's share of a rank's batches: every `count`-th, from `index`."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise errors.InputError(f"split index must be in [0, {self.count}), got {self.index}")


@dataclasses.dataclass(frozen=True)
class HostBatch:
    """One batch as zero-copy Arrow pieces.

    Unpacked: `pieces` are record-batch slices whose rows, in order, are the batch.
    Packed: `tokens` are flat value arrays whose concatenation is `shape[0]` sequences
    of `shape[1]` tokens, row-major, for column `column`.
    Not gathered yet (sample mode, from a reader asked to `defer_gather`): `selections`
    whose gathered rows, in order, are the batch, and no pieces (`gathered()`).
    """

    pieces: list[pa.RecordBatch] = dataclasses.field(default_factory=list)
    tokens: list[pa.Array] = dataclasses.field(default_factory=list)
    column: str | None = None
    shape: tuple[int, int] | None = None
    selections: list[selections_.Selection] = dataclasses.field(default_factory=list)
    #: The reader acquires another shard (or ends the epoch) before it reads the next
    #: batch, and this one is a copy (`Dataset.acquires_next`): a consumer that keeps
    #: earlier batches' pieces lets go of them before it asks for the next.
    leaves: bool = False

    @property
    def packed(self) -> bool:
        return self.shape is not None

    def gathered(self) -> HostBatch:
        """This batch with its selections gathered on the CPU (the batch a reader that
        does not defer yields, byte for byte); itself when there are none."""
        if not self.selections:
            return self
        return HostBatch(pieces=[selection.gather() for selection in self.selections])


def host_batches(
    dataset: datasets.Dataset,
    batch_size: int,
    *,
    columns: Sequence[str] | None,
    drop_last: bool = False,
    defer_gather: bool = False,
    stride: int = 1,
) -> Generator[HostBatch, None, None]:
    """`dataset`'s batches as `HostBatch`es of pieces or, in sample mode with
    `defer_gather`, of one selection each (`Dataset.batch_selections`); with `stride`,
    only every `stride`-th (`Dataset.batch_pieces`: the others are not gathered)."""
    if defer_gather and dataset.params.sampled:
        chosen = dataset.batch_selections(batch_size, columns=columns, drop_last=drop_last)
        with contextlib.closing(chosen):
            for j, selection in enumerate(chosen):
                if j % stride == 0:
                    yield HostBatch(selections=[selection])
        return
    pieces = dataset.batch_pieces(batch_size, columns=columns, drop_last=drop_last, stride=stride)
    with contextlib.closing(pieces):
        for chunk in pieces:
            yield HostBatch(pieces=chunk, leaves=dataset.acquires_next)


def list_column(schema: pa.Schema, name: str | None) -> str:
    """The list column to pack: `name`, or the schema's only list column."""
    lists = [f.name for f in schema if patypes.is_list(f.type) or patypes.is_large_list(f.type)]
    if name is None:
        if len(lists) != 1:
            raise errors.InputError(
                f"pack: expected exactly one list column to pack, found {lists or 'none'}; "
                "name it with pack_column="
            )
        return str(lists[0])
    if name not in lists:
        raise errors.InputError(
            f"pack_column: expected one of the list columns {lists}, found {name!r}"
        )
    value_type = schema.field(name).type.value_type
    if not patypes.is_integer(value_type):
        raise errors.InputError(
            f"pack_column {name!r}: expected integer tokens, found {value_type}"
        )
    return name


@dataclasses.dataclass
class _Chunk:
    """A read batch whose tokens are not all emitted yet."""

    position: int
    values: list[pa.Array]
    size: int
    used: int = 0


class Reader:
    """Batches of one rank's stream for one loader process; resumable.

    `defer_gather`: in sample mode, yield unpacked batches as selections, not gathered
    (`HostBatch.selections`) for a consumer that gathers them itself; packed batches
    are always gathered here (packing reads the tokens).
    """

    def __init__(
        self,
        dataset: datasets.Dataset,
        options: Options,
        split: Split | None = None,
        *,
        defer_gather: bool = False,
    ) -> None:
        self._ds = dataset
        self._opt = options
        self._split = split or Split()
        self._defer = defer_gather and options.pack is None
        self._cursor = min(len(dataset), dataset.position + self._split.index * options.batch_size)
        self._skip = 0
        #: The dataset's `moves` when the cursor was last set from it: a move since (a
        #: `skip_batches` or `set_epoch` through `.dataset` between two batches) put the
        #: rank elsewhere (`state_dict`).
        self._seen = dataset.moves
        #: The packed column, known from the first batch's schema.
        self._column: str | None = None

    @property
    def dataset(self) -> datasets.Dataset:
        return self._ds

    @property
    def options(self) -> Options:
        return self._opt

    # --- state ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        ds = self._ds.state_dict()
        cursor, skip = self._place()
        ds["position"] = cursor
        # The dataset may stand past the cursor (the rows `drop_last` trims are recorded
        # as the last batch is made, before it is handed out; a worker walks on past its
        # own batches): a skip there has not happened at the cursor, and one ending
        # after the position is a state that contradicts itself. The walk resumed at the
        # cursor records it again.
        ds["skips"] = [
            s.to_json() for s in states.skips_until(self._ds.skips, self._ds.epoch, cursor)
        ]
        return {
            "version": STATE_VERSION,
            "dataset": ds,
            "skip": skip,
            "batch_size": self._opt.batch_size,
            "pack": self._opt.pack,
            "split": [self._split.index, self._split.count],
        }

    def _place(self) -> tuple[int, int]:
        """(cursor, skip) where this process stands: its own, or where a move of the
        dataset since its last batch put the rank (one process per rank; nothing of the
        place it left is handed out any more)."""
        if self._split.count == 1 and self._ds.moves != self._seen:
            return self._ds.position, 0
        return self._cursor, self._skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the exact next batch of the run that saved `state`."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise errors.StateMismatchError(
                f"expected a reader state of version {STATE_VERSION}, found "
                f"{state.get('version') if isinstance(state, dict) else type(state).__name__}"
            )
        ours = self.state_dict()
        saved = {key: state.get(key) for key in ("batch_size", "pack", "split")}
        if isinstance(saved["split"], list | tuple):
            saved["split"] = list(saved["split"])
        differ = [
            f"{key}: state has {saved[key]!r}, this reader has {ours[key]!r}"
            for key in saved
            if saved[key] != ours[key]
        ]
        if differ:
            raise errors.StateMismatchError(
                "cannot resume: the state was saved with other batching ("
                + "; ".join(differ)
                + "); use the same batch_size, pack and number of loader workers"
            )
        # Checked before the dataset moves: a refused state changes nothing.
        skip = _integers.integer(state.get("skip"), "reader state: skip", minimum=0)
        self._ds.load_state_dict(state.get("dataset"))  # type: ignore[arg-type]
        self._cursor = self._ds.position
        self._skip = skip
        self._seen = self._ds.moves

    # --- iteration --------------------------------------------------------------
    def _seek(self, position: int) -> None:
        self._ds.seek(position)

    def _chunks(self) -> Iterator[tuple[int, HostBatch]]:
        """(position, batch) of this process's read batches from the cursor on."""
        size, count = self._opt.batch_size, self._split.count
        self._cursor, self._skip = self._place()
        start = min(self._cursor, len(self._ds))
        self._seek(start)
        self._seen = self._ds.moves
        # Unpacked, the last short batch is dropped by the dataset; packed, its tokens
        # still count.
        drop = self._opt.drop_last and self._opt.pack is None
        # Only this process's batches are made (in sample mode, only they are gathered).
        batches = host_batches(
            self._ds,
            size,
            columns=self._opt.columns,
            drop_last=drop,
            defer_gather=self._defer,
            stride=count,
        )
        with contextlib.closing(batches):
            if count > 1:
                # A loader worker: its batches are every count-th of the rank's stream.
                for j, batch in enumerate(batches):
                    yield start + j * size * count, batch
                return
            while True:
                # Where the next batch starts is the dataset's place, not the last batch's
                # end: a move between two batches (`skip_batches`, `set_epoch` through
                # `.dataset`) changed it, and the walk reads on from there; counted from
                # the last batch, the state missed the batch handed after a skip, which a
                # resume then handed out again.
                at = self._ds.position
                following = next(batches, None)
                if following is None:
                    return
                self._seen = self._ds.moves
                yield at, following

    def __iter__(self) -> Iterator[HostBatch]:
        if self._opt.pack is None:
            return self._unpacked()
        return self._packed()

    def _unpacked(self) -> Iterator[HostBatch]:
        step = self._opt.batch_size * self._split.count
        for position, batch in self._chunks():
            # Counted as read once handed out: the state taken now resumes after it.
            self._cursor = min(len(self._ds), position + step)
            yield batch
        self._cursor = len(self._ds)

    def _packed(self) -> Iterator[HostBatch]:
        assert self._opt.pack is not None
        length = self._opt.pack
        want = self._opt.batch_size * length
        step = self._opt.batch_size * self._split.count
        held: collections.deque[_Chunk] = collections.deque()
        available = 0
        skip = self._skip
        for position, batch in self._chunks():
            chunk = batch.pieces
            if self._column is None:
                self._column = list_column(chunk[0].schema, self._opt.pack_column)
            column = self._column
            values = [piece.column(column).flatten() for piece in chunk]
            size = sum(len(v) for v in values)
            used = min(skip, size)
            skip = 0
            held.append(_Chunk(position, values, size, used))
            available += size - used
            following = min(len(self._ds), position + step)
            self._note(held, following)
            while available >= want:
                tokens = _take(held, want)
                available -= want
                self._note(held, following)
                yield HostBatch(tokens=tokens, column=column, shape=(self._opt.batch_size, length))
        if available and not self._opt.drop_last:
            tokens = _take(held, available)
            rows = -(-available // length)
            missing = rows * length - available
            if missing:
                value_type = tokens[0].type if tokens else pa.int64()
                tokens.append(pa.array([self._opt.pad_value] * missing, type=value_type))
            self._note(held, len(self._ds))
            yield HostBatch(tokens=tokens, column=self._column, shape=(rows, length))
        self._cursor, self._skip = len(self._ds), 0

    def _note(self, held: collections.deque[_Chunk], following: int) -> None:
        # The first token not yet emitted: the front held chunk's, or else the first of
        # the chunk this process reads next (at `following`).
        if held:
            self._cursor, self._skip = held[0].position, held[0].used
        else:
            self._cursor, self._skip = following, 0


def _take(held: collections.deque[_Chunk], count: int) -> list[pa.Array]:
    """The next `count` tokens of the held chunks, as zero-copy slices; chunks used up
    are dropped."""
    out: list[pa.Array] = []
    while count:
        chunk = held[0]
        offset = chunk.used
        for values in chunk.values:
            if offset >= len(values):
                offset -= len(values)
                continue
            take = min(count, len(values) - offset)
            out.append(values.slice(offset, take))
            chunk.used += take
            count -= take
            offset = 0
            if not count:
                break
        if chunk.used == chunk.size:
            held.popleft()
    while held and held[0].used == held[0].size:
        held.popleft()
    return out


def concat_pieces(pieces: Sequence[pa.RecordBatch]) -> pa.RecordBatch:
    """The pieces as one record batch (a copy only when there are several)."""
    return pieces[0] if len(pieces) == 1 else pa.concat_batches(list(pieces))
