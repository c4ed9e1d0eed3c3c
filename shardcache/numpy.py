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

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa

from shardcache import errors as _errors

try:
    import numpy as np
    import numpy.typing as npt
except ModuleNotFoundError as _exc:
    raise _errors.missing_extra(_exc, "shardcache.numpy", "sample") from _exc

from shardcache import (
    _adapter_sources,
    _integers,
    batching,
    columns,
    datasets,
    errors,
    mixture_batching,
    mixtures,
    ranks,
    stalls,
    states,
)

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
    """An iterator of dicts of numpy arrays over one rank's share of a dataset, or of
    a mixture of datasets.

    `source` and `open_options` are `shardcache.open()`'s; `rank`/`world_size`
    default as `shardcache.open()`'s do: an initialised torch.distributed process
    group's, else $RANK/$WORLD_SIZE (JAX users pass `jax.process_index()` and
    `jax.process_count()`, or use `shardcache.jax`). Each `iter()` reads the rest of
    the current epoch: after a pass left early, from the next batch not handed out;
    after a pass that reached the epoch's end, the same epoch again from its start.
    `set_epoch` selects the next one.

    A mixture (`shardcache.mixture_batching`): `source` a `shardcache.Mixture`, or
    `mixture={name: URI}` with `weights=` (and `mix_seed=`), each source opened with
    `open_options`, or `mixture=True` for the pod's multi-source DatasetMount
    (`shardcache.open_mixture`). Its batches never end (a mixture has no epoch: bound
    the loop by steps), each `iter()` goes on where the last one stopped, `set_epoch`
    does nothing, and `pack` is refused. State resumes exactly, as for one dataset.
    """

    def __init__(
        self,
        source: str | mixtures.Mixture | None = None,
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
        mixture: Mapping[str, str] | bool | None = None,
        weights: mixtures.Weights | None = None,
        mix_seed: int | None = None,
        **open_options: Any,
    ) -> None:
        if lists not in LISTS:
            raise errors.InputError(f"lists: expected one of {LISTS}, found {lists!r}")
        if isinstance(source, mixtures.Mixture):
            if open_options or mixture is not None or rank is not None or world_size is not None:
                raise errors.InputError(
                    "Batches(a Mixture): expected no open options, mixture=, rank or "
                    "world_size (the mixture's sources were opened with theirs)"
                )
            self._source: _adapter_sources.Source = source
            some = next(iter(source.sources.values()))
            self.rank, self.world_size = some.params.rank, some.params.world_size
        else:
            found = ranks.given_or_env(rank, world_size)
            self.rank, self.world_size = found.rank, found.world_size
            args = dict(
                open_options, source_uri=source, rank=found.rank, world_size=found.world_size
            )
            opener = _adapter_sources.Opener.of(
                args, mixture=mixture, weights=weights, mix_seed=mix_seed
            )
            self._source = opener.open()
        self.options = batching.Options(
            batch_size=batch_size,
            columns=datasets.column_names(columns),
            drop_last=drop_last,
            pack=pack,
            pack_column=pack_column,
            pad_value=pad_value,
        )
        self.lists, self.pad_to = lists, pad_to
        try:
            self._reader: _adapter_sources.Reader = _adapter_sources.reader(
                self._source, self.options
            )
        except errors.ShardcacheError:
            self._source.close()
            raise
        self._fresh = True
        #: Bumped when `set_epoch` or `load_state_dict` moves the reader, so an open
        #: iteration reads on from where they put it (as a `Dataset`'s iterator does).
        #: Not `Dataset.moves`: that also counts the moves a reader makes itself (each
        #: pass seeks its start) and skips, which the open reader follows without a
        #: new start, and a mixture has none.
        self._moves = 0
        #: How long the loop waited for batches, against its steps.
        self.stalls = stalls.StallMeter()

    @property
    def dataset(self) -> datasets.Dataset:
        """The dataset read (an `InputError` for a mixture: see `mixture`)."""
        if not isinstance(self._source, datasets.Dataset):
            raise errors.InputError("Batches.dataset: this reads a mixture; see .mixture")
        return self._source

    @property
    def mixture(self) -> mixtures.Mixture | None:
        """The mixture read, or None when reading one dataset."""
        return self._source if isinstance(self._source, mixtures.Mixture) else None

    @property
    def epoch(self) -> int:
        """The epoch read next (a loaded state's, after `load_state_dict`): a resumed
        training loop starts at it, `for epoch in range(batches.epoch, epochs)`. A
        mixture has no epochs: 0."""
        ds = self._source
        return ds.epoch if isinstance(ds, datasets.Dataset) else 0

    def set_epoch(self, epoch: int) -> None:
        """Read `epoch` next, from its start (unless it is the epoch already being read);
        called between two batches of an open iteration, it reads on from there. A
        mixture has no epochs (its sources move on by themselves): nothing to do.
        Right after `load_state_dict`, before any batch, an epoch before the loaded
        state's is refused (StateMismatchError): it would repeat samples."""
        # Checked here for a mixture too: its loop passes what a dataset's would.
        epoch = _integers.integer(epoch, "epoch", minimum=0)
        ds = self._source
        if not isinstance(ds, datasets.Dataset):
            return
        before = ds.epoch
        # The dataset's own rules, so the adapters cannot drift from them: the same
        # epoch keeps the position, an epoch before a just-loaded state's is refused,
        # and an epoch read before starts afresh without its old skips.
        ds.set_epoch(epoch)
        if ds.epoch != before:
            self._reader = batching.Reader(ds, self.options)
            self._fresh = True
            self._moves += 1

    def __iter__(self) -> Iterator[dict[str, npt.NDArray[Any]]]:
        return self.stalls.wrap(self._batches())

    def skip_batches(self, batches: int) -> states.Skip | None:
        """Skip the next `batches` batches this iterator would hand out, without reading
        them: `batch_size` rows each (the last short one counts as a batch, unless
        `drop_last`, whose trim the walk records on reaching it), recorded in
        `state_dict()` as `Dataset.skip_batches` records a skip, so a resumed run never
        hands them out and `shardcache lineage` says they were skipped. Before any
        batch, it needs no batch size (`.dataset.skip_batches` does: the dataset has
        had no `batches()` call yet). After a pass that reached the epoch's end it
        skips the first batches of the next pass (the epoch again, as the next `iter()`
        reads); between two batches of an open iteration, that iteration reads on after
        them. Returns the recorded range, or None when the epoch had nothing left.

        Refused (InputError) for a mixture (skip a source's through `.mixture`) and
        with `pack` (a batch is packed sequences, not rows: skip rows through
        `.dataset.skip_batches(k, batch_size=rows)`)."""
        ds = self._source
        if not isinstance(ds, datasets.Dataset):
            raise errors.InputError(
                "Batches.skip_batches: this reads a mixture, whose batches draw from every "
                "source; skip a source's batches through .mixture"
            )
        if self.options.pack is not None:
            raise errors.InputError(
                f"Batches.skip_batches: with pack={self.options.pack} a batch is "
                f"{self.options.batch_size} packed sequences, not rows; skip rows with "
                ".dataset.skip_batches(k, batch_size=rows)"
            )
        if self._begin_pass(ds):
            # The next iter() reads on in this pass, after the skip.
            self._fresh = True
        return ds.skip_batches(batches, batch_size=self.options.batch_size)

    def _begin_pass(self, ds: datasets.Dataset) -> bool:
        """Start the epoch again when the last pass reached its end (and say whether it
        did): a pass left before the end goes on from its cursor, so no row it handed
        out is handed out again."""
        if self._fresh or not self._at_epoch_end():
            return False
        ds.seek(0)
        self._reader = batching.Reader(ds, self.options)
        return True

    def _batches(self) -> Iterator[dict[str, npt.NDArray[Any]]]:
        ds = self._source
        if isinstance(ds, datasets.Dataset):
            self._begin_pass(ds)
        self._fresh = False
        while True:
            moves = self._moves
            reader = iter(self._reader)
            try:
                for batch in reader:
                    yield collate(
                        batch,
                        lists=self.lists,
                        pad_value=self.options.pad_value,
                        pad_to=self.pad_to,
                    )
                    if self._moves != moves:
                        # A reader's cursor does not follow its dataset moved under it
                        # (its state would say the new epoch's rows were never read):
                        # read on from where set_epoch or load_state_dict put it.
                        break
                else:
                    return
            finally:
                close = getattr(reader, "close", None)
                if close is not None:
                    close()
            self._fresh = False

    def _at_epoch_end(self) -> bool:
        """Whether the reader's cursor stands at the end of the epoch: the pass ran to its
        end, or the caller took its last batch (a packed remainder too)."""
        state = self._reader.state_dict()
        return bool(state["dataset"]["position"] >= len(self.dataset) and not state["skip"])

    def state_dict(self) -> dict[str, Any]:
        """Where the batches handed out so far end (a small JSON dict)."""
        return self._reader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the next `iter()` at the exact next batch of the run that saved it
        (an open iteration reads on from there)."""
        self._reader.load_state_dict(state)
        self._fresh = True
        self._moves += 1

    def close(self) -> None:
        if isinstance(self._reader, mixture_batching.MixtureReader):
            self._reader.close()
        self._source.close()

    def __enter__(self) -> Batches:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
