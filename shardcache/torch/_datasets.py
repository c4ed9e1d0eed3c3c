"""`IterableDataset`: a shardcache dataset as a torch IterableDataset of tensor batches.

It yields whole batches (dicts of tensors), so hand it to a DataLoader with
`batch_size=None` (one that batches is refused: `_stacking_loader`). Each DataLoader
worker opens the dataset in its own process and reads every `num_workers`-th batch of
the rank's stream (`shardcache.batching`): the loader yields the same batches in the
same order with any number of workers.

A mixture of datasets (`shardcache.mixture_batching`) reads the same way, with the
mixture's steps dealt to the workers: `mixture={name: URI}` with `weights=` (each worker
opens every source), `mixture=True` (the pod's multi-source DatasetMount), or a
`shardcache.Mixture` already opened (read in this process only: `num_workers=0`).

State follows torchdata's `Stateful` protocol on both the dataset and its iterator,
which is what `StatefulDataLoader` looks for: in each worker it loads the dataset's
state, creates the iterator, then loads the iterator's state; both are the same small
JSON dict here, so either alone resumes at the exact next batch. The main process's
`state_dict()` is refused once DataLoader workers have read (their batches never reach
its copy), and `load_state_dict` takes the list of every old rank's state to resume at
another world size (`_rank_states`); docs/adapters.md, "What to commit".
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.utils.data

from shardcache import (
    _adapter_sources,
    _integers,
    batching,
    checkpoint,
    datasets,
    errors,
    mixture_batching,
    mixtures,
    states,
)
from shardcache.torch import _rank_states, _ranks, _tensors, _worker_notes


class IterableDataset(torch.utils.data.IterableDataset[dict[str, torch.Tensor]]):
    """Batches of a shardcache dataset as dicts of tensors, for one rank.

    `source` and `open_options` are `shardcache.open()`'s; `rank` and `world_size`
    default to torch.distributed's, else to $RANK/$WORLD_SIZE (torchrun sets them).
    `batch_size` rows per batch, or with `pack` that many sequences of `pack` tokens
    made by concatenating the lists of `pack_column` (remainder carried to the next
    batch, and in the state). `lists` and `pad_to`: see `shardcache.torch.collate`.
    Call `set_epoch(epoch)` at the top of each epoch, as with a DistributedSampler: it
    reaches DataLoader workers, persistent ones too (`_worker_notes`).

    A mixture: `mixture={name: URI}` and `weights=` (a mapping or a schedule,
    `shardcache.mix`) and `mix_seed=`, every source opened with `open_options`;
    `mixture=True`: the pod's multi-source DatasetMount; or `source` a
    `shardcache.Mixture` (this process only). Its batches never end (bound the loop by
    steps), `set_epoch` does nothing, `pack` is refused, and a new iterator in this
    process goes on where the last one stopped. With DataLoader workers, iterate the
    loader once (or resume a StatefulDataLoader): new workers start from the state
    they are given, the opened mixture's start by default, and persistent workers
    refuse a second pass.
    """

    def __init__(
        self,
        source: str | mixtures.Mixture | None = None,
        *,
        batch_size: int,
        columns: list[str] | tuple[str, ...] | None = None,
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
        super().__init__()
        if lists not in _tensors.LISTS:
            raise errors.InputError(f"lists: expected one of {_tensors.LISTS}, found {lists!r}")
        #: A mixture opened by the caller: it cannot be reopened in a worker.
        self._given: mixtures.Mixture | None = None
        self._given_lost = False
        if isinstance(source, mixtures.Mixture):
            if open_options or mixture is not None or rank is not None or world_size is not None:
                raise errors.InputError(
                    "IterableDataset(a Mixture): expected no open options, mixture=, rank "
                    "or world_size (the mixture's sources were opened with theirs)"
                )
            self._given = source
            resumed = None
            some = next(iter(source.sources.values()))
            self.rank, self.world_size = some.params.rank, some.params.world_size
            self.local_rank = _ranks.discover(None, None).local_rank
            self._opener: _adapter_sources.Opener | None = None
            is_mixture = True
        else:
            found = _ranks.discover(rank, world_size)
            self.rank, self.world_size, self.local_rank = (
                found.rank,
                found.world_size,
                found.local_rank,
            )
            resumed = _adapter_resume(open_options, mixture, found.world_size)
            if resumed is not None:
                # Loaded below as any adapter state; the dataset opens at its start.
                open_options = {k: v for k, v in open_options.items() if k != "resume_from"}
            args = dict(
                open_options, source_uri=source, rank=found.rank, world_size=found.world_size
            )
            self._opener = _adapter_sources.Opener.of(
                args, mixture=mixture, weights=weights, mix_seed=mix_seed
            )
            is_mixture = self._opener.mixture is not None
        if is_mixture and pack is not None:
            raise errors.InputError(
                f"pack: expected None with a mixture, found {pack}: a packed sequence would "
                "mix sources; read the mixture's rows unpacked"
            )
        self.options = batching.Options(
            batch_size=batch_size,
            columns=datasets.column_names(columns),
            drop_last=drop_last,
            pack=pack,
            pack_column=pack_column,
            pad_value=pad_value,
        )
        self.lists, self.pad_to = lists, pad_to
        self._epoch: int = open_options.get("epoch") or 0
        #: What persistent DataLoader workers learn of the main process's `set_epoch`
        #: and `load_state_dict` at their next pass (their copies are made once).
        self._notes = _worker_notes.Notes(self._epoch)
        #: The main process's state loads this copy knows of (a worker's: those made
        #: before it started, which it was given with its copy).
        self._loads_known = 0
        #: (process id, passes begun in it): a forked worker inherits its parent's
        #: count, so the count restarts in each process.
        self._passes = (os.getpid(), 0)
        self._pending: dict[str, Any] | None = None
        #: Every old rank's Dataset state, loaded at the next pass (elastic resume).
        self._pending_ranks: list[dict[str, Any]] | None = None
        #: Passes DataLoader workers had started when this process's state was last its
        #: own (its pass or a load): more since, and `state_dict()` is not the loader's.
        self._worker_passes_known = self._notes.worker_passes
        # Per process, never pickled into DataLoader workers.
        self._dataset: _adapter_sources.Source | None = self._given
        self._opened_fresh = False
        self._live: _Iterator | None = None
        if self._opener is not None and resumed is not None:
            self.load_state_dict(resumed)

    # --- pickling into workers ----------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_dataset=None, _live=None, _opened_fresh=False)
        if self._given is not None:
            state.update(_given=None, _given_lost=True)
        return state

    # --- the dataset in this process ---------------------------------------------
    def shardcache_source(self) -> _adapter_sources.Source:
        """The `Dataset` or `Mixture` this process reads (opened on first use)."""
        if self._dataset is None:
            if self._opener is None:
                raise errors.InputError(
                    "IterableDataset(a Mixture) was copied into another process (a "
                    "DataLoader worker), where its sources' caches are not open: pass "
                    "mixture={name: URI} (or mixture=True) so each worker opens its own, or "
                    "use num_workers=0"
                )
            self._dataset = self._opener.open()
            self._opened_fresh = True
        return self._dataset

    def shardcache_dataset(self) -> datasets.Dataset:
        """The shardcache `Dataset` this process reads (opened on first use)."""
        source = self.shardcache_source()
        if not isinstance(source, datasets.Dataset):
            raise errors.InputError(
                "shardcache_dataset(): this reads a mixture; see shardcache_source()"
            )
        return source

    def add_mapping_listener(self, listener: datasets.MappingListener) -> None:
        """Tell `listener` of every shard mapping this process reads: the dataset's, or
        every source's of a mixture (the device prefetcher registers them with the GPU)."""
        for ds in self._datasets():
            ds.add_mapping_listener(listener)

    def remove_mapping_listener(self, listener: datasets.MappingListener) -> None:
        for ds in self._datasets():
            ds.remove_mapping_listener(listener)

    def source_count(self) -> int:
        """How many datasets this process reads: 1, or a mixture's sources."""
        return len(self._datasets())

    def _datasets(self) -> list[datasets.Dataset]:
        source = self.shardcache_source()
        if isinstance(source, mixtures.Mixture):
            return list(source.sources.values())
        return [source]

    def reader(
        self, split: batching.Split | None = None, *, defer_gather: bool = False
    ) -> _adapter_sources.Reader:
        """A batch reader for this process: at the loaded state if one is pending, else
        at the start of the current epoch (or where `resume_from` put a fresh dataset);
        for a mixture, where the last iterator of this process stopped. `defer_gather`:
        sample-mode batches not gathered (`batching.Reader`; the device prefetcher)."""
        source = self.shardcache_source()
        if isinstance(source, mixtures.Mixture):
            return self._mixture_reader(source, split, defer_gather=defer_gather)
        ds = source
        if not _worker_notes.in_worker():
            # A pass of this process: its state is this process's own again.
            self._worker_passes_known = self._notes.worker_passes
        if self._pending is not None:
            self.refuse_state_after_earlier_epoch(self._pending)
        pending, self._pending = self._pending, None
        ranks, self._pending_ranks = self._pending_ranks, None
        if ranks is not None:
            # This rank's share of what the old ranks left; each loader process then
            # starts at its own batch of it, as from an epoch's start.
            ds.load_state_dict(ranks)
            self._adopt_epoch(ds.epoch)
        elif pending is None and (not self._opened_fresh or ds.epoch != self._epoch):
            ds.seek(0, epoch=self._epoch)
        self._opened_fresh = False
        reader = batching.Reader(ds, self.options, split, defer_gather=defer_gather)
        if pending is not None:
            reader.load_state_dict(pending)
            finished = reader.state_dict()["dataset"]["position"] >= len(ds)
            if not (finished and self._epoch > ds.epoch):
                self._adopt_epoch(ds.epoch)
            # Else a state at the end of its epoch, and set_epoch already chose a later
            # one (StatefulDataLoader loads the state lazily, at iter(loader), after the
            # user's set_epoch): this pass reads nothing, and the next reads the chosen
            # epoch, as new DataLoader workers (copies of this dataset) would.
        return reader

    def _adopt_epoch(self, epoch: int) -> None:
        """The epoch a loaded state put this process in is the current one."""
        self._epoch = epoch
        if not _worker_notes.in_worker():
            # What the next new (or persistent) worker reads, as this process does.
            self._notes.set_epoch(self._epoch)

    def _mixture_reader(
        self, mixed: mixtures.Mixture, split: batching.Split | None, *, defer_gather: bool
    ) -> _adapter_sources.Reader:
        pending, self._pending = self._pending, None
        if pending is None and self._live is not None:
            # A mixture has no epoch to start again: go on from the last iterator.
            pending = self._live.state_dict()
        self._opened_fresh = False
        if self._live is not None:
            self._live.close()
        reader = _adapter_sources.reader(mixed, self.options, split, defer_gather=defer_gather)
        if pending is not None:
            reader.load_state_dict(pending)
        return reader

    def collate(self, batch: batching.HostBatch) -> dict[str, torch.Tensor]:
        return _tensors.collate(
            batch, lists=self.lists, pad_value=self.options.pad_value, pad_to=self.pad_to
        )

    # --- iteration ----------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Read `epoch` next (from its start, unless a state of that epoch was loaded).
        A mixture has no epochs (its sources move on by themselves): nothing to do.
        Before an epoch of a state loaded and not read yet, refused
        (StateMismatchError): it would repeat the samples read before the checkpoint.

        Called in the main process, it reaches DataLoader workers too, persistent ones
        included: each takes it up when its next pass starts."""
        # Checked now, not when the next iterator loads it into a state (a numpy integer
        # would be refused there, a float planned as an epoch that does not exist).
        epoch = _integers.integer(epoch, "epoch", minimum=0)
        if self._opener is None or self._opener.mixture is not None:
            return
        loaded = self._loaded_state()
        if loaded is not None and not _worker_notes.in_worker():
            states.refuse_epoch_before_loaded(epoch, loaded[0], loaded[1])
        if not _worker_notes.in_worker():
            self._notes.choose()
        self._choose_epoch(epoch)

    def refuse_state_after_earlier_epoch(self, state: Any) -> None:
        """Refuse a state loaded after `set_epoch` chose an epoch before the state's.

        StatefulDataLoader hands the dataset its state only at `iter(loader)`, after the
        loop's `set_epoch`, so a loop from epoch 0 (`for epoch in range(epochs)`) is not
        refused by `set_epoch`; the state then read the rest of its epoch in the loop's
        turn 0 and the loop read that epoch again whole in its turn: every sample before
        the checkpoint twice, silently. Raised before anything moves."""
        at = state.get("dataset") if isinstance(state, dict) else None
        if not isinstance(at, dict) or not self._notes.chosen:
            return
        saved, position = at.get("epoch"), at.get("position")
        if isinstance(saved, int):
            # The rule `set_epoch` applies after a load, in the other order of events.
            states.refuse_epoch_before_loaded(
                self._epoch,
                saved,
                position if isinstance(position, int) else None,
                state_last=True,
                advice="StatefulDataLoader loads the dataset's state at iter(loader), after "
                "the loop's set_epoch: start the loop at the checkpoint's epoch, `for epoch "
                "in range(start, epochs)` with `start = "
                "shardcache.torch.state_epoch(loader_state)`",
            )

    def _loaded_state(self) -> tuple[int, int] | None:
        """The epoch and position of a state loaded and not read from yet."""
        if self._pending is not None and "dataset" in self._pending:
            at = self._pending["dataset"]
            return int(at["epoch"]), int(at["position"])
        if self._pending_ranks is not None:
            # Elastic: the new rank starts its share of the old ranks' epoch.
            return int(self._pending_ranks[0].get("epoch", self._epoch)), 0
        return None

    @property
    def epoch(self) -> int:
        """The epoch read next: a loaded state's until it is read, else the one
        `set_epoch` chose. A resumed loop starts at it, `for epoch in range(ds.epoch,
        epochs)`. A mixture has no epochs: 0."""
        if self._opener is not None and self._opener.mixture is not None:
            return 0
        loaded = self._loaded_state()
        return loaded[0] if loaded is not None else self._epoch

    def _choose_epoch(self, epoch: int) -> None:
        """Read `epoch` next in this process (and, from the main process, in workers)."""
        if not _worker_notes.in_worker():
            self._notes.set_epoch(epoch)
        if epoch != self._epoch:
            self._epoch = epoch
            if self._pending is not None and self._pending["dataset"]["epoch"] != epoch:
                self._pending = None
            if self._pending_ranks is not None and self._pending_ranks[0].get("epoch") != epoch:
                self._pending_ranks = None

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = torch.utils.data.get_worker_info()
        if info is not None and (self._given is not None or self._given_lost):
            # Forked workers inherit the mixture without pickling: refuse it here too.
            self._dataset, self._opener = None, None
        split = batching.Split(info.id, info.num_workers) if info is not None else None
        refused = self._start_pass(info.id) if info is not None else None
        refused = refused or _stacking_loader(self)
        if refused is not None and self._live is not None:
            self._live.close()
        self._live = _Iterator(self, split, refused=refused)
        return self._live

    def _start_pass(self, worker: int) -> errors.InputError | None:
        """In a DataLoader worker, at the start of a pass: take up what the main process
        did since the last one (a persistent worker's copy of the dataset is not made
        again). Returns why the pass must not run, raised at its first batch: a worker
        that raised here, while the loader resumes it, would die without a word."""
        pid, begun = self._passes
        begun = begun + 1 if pid == os.getpid() else 1
        self._passes = (os.getpid(), begun)
        self._notes.count_worker_pass()
        if self._notes.loads != self._loads_known:
            return errors.StateMismatchError(
                f"DataLoader worker {worker}: a state was loaded into the IterableDataset "
                "in the main process (load_state_dict) after this persistent worker "
                "started, and it reads its own copy of the dataset, made when it started: "
                "expected no state loaded between passes of a loader with "
                "persistent_workers=True, found one. Load the state before the loader's "
                "first pass, or resume with StatefulDataLoader.load_state_dict (it starts "
                "new workers), or use persistent_workers=False"
            )
        if self._opener is None or self._opener.mixture is not None:
            # A mixture (or one opened by the caller, which the worker refuses when it
            # opens its reader): no epoch to take up.
            if begun > 1 and self._opener is not None:
                return errors.InputError(
                    f"DataLoader worker {worker}: a new pass of a loader with "
                    "persistent_workers=True over a mixture: expected one pass (a "
                    "mixture's batches never end), found another. This worker read "
                    "batches ahead of what the loader yielded, so it cannot go on at the "
                    "loader's next batch. Iterate the loader once and bound the loop by "
                    "steps, or go on with StatefulDataLoader: "
                    "loader.load_state_dict(loader.state_dict()) starts new workers at the "
                    "exact next batch"
                )
            return None
        # The epoch a new worker would be given: the one the main process set last.
        # (A state this worker was given at its start keeps its own epoch until then.)
        if self._notes.epoch != self._epoch:
            self._choose_epoch(self._notes.epoch)
        return None

    # --- state --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where the latest iterator in this process is (a small JSON dict).

        In the main process, refused (StateMismatchError) once DataLoader workers have
        read since this process's last pass or load: the workers' batches never reach
        this copy of the dataset, so its state would be the epoch's start and a resume
        from it would read those batches again."""
        if not _worker_notes.in_worker() and self._notes.worker_passes != self._worker_passes_known:
            raise errors.StateMismatchError(
                "IterableDataset.state_dict() in the main process: expected a dataset "
                "read in this process, found DataLoader workers reading it since this "
                "process last did (their batches never reach this copy, so its state "
                "would be the epoch's start and a resume would repeat them). Commit "
                "StatefulDataLoader.state_dict() (torchdata; its workers' states are "
                "exact), or read with num_workers=0 and commit ds.state_dict() "
                '(docs/adapters.md, "What to commit")'
            )
        if self._pending_ranks is not None:
            # Elastic: this rank's share is known once the dataset is open; the states
            # stay pending for the next pass (each loader process starts at its batch).
            ranks = self._pending_ranks
            state = self.reader().state_dict()
            self._pending_ranks = ranks
            return state
        if self._live is not None:
            return self._live.state_dict()
        if self._pending is not None:
            return self._pending
        return self.reader().state_dict()

    def load_state_dict(self, state: dict[str, Any] | Sequence[dict[str, Any]]) -> None:
        """Resume the next iterator at the exact next batch of the run that saved it.

        In the main process, before a DataLoader's workers start (they are given it
        with their copy of the dataset); persistent workers already running cannot see
        it and refuse their next pass (StatefulDataLoader.load_state_dict starts new
        workers).

        To resume at another world size, pass the list of every old rank's state (any
        order, same batch_size and pack): this one's `state_dict()` from num_workers=0,
        or a StatefulDataLoader's where its workers' cursors give the rank's consumed
        rows exactly (`_rank_states`); this rank reads its share of the rows no old rank
        consumed."""
        ranks: list[dict[str, Any]] | None = None
        pending: dict[str, Any] | None = None
        if isinstance(state, list | tuple):
            if self._opener is None or self._opener.mixture is not None:
                raise errors.StateMismatchError(
                    "expected one state from shardcache.torch.IterableDataset.state_dict() "
                    "for a mixture, found a list: a mixture resumes at the world size it "
                    "was saved at"
                )
            ranks = _rank_states.dataset_states(state, self.options)
        elif isinstance(state, dict) and ("dataset" in state or "mixture" in state):
            pending = state
        else:
            loader = isinstance(state, dict) and "_snapshot" in state
            raise errors.StateMismatchError(
                "expected a state from shardcache.torch.IterableDataset.state_dict(), or "
                "the list of every old rank's to resume at another world size, found "
                + (
                    "a StatefulDataLoader's state: load it with "
                    "StatefulDataLoader.load_state_dict (it hands each worker its own)"
                    if loader
                    else type(state).__name__
                )
            )
        if not _worker_notes.in_worker():
            self._loads_known = self._notes.count_load()
            self._worker_passes_known = self._notes.worker_passes
        self._pending, self._pending_ranks = pending, ranks
        self._live = None

    def close(self) -> None:
        if self._live is not None:
            self._live.close()
        if self._dataset is not None:
            self._dataset.close()
            self._dataset = None


