"""numpy adapter: batches as dicts of numpy arrays, for JAX and anything numpy-shaped.

    it = shardcache.numpy.Batches("s3://bucket/tokens/", batch_size=1024,
                                  columns=["tokens"], pack=2048)
    for batch in it:                 # {"tokens": int32 array of shape (1024, 2048)}
        ...
    state = it.state_dict()          # resume with it.load_state_dict(state)

Arrays are views of the memory-mapped Arrow buffers where a batch is one piece (no
copy; they are read-only), and one concatenation otherwise. Columns, packing and state
work as in `shardcache.torch` (see `shardcache.batching`). numpy is imported here, not
by `import shardcache`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from shardcache import _open, _open_options, batching, columns, datasets, errors, ranks, stalls

LISTS = ("offsets", "padded")


def _values(pieces: Sequence[pa.Array], name: str) -> npt.NDArray[Any]:
    parts: list[npt.NDArray[Any]] = []
    for piece in pieces:
        array, dtype = columns.fixed(piece, name=name)
        view = array.to_numpy(zero_copy_only=True)
        parts.append(view.view(np.bool_) if dtype == "bool" else view)
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts)


def _offsets(pieces: Sequence[pa.Array]) -> npt.NDArray[np.int64]:
    """The pieces' offsets rebased into one int64 array from 0 (vectorised)."""
    parts: list[npt.NDArray[np.int64]] = [np.zeros(1, dtype=np.int64)]
    base = 0
    for piece in pieces:
        offsets = piece.offsets.to_numpy(zero_copy_only=True).astype(np.int64)
        parts.append(offsets[1:] - offsets[0] + base)
        base += int(offsets[-1] - offsets[0])
    return np.concatenate(parts)


def _padded(
    values: npt.NDArray[Any], offsets: npt.NDArray[np.int64], *, pad_value: int, pad_to: int | None
) -> npt.NDArray[Any]:
    lengths = np.diff(offsets)
    longest = int(lengths.max()) if len(lengths) else 0
    width = longest if pad_to is None else pad_to
    if longest > width:
        raise errors.InputError(
            f"pad_to={pad_to}: a list in this batch has {longest} values; raise pad_to, "
            "or pack the lists with pack="
        )
    out = np.full((len(lengths), width), pad_value, dtype=values.dtype)
    out[np.arange(width)[None, :] < lengths[:, None]] = values
    return out


def collate(
    batch: batching.HostBatch,
    *,
    lists: str = "offsets",
    pad_value: int = 0,
    pad_to: int | None = None,
) -> dict[str, npt.NDArray[Any]]:
    """The batch as numpy arrays by column name; list columns as values plus
    `<name>_offsets`, or padded; a packed batch as one [sequences, pack] array."""
    if lists not in LISTS:
        raise errors.InputError(f"lists: expected one of {LISTS}, found {lists!r}")
    if batch.shape is not None:
        assert batch.column is not None
        return {batch.column: _values(batch.tokens, batch.column).reshape(batch.shape)}
    out: dict[str, npt.NDArray[Any]] = {}
    for index, field in enumerate(batch.pieces[0].schema):
        pieces = [piece.column(index) for piece in batch.pieces]
        if not columns.is_list(field.type):
            out[field.name] = _values(pieces, field.name)
            continue
        values = _values([p.flatten() for p in pieces], field.name)
        offsets = _offsets(pieces)
        if lists == "padded":
            out[field.name] = _padded(values, offsets, pad_value=pad_value, pad_to=pad_to)
        else:
            out[field.name] = values
            out[f"{field.name}_offsets"] = offsets
    return out


class Batches:
    """An iterator of dicts of numpy arrays over one rank's share of a dataset.

    `source` and `open_options` are `shardcache.open()`'s; `rank`/`world_size`
    default to $RANK/$WORLD_SIZE (JAX users pass `jax.process_index()` and
    `jax.process_count()`, or use `shardcache.jax`). Each `iter()` reads the rest of
    the current epoch; `set_epoch` selects the next one.
    """

    def __init__(
        self,
        source: str | None = None,
        *,
        batch_size: int,
        columns: Sequence[str] | None = None,
        drop_last: bool = False,
        pack: int | None = None,
        pack_column: str | None = None,
        pad_value: int = 0,
        lists: str = "offsets",
        pad_to: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        **open_options: Any,
    ) -> None:
        unknown = sorted(set(open_options) - set(_open_options.KINDS))
        if unknown:
            raise errors.InputError(f"unknown option(s) {unknown} for shardcache.open()")
        if lists not in LISTS:
            raise errors.InputError(f"lists: expected one of {LISTS}, found {lists!r}")
        found = ranks.resolve(rank, world_size, ranks.from_env())
        self.rank, self.world_size = found.rank, found.world_size
        args = dict(open_options, source_uri=source, rank=found.rank, world_size=found.world_size)
        _open_options.check(args)
        self._dataset: datasets.Dataset = _open.open(**args)
        self.options = batching.Options(
            batch_size=batch_size,
            columns=tuple(columns) if columns is not None else None,
            drop_last=drop_last,
            pack=pack,
            pack_column=pack_column,
            pad_value=pad_value,
        )
        self.lists, self.pad_to = lists, pad_to
        self._reader = batching.Reader(self._dataset, self.options)
        self._fresh = True
        #: How long the loop waited for batches, against its steps.
        self.stalls = stalls.StallMeter()

    @property
    def dataset(self) -> datasets.Dataset:
        return self._dataset

    def set_epoch(self, epoch: int) -> None:
        """Read `epoch` next, from its start (unless it is the epoch already being read)."""
        if epoch != self._dataset.epoch:
            state = self._dataset.state_dict()
            state.update(epoch=epoch, position=0)
            self._dataset.load_state_dict(state)
            self._reader = batching.Reader(self._dataset, self.options)
            self._fresh = True

    def __iter__(self) -> Iterator[dict[str, npt.NDArray[Any]]]:
        return self.stalls.wrap(self._batches())

    def _batches(self) -> Iterator[dict[str, npt.NDArray[Any]]]:
        if not self._fresh:
            # A finished pass: the next one is the same epoch again, from its start.
            state = self._dataset.state_dict()
            state["position"] = 0
            self._dataset.load_state_dict(state)
            self._reader = batching.Reader(self._dataset, self.options)
        self._fresh = False
        for batch in self._reader:
            yield collate(
                batch, lists=self.lists, pad_value=self.options.pad_value, pad_to=self.pad_to
            )

    def state_dict(self) -> dict[str, Any]:
        """Where the batches handed out so far end (a small JSON dict)."""
        return self._reader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the next `iter()` at the exact next batch of the run that saved it."""
        self._reader.load_state_dict(state)
        self._fresh = True

    def close(self) -> None:
        self._dataset.close()

    def __enter__(self) -> Batches:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
