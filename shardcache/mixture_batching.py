"""Batches of a mixture for the framework adapters: `shardcache.batching` for a
`shardcache.Mixture` instead of one `Dataset`.

A `MixtureReader` yields the mixture's batches (`HostBatch`es of zero-copy pieces, as
`batching.Reader` does) for one of `Split.count` loader processes. The split is by
step: the mixture's batches from where the reader started, step t dealt to worker
(t - start) mod count, so a DataLoader that collects from its workers round-robin
yields exactly the batches one process would, in the same order: no batch read twice,
none skipped.

A worker does not read the other workers' batches. Which source serves step t is a
pure function of (seed, t) (`mixtures.draw`), and every batch takes `batch_size` rows
of its source, so each worker knows where every source stands at any step without
reading: it keeps a cursor per source (epoch, position), moves the drawn source's by
`batch_size` rows for each step it passes (into the source's next epoch where this
one ends, as the mixture does), and seeks a source only when it reads from it.

State (`state_dict()`, a small JSON dict) is a mixture state (`Mixture.state_dict()`)
at this worker's next step, with every source at its position there, plus the batch
size and the split. Every worker resumes at its own next step; the number of workers
must match the run that saved the state, as for `batching.Reader`. Packing (`pack=`)
is not offered for mixtures: a packed sequence would mix sources and carry a remainder
across them.

A mixture has no epochs of its own, so a reader's iteration has no end: bound the loop
by steps (`itertools.islice`, or `zip(range(n), loader)`).
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from shardcache import batching, datasets, errors, mixtures, plans

if TYPE_CHECKING:
    from shardcache import selections

STATE_VERSION = 1
_KIND = "mixture-reader"


class MixtureReader:
    """Batches of a mixture for one loader process; resumable."""

    def __init__(
        self,
        mixture: mixtures.Mixture,
        options: batching.Options,
        split: batching.Split | None = None,
        *,
        defer_gather: bool = False,
    ) -> None:
        if options.pack is not None:
            raise errors.InputError(
                "pack: expected None with a mixture, found "
                f"{options.pack}: a packed sequence would mix sources; pack each source "
                "with its own reader, or read the mixture's rows unpacked"
            )
        self._mix = mixture
        self._opt = options
        self._split = split or batching.Split()
        #: Sample-mode sources' batches as selections, not gathered (`batching.Reader`).
        self._defer = defer_gather
        self._restart(mixture.step + self._split.index)
        #: Open batch streams of the sources (`batching.host_batches`), at `batch_size`
        #: rows: kept while a source is read at consecutive positions (one worker), else
        #: reopened.
        self._streams: dict[str, Generator[batching.HostBatch, None, None]] = {}

    def _restart(self, cursor: int) -> None:
        """Take every source's position from its dataset, at the mixture's step."""
        #: The step every cursor in `_where` stands at.
        self._at = self._mix.step
        self._where = {name: (ds.epoch, ds.position) for name, ds in self._mix.sources.items()}
        #: The next step this worker reads.
        self._cursor = cursor

    @property
    def mixture(self) -> mixtures.Mixture:
        return self._mix

    @property
    def options(self) -> batching.Options:
        return self._opt

    # --- where the sources stand --------------------------------------------------
    def _length(self, ds: datasets.Dataset, epoch: int) -> int:
        return plans.rank_samples(ds.manifest.total_rows, ds.params.with_epoch(epoch))

    def _moved(self, name: str, where: tuple[int, int], rows: int) -> tuple[int, int]:
        """`where` of source `name` after `rows` more of its rows."""
        ds = self._mix.sources[name]
        epoch, position = where
        while rows:
            length = self._length(ds, epoch)
            if length == 0:
                raise errors.InputError(
                    f"mix(): source {name!r} has no rows for rank {ds.params.rank} but was "
                    "drawn (its weight is above 0): give it rows or weight 0"
                )
            if position >= length:
                epoch, position = epoch + 1, 0
                continue
            take = min(rows, length - position)
            position += take
            rows -= take
        return epoch, position

    def _walked(self, step: int) -> dict[str, tuple[int, int]]:
        """Every source's (epoch, position) at `step` (>= the step they stand at)."""
        where = dict(self._where)
        for t in range(self._at, step):
            name = self._mix.drawn(t)
            where[name] = self._moved(name, where[name], self._opt.batch_size)
        return where

    # --- state --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        where = self._walked(self._cursor)
        state = self._mix.state_dict()
        for name, source in state["sources"].items():
            source["epoch"], source["position"] = where[name]
        state.update(step=self._cursor, batch_size=self._opt.batch_size)
        return {
            "version": STATE_VERSION,
            "kind": _KIND,
            "mixture": state,
            "batch_size": self._opt.batch_size,
            "split": [self._split.index, self._split.count],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the exact next batch of the run that saved `state`."""
        if not isinstance(state, dict) or state.get("kind") != _KIND:
            found = state.get("kind") if isinstance(state, dict) else type(state).__name__
            raise errors.StateMismatchError(
                f"expected a mixture reader state (kind {_KIND!r}), found {found!r}: a state "
                "saved while reading one dataset does not resume a mixture"
            )
        if state.get("version") != STATE_VERSION:
            raise errors.StateMismatchError(
                f"expected a mixture reader state of version {STATE_VERSION}, found "
                f"{state.get('version')!r}"
            )
        ours = {"batch_size": self._opt.batch_size, "split": [self._split.index, self._split.count]}
        saved = {"batch_size": state.get("batch_size"), "split": state.get("split")}
        if isinstance(saved["split"], list | tuple):
            saved["split"] = list(saved["split"])
        differ = [
            f"{key}: state has {saved[key]!r}, this reader has {ours[key]!r}"
            for key in ours
            if saved[key] != ours[key]
        ]
        if differ:
            raise errors.StateMismatchError(
                "cannot resume: the state was saved with other batching ("
                + "; ".join(differ)
                + "); use the same batch_size and number of loader workers"
            )
        self._close_streams()
        self._mix.load_state_dict(state["mixture"])
        self._restart(self._mix.step)

    # --- iteration ----------------------------------------------------------------
    def __iter__(self) -> Iterator[batching.HostBatch]:
        while True:
            step = self._cursor
            self._where = self._walked(step)
            self._at = step
            name = self._mix.drawn(step)
            batch = self._read(name)
            self._at = step + 1
            # Counted as read once handed out: the state taken now resumes after it.
            self._cursor = step + self._split.count
            yield batch

    def _read(self, name: str) -> batching.HostBatch:
        """The next `batch_size` rows of source `name` from its cursor, into its next
        epoch where this one ends (the mixture's rule 4)."""
        ds = self._mix.sources[name]
        size = self._opt.batch_size
        epoch, position = self._where[name]
        pieces: list[pa.RecordBatch] = []
        chosen: list[selections.Selection] = []
        want = size
        while want:
            length = self._length(ds, epoch)
            if length == 0:
                self._moved(name, (epoch, position), want)  # raises, naming the source
            if position >= length:
                epoch, position = epoch + 1, 0
                self._mix.counts[name].epochs_finished += 1
                continue
            take = min(want, length - position)
            part = self._slice(name, epoch, position, take)
            pieces.extend(part.pieces)
            chosen.extend(part.selections)
            position += take
            want -= take
        self._where[name] = (epoch, position)
        count = self._mix.counts[name]
        count.batches += 1
        count.rows += size
        return batching.HostBatch(pieces=pieces, selections=chosen)

    def _slice(self, name: str, epoch: int, position: int, rows: int) -> batching.HostBatch:
        ds = self._mix.sources[name]
        here = (ds.epoch, ds.position) == (epoch, position)
        stream = self._streams.get(name)
        if stream is not None and here and rows == self._opt.batch_size:
            return next(stream)
        if stream is not None:
            del self._streams[name]
            stream.close()
        if not here:
            ds.seek(position, epoch=epoch)
        stream = batching.host_batches(
            ds, rows, columns=self._opt.columns, defer_gather=self._defer
        )
        got = next(stream)
        if rows == self._opt.batch_size:
            self._streams[name] = stream
        else:
            # The rest of a batch at an epoch's end: a one-off read of `rows` rows.
            stream.close()
        return got

    def _close_streams(self) -> None:
        for stream in self._streams.values():
            stream.close()
        self._streams.clear()

    def close(self) -> None:
        """Close the open streams (their leases); the mixture stays open."""
        self._close_streams()