def _stacking_loader(dataset: IterableDataset) -> errors.InputError | None:
    """Why a DataLoader with automatic batching must not read `dataset`; None when it
    does not batch (or when this iterator is not a DataLoader's).

    `DataLoader(ds)` batches by default (batch_size=1) and `DataLoader(ds, batch_size=k)`
    stacks k of the whole batches this dataset yields into one, a silent leading
    dimension ([k, B, ...]). The loader tells the dataset nothing, but its fetcher asks
    for the iterator from its own `__init__` with `auto_collation` already set; a few
    frames up, so a wrapper between them is seen too. Found nowhere (another caller, a
    torch that moved it): nothing to say."""
    fetch = sys.modules.get("torch.utils.data._utils.fetch")
    base = getattr(fetch, "_BaseDatasetFetcher", None)
    frame = sys._getframe(1)
    for _ in range(4):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None or base is None:
            return None
        fetcher = frame.f_locals.get("self")
        if isinstance(fetcher, base) and getattr(fetcher, "dataset", None) is dataset:
            if not getattr(fetcher, "auto_collation", False):
                return None
            return errors.InputError(
                "shardcache.torch.IterableDataset in a DataLoader that batches: expected "
                "DataLoader(ds, batch_size=None), found automatic batching (batch_size "
                "set, or left at its default of 1), which stacks that many of the dataset's "
                f"batches of {dataset.options.batch_size} rows into one with a leading "
                "dimension ([k, batch, ...]). The dataset yields whole batches: set their "
                "size with IterableDataset(batch_size=...) and pass batch_size=None"
            )
    return None


class _Iterator:
    """One pass over the rest of an epoch; `Stateful` for StatefulDataLoader.

    A pass `refused` at its start (`IterableDataset._start_pass`) reads nothing and
    raises that error at its first batch or state: DataLoader hands an error raised
    there to the main process with the worker's traceback."""

    def __init__(
        self,
        owner: IterableDataset,
        split: batching.Split | None,
        *,
        refused: errors.InputError | None = None,
    ) -> None:
        self._owner = owner
        self._split = split
        self._refused = refused
        self._reader = owner.reader(split) if refused is None else None
        self._batches: Iterator[batching.HostBatch] | None = None

    def _read(self) -> _adapter_sources.Reader:
        if self._refused is not None:
            raise self._refused
        assert self._reader is not None
        return self._reader

    def __iter__(self) -> _Iterator:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._batches is None:
            self._batches = iter(self._read())
        return self._owner.collate(next(self._batches))

    def state_dict(self) -> dict[str, Any]:
        return self._read().state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # StatefulDataLoader's workers get their states here, after the loop's set_epoch.
        self._owner.refuse_state_after_earlier_epoch(state)
        self._read().load_state_dict(state)
        self._batches = None

    def close(self) -> None:
        """Close a mixture reader's open streams (their leases)."""
        if isinstance(self._reader, mixture_batching.MixtureReader):
            self._reader.close()


def _adapter_resume(
    open_options: Mapping[str, Any], mixture: object, world_size: int
) -> dict[str, Any] | list[dict[str, Any]] | None:
    """The checkpoint's data state when `resume_from` names one of this adapter's (its
    `state_dict()`, or every old rank's) or a StatefulDataLoader's (which the adapter
    refuses saying how to load it): the adapter loads it, as `shardcache.open()` cannot.
    Anything else (a `Dataset` state) is left to `shardcache.open()`, as before."""
    resume_from = open_options.get("resume_from")
    if resume_from is None or mixture is not None:
        return None
    state = checkpoint.data_state(resume_from, world_size=world_size)
    items = state if isinstance(state, list) else [state]
    ours = [isinstance(s, dict) and ("dataset" in s or "_snapshot" in s) for s in items]
    if state is None or not all(ours):
        return None
    return state
