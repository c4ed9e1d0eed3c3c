"""`Dataset`: resumable, zero-copy iteration over a rank's share of a dataset.

Batches are slices of memory-mapped Arrow IPC files in the memory tier. A batch is
copied only when it is stitched from more than one run of rows: across a shuffle-block
boundary inside a shard, or across two shards (see docs/reading-plans.md). The position
in the epoch is counted in samples on the client, so resuming never depends on the
sidecar's state.

In sample mode (plan version 2, `shuffle="sample"`) a batch is the next positions of
the epoch's sample-shuffled sequence, gathered from every shard of its window with one
copy (`shardcache.gather`); the reader holds a lease on each of the window's shards
while it gathers. The next batches are gathered ahead on a few threads while the caller
works on the current one (`shardcache.gather_ahead`, `gather_threads`), which changes no
batch and no position. `take()` gathers rows by dataset-wide index the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
import uuid
import weakref
from collections.abc import Generator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import pyarrow as pa
import pyarrow.ipc as ipc

from shardcache import (
    _integers,
    elastic,
    errors,
    even_batches,
    gather_ahead,
    manifests,
    placements,
    plans,
    provider,
    stalls,
    states,
    streams,
    windows,
)
from shardcache.node import after_fork, mapping, regular_files

if TYPE_CHECKING:
    from shardcache import selections, sequences

#: The state dict's format (`shardcache.states`); version 1 states still load.
STATE_VERSION = states.STATE_VERSION


def read_shard(path: Path, columns: Sequence[str] | None = None) -> pa.RecordBatch:
    """The record batch of a decoded shard, memory-mapped: no copy.

    The mapping's page table is filled in one call before the first read: a reader
    that faulted it in page by page instead still took minor faults on its next pass
    over a 4 KiB-page tmpfs (docs/benchmarks.md: the first warm pass over 1 GiB took
    217 ms instead of 157). The mapping lives as long as any buffer of the batch.
    """
    return select(map_shard(path)[0], columns)


def map_shard(path: Path) -> tuple[pa.RecordBatch, pa.Buffer]:
    """`read_shard(path)` and the buffer over the whole mapping (read-only), which the
    device prefetcher registers with the GPU driver as one range."""
    # Never through a link, never waiting for a FIFO's writer: the pod's processes may
    # put anything in the memory volume (`regular_files`). The mapping keeps no
    # descriptor (`mapping`): a reader keeps hundreds of mappings.
    try:
        fd = regular_files.open_regular(path, os.O_RDONLY)
        try:
            root = mapping.map_file(fd, mapping.MADV_POPULATE_READ)
        finally:
            os.close(fd)
    except OSError as exc:
        clear = mapping.limit_error(exc, path)
        if clear is None:
            raise
        raise clear from exc
    try:
        reader = ipc.open_file(root)
        batch = reader.get_batch(0) if reader.num_record_batches == 1 else _combine(reader)
    except pa.ArrowException as exc:
        # The file's size matched its entry (the lookup checks it) but not its format:
        # written over after the sidecar wrote it, which only the pod's own processes
        # can (the memory tier is not hashed, docs/cache-format.md). A bare pyarrow
        # error named neither the file nor that.
        raise errors.CacheError(
            f"{path}: expected a decoded shard (an Arrow IPC file), found a file pyarrow "
            f"cannot read ({exc}): the memory tier's file was changed after it was "
            "written. Remove the file (the sidecar then decodes the shard again) and "
            "look for a process of the pod that writes the shared volume"
        ) from exc
    return batch, root


class MappingListener(Protocol):
    """Told when a reader maps a shard file and when it lets the mapping go.

    `mapped` is called while the reader holds the shard's lease (the memory tier will
    not evict it then); `dropped` before the reader's last reference to the mapping
    goes, so a listener that holds `root` itself decides when the pages are unmapped.
    `dropped` of a shard evicted while the reader waits in an acquire comes from the
    reader's watching thread (`_Mappings.waiting`), never at once with the reader's own
    calls: those are made under the same lock, and the reader is in that acquire.
    """

    def mapped(self, root: pa.Buffer) -> None: ...

    def dropped(self, root: pa.Buffer) -> None: ...


def _python_ints(values: Any) -> bool:
    """Whether every item of an object array is a Python int (not a bool)."""
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values.tolist())


def column_names(columns: Sequence[str] | None) -> tuple[str, ...] | None:
    """`columns=` as given by a caller: a list (or tuple) of names, or None for all.
    A str is refused: iterated, "tokens" would select the columns "t", "o", "k", ...,
    and a dataset with a column per letter would read the wrong ones silently."""
    if columns is None:
        return None
    if isinstance(columns, str | bytes):
        raise errors.InputError(
            f"columns: expected a list of column names, found the {type(columns).__name__} "
            f"{columns!r}; for one column write columns=[{columns!r}]"
        )
    return tuple(columns)


def select(batch: pa.RecordBatch, columns: Sequence[str] | None) -> pa.RecordBatch:
    """`columns` of `batch` (zero-copy); an unknown name is an InputError."""
    if columns is None:
        return batch
    missing = [c for c in columns if c not in batch.schema.names]
    if missing:
        raise errors.InputError(
            f"unknown column(s) {missing}: the dataset has {batch.schema.names}"
        )
    return batch.select(list(columns))


def _owned(pieces: Sequence[pa.RecordBatch]) -> pa.RecordBatch:
    """`pieces` as one batch in buffers of its own: it keeps no shard mapped.
    (`concat_batches` allocates new buffers even for one piece, slices included.)"""
    return pa.concat_batches(pieces)


def _leaves_shard(runs: Sequence[plans.Run], i: int, start: int, rows: int) -> bool:
    """Whether reading the next `rows` rows of `runs`, from row `start` of `runs[i]` on,
    needs a shard other than `runs[i]`'s, or runs past the end of `runs`: the walk to
    the next batch handed out would acquire another shard (the next epoch's first,
    at the end) while the caller still holds the one handed out now."""
    shard = runs[i].shard
    left = rows - (runs[i].stop - start)
    j = i + 1
    while left > 0:
        if j == len(runs) or runs[j].shard != shard:
            return True
        left -= len(runs[j])
        j += 1
    return False


def _windows_read(
    ranges: Sequence[streams.Range], lo: int, hi: int, *, width: int, epoch: int
) -> set[tuple[int, int]]:
    """The (epoch, index) of every sample-mode window stream positions [lo, hi) read."""
    out: set[tuple[int, int]] = set()
    for a, b in streams.cut(ranges, lo, hi):
        first, last = windows.window_of(a, width), windows.window_of(b - 1, width)
        out.update((epoch, k) for k in range(first, last + 1))
    return out


class _Mappings:
    """Shard files this reader has memory-mapped, kept across epochs.

    A fresh mapping costs a page fault per page on first touch, which caps a warm pass
    over a 4 KiB-page tmpfs far below memory speed (docs/benchmarks.md measures 4.5 vs
    6.9 GB/s here); a mapping kept from the previous epoch reads at memory speed. A
    mapping is reused only while its file is still the resident entry (same device and
    inode). The ones whose files were evicted are dropped before every acquire, and
    while an acquire waits (`waiting`), so the reader never holds memory the tier gave
    up beyond the shard it is still slicing. At most `MAX_MAPPINGS` are kept (least
    recently used go first); a mapping keeps no file descriptor, and where the platform
    leaves no other way than one that does, fewer (`mapping.kept_mappings`).

    Why while it waits: the acquire of a cold shard evicts the least recently used
    entries, which are the shards this reader read and still maps; their pages stay in
    the memory volume while mapped, so the insert found the volume full below the
    tier's limit and waited for readers to unmap, and the one reader was the one
    waiting: 300 s, then CacheError. A thread of this object drops those mappings
    every `UNMAP_EVERY_S` while an acquire lasts (`_watch`), in the embedded cache
    (the acquire's insert runs in the reader's thread) and through a sidecar alike.
    """

    MAX_MAPPINGS = 512
    #: A directory's mtime is trusted to show every later entry added or removed only
    #: once it is this old: file timestamps come from a coarse clock (a scheduler tick),
    #: so a change within the same tick as the one we saw could leave it unchanged.
    SETTLED_NS = 100_000_000
    #: How often mappings of evicted files are dropped while an acquire lasts: an
    #: insert waiting for room polls the volume about this often.
    UNMAP_EVERY_S = 0.05
    #: The watching thread ends after this long without an acquire (the next one
    #: starts it again).
    IDLE_S = 10.0

    def __init__(self) -> None:
        self._maps: dict[str, tuple[tuple[int, int], pa.RecordBatch, pa.Buffer]] = {}
        self.max_mappings = mapping.kept_mappings(self.MAX_MAPPINGS)
        self._dirs: dict[str, int] | None = None
        #: How many mappings each directory holds: what `_prune` stats, without a
        #: `dirname` per mapping at every prune (two a shard: before and after acquire).
        self._dir_counts: dict[str, int] = {}
        self.listeners: list[MappingListener] = []
        #: Guards the mappings (the watching thread prunes them while an acquire
        #: waits), and wakes that thread. Reentrant: a listener may look back.
        self._cond = threading.Condition(threading.RLock())
        #: Acquires in progress, and how many have begun (a wait outlasted a period
        #: when the count is the same after it).
        self._waits = 0
        self._begun = 0
        self._watcher: threading.Thread | None = None
        self._idle = False
        after_fork.register(self)

    def after_fork(self) -> None:
        """In a forked child: the parent's watching thread is not here, and may have
        held the lock at the fork."""
        self._cond = threading.Condition(threading.RLock())
        self._waits = self._begun = 0
        self._watcher, self._idle = None, False

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Around an acquire: while it lasts, mappings of files the tier evicted are
        dropped every `UNMAP_EVERY_S` (the class docstring says why)."""
        cond = self._cond
        with cond:
            self._waits += 1
            self._begun += 1
            if self._watcher is None:
                self._watcher = threading.Thread(
                    target=_watch,
                    args=(weakref.ref(self), cond),
                    name="shardcache-unmap-evicted",
                    daemon=True,
                )
                self._watcher.start()
            elif self._idle:
                cond.notify()
        try:
            yield
        finally:
            with cond:
                self._waits -= 1

    def batch(self, path: Path) -> pa.RecordBatch:
        with self._cond:
            return self._batch(path)

    def _batch(self, path: Path) -> pa.RecordBatch:
        key = str(path)
        st = os.stat(key)
        ident = (st.st_dev, st.st_ino)
        cached = self._maps.pop(key, None)
        if cached is None:
            directory = os.path.dirname(key)
            self._dir_counts[directory] = self._dir_counts.get(directory, 0) + 1
        if cached is not None and cached[0] == ident:
            batch, root = cached[1], cached[2]
        else:
            if cached is not None:
                self._dropped(cached[2])
            batch, root = map_shard(path)
            for listener in self.listeners:
                listener.mapped(root)
        self._maps[key] = (ident, batch, root)  # most recently used last
        while len(self._maps) > self.max_mappings:
            self._drop(next(iter(self._maps)))
        return batch

    def _drop(self, key: str) -> None:
        root = self._maps.pop(key)[2]
        directory = os.path.dirname(key)
        left = self._dir_counts[directory] - 1
        if left:
            self._dir_counts[directory] = left
        else:
            del self._dir_counts[directory]
        self._dropped(root)

    def _dropped(self, root: pa.Buffer) -> None:
        for listener in self.listeners:
            listener.dropped(root)

    def prune(self) -> None:
        """Drop the mappings whose files were evicted or replaced."""
        with self._cond:
            self._prune()

    def _prune(self) -> None:
        # Evicting an entry unlinks its file, which changes its directory's mtime: while
        # no directory changed since a settled look, no mapped file can have gone, and one
        # stat replaces one per mapping (they cost the loop GIL hand-offs too).
        now = time.time_ns()
        try:
            dirs = {d: os.stat(d).st_mtime_ns for d in self._dir_counts}
        except FileNotFoundError:
            dirs = None
        if dirs is not None and dirs == self._dirs:
            return
        for key, (ident, _, _) in list(self._maps.items()):
            try:
                st = os.stat(key)
            except FileNotFoundError:
                self._drop(key)
                continue
            if (st.st_dev, st.st_ino) != ident:
                self._drop(key)
        settled = dirs is not None and all(now - m > self.SETTLED_NS for m in dirs.values())
        self._dirs = dirs if settled else None

    def clear(self) -> None:
        with self._cond:
            for key in list(self._maps):
                self._drop(key)
            self._dirs = None


def _watch(ref: weakref.ReferenceType[_Mappings], cond: threading.Condition) -> None:
    """The thread of `_Mappings.waiting`: while an acquire lasts, drop the mappings of
    evicted files every `UNMAP_EVERY_S`; end after `IDLE_S` without one, or once the
    mappings are gone. Holds them weakly, so a reader dropped without close() goes."""
    with cond:
        while True:
            mappings = ref()
            if mappings is None or mappings._watcher is not threading.current_thread():
                return  # collected, or this thread is a forked parent's
            if mappings._waits == 0:
                mappings._idle = True
                del mappings
                woken = cond.wait(_Mappings.IDLE_S)
                mappings = ref()
                if mappings is None:
                    return
                mappings._idle = False
                if not woken and mappings._waits == 0:
                    mappings._watcher = None
                    return
                continue
            begun = mappings._begun
            del mappings
            cond.wait(_Mappings.UNMAP_EVERY_S)
            mappings = ref()
            # Only an acquire that lasted the whole period: most take far less.
            if mappings is not None and mappings._waits and mappings._begun == begun:
                mappings._prune()
            del mappings


#: A batch as `_timed` hands it on: a record batch, or the pieces of one.
B = TypeVar("B")


def _combine(reader: ipc.RecordBatchFileReader) -> pa.RecordBatch:
    # Not the decoded form (one batch); still served correctly, with a copy.
    return pa.concat_batches([reader.get_batch(i) for i in range(reader.num_record_batches)])


class _Leases:
    """The shard leases of a sample-mode reader: `held`, those of the windows it plans
    batches from, and `retired`, those of windows it has planned past, each kept until
    the batches before position `at` are handed over (a reader that gathers ahead plans
    the next window's batches while the last ones of this window are not handed over)."""

    def __init__(self) -> None:
        self.held: dict[int, provider.ShardLease] = {}
        self.retired: dict[int, tuple[int, provider.ShardLease]] = {}

    def retire(self, shard: int, *, at: int) -> None:
        self.retired[shard] = (at, self.held.pop(shard))

    def reuse(self, shard: int) -> bool:
        """Whether `shard` is held, taking it back from the retired where it is there."""
        if shard in self.retired:
            self.held[shard] = self.retired.pop(shard)[1]
        return shard in self.held

    def release_before(self, position: int) -> None:
        for shard, (at, lease) in list(self.retired.items()):
            if at <= position:
                del self.retired[shard]
                lease.release()

    def release_all(self) -> None:
        for _, lease in self.retired.values():
            lease.release()
        for lease in self.held.values():
            lease.release()
        self.retired.clear()
        self.held.clear()


#: For annotations inside `Dataset`, whose `provider` property hides the module there.
_Lease = provider.ShardLease


class Dataset:
    """One rank's view of a dataset. Create it with `shardcache.open()`."""

    def __init__(
        self,
        shards: provider.ShardProvider,
        params: plans.PlanParams,
        *,
        gather_threads: int | None = None,
    ) -> None:
        self._provider = shards
        self._params = params
        self._gather_threads = (
            None if gather_threads is None else gather_ahead.check_threads(gather_threads)
        )
        #: Iterations gathering ahead on threads, which close() ends (and so stops).
        self._aheads: weakref.WeakSet[Generator[Any, None, None]] = weakref.WeakSet()
        self._position = 0
        #: Whether the walk acquires another shard before it hands the next batch
        #: (`acquires_next`).
        self._acquires_next = False
        #: The batch size of the last batches() call: what skip_batches() skips in.
        self._batch_size: int | None = None
        self._skips: tuple[states.Skip, ...] = ()
        #: Bumped by every move of the position from outside an iterator (a skip, a
        #: loaded state, another epoch), so an iterator in flight notices it and reads on
        #: from the new position.
        self._moves = 0
        #: After `load_state_dict`: the moves count, epoch and position it left, so that
        #: `set_epoch` back before that epoch with nothing read since is refused.
        self._loaded: tuple[int, int, int] | None = None
        #: Keyed by the whole plan: a loaded state may change the segments, not the epoch.
        self._runs_cache: tuple[plans.PlanParams, list[plans.Run]] | None = None
        self._sequence_cache: tuple[int, sequences.Sequence] | None = None
        #: Sample mode: the windows the rank meets in the epoch (`windows.rank_windows`)
        #: and their ends, for the plan whose parameters are kept with them.
        self._windows_cache: tuple[plans.PlanParams, list[windows.Window], list[int]] | None = None
        self._reader_id = f"{params.rank}-{uuid.uuid4().hex[:12]}"
        self._registered = False
        #: Set by `close()`: reading on would register a reader nobody closes.
        self._closed = False
        self._mappings = _Mappings()
        #: The training loop's wait for batches vs. its steps between them, over every
        #: batches() iterator of this dataset: the data-stall signal (docs/monitoring.md).
        self.stalls = stalls.StallMeter()
        self._stall_reporter = shards if isinstance(shards, provider.StallReporter) else None

    # --- description --------------------------------------------------------------
    @property
    def manifest(self) -> manifests.Manifest:
        return self._provider.manifest

    @property
    def provider(self) -> provider.ShardProvider:
        """Where this dataset's shards come from; for tools (the inspector) that read
        shards out of plan order without moving this dataset's position."""
        return self._provider

    @property
    def params(self) -> plans.PlanParams:
        return self._params

    @property
    def epoch(self) -> int:
        return self._params.epoch

    @property
    def position(self) -> int:
        """Where this rank is in the current epoch's stream: samples handed out so far,
        plus samples skipped (`skip_batches`)."""
        return self._position

    @property
    def moves(self) -> int:
        """How many times the position was moved from outside an iterator (`set_epoch`
        to another epoch, `skip_batches`, `load_state_dict`): a reader that keeps a
        place of its own (`batching.Reader`) knows by it that its place is stale."""
        return self._moves

    @property
    def skips(self) -> tuple[states.Skip, ...]:
        """Every range of positions this rank passed over without reading, all epochs,
        oldest first: `skip_batches`, the agent's skips at restore, and the rows
        `drop_last` trimmed after an epoch's last whole batch."""
        return self._skips

    @property
    def gather_threads(self) -> int:
        """Threads that gather sample-mode batches ahead of the caller; 0 or 1 gathers
        each batch in the caller's thread when it asks for it. Left out at `open()`, one
        per CPU the container's quota allows but the caller's, at least 2 (inline with one
        CPU) and at most 4, shared out
        among loader workers (`shardcache.gather_ahead.default_threads`). Changes no
        batch, order or position; set it between iterations (an open iteration keeps
        the count it started with)."""
        if self._gather_threads is None:
            self._gather_threads = gather_ahead.default_threads()
        return self._gather_threads

    @gather_threads.setter
    def gather_threads(self, value: int) -> None:
        self._gather_threads = gather_ahead.check_threads(value)

    def __len__(self) -> int:
        """Samples this rank reads in the current epoch."""
        return plans.rank_samples(self.manifest.total_rows, self._params)

    def runs(self) -> list[plans.Run]:
        """This rank's reading plan for the current epoch: runs of consecutive rows of
        one shard, in reading order (in sample mode mostly single rows; needs numpy)."""
        params = self._params
        if self._runs_cache is None or self._runs_cache[0] != params:
            m = self.manifest
            self._runs_cache = (params, placements.rank_runs(m.shard_rows, m.digest, params))
        return self._runs_cache[1]

    def sequence(self) -> sequences.Sequence:
        """The current epoch's global sequence (every rank's): turns a range of it into
        manifest indices to read. Needs numpy."""
        from shardcache import sequences  # numpy: sample mode and take() only

        epoch = self._params.epoch
        if self._sequence_cache is None or self._sequence_cache[0] != epoch:
            m = self.manifest
            self._sequence_cache = (epoch, sequences.Sequence(m.shard_rows, m.digest, self._params))
        return self._sequence_cache[1]

    # --- iteration --------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch to read. A new epoch starts at its first sample; setting
        the current epoch again keeps the position (so a loaded state survives the
        usual `set_epoch` at the top of the training loop); back to an epoch read
        before, the pass starts afresh and that epoch's recorded skips are dropped.
        Right after `load_state_dict`, before any batch, an epoch before the loaded
        state's is refused (StateMismatchError): a training loop starting at epoch 0
        after a resume would read every sample before the checkpoint again.
        Called between two batches of an open iterator, the iterator reads on from the
        new epoch's first sample.

        `epoch` is an int >= 0 (a numpy integer is taken as its int); anything else is
        an InputError."""
        # Made before the comparison: it checks `epoch`, and 0.0 must not pass as 0.
        params = self._params.with_epoch(epoch)
        loaded = self._loaded
        if loaded is not None and loaded[0] == self._moves and loaded[2] == self._position:
            states.refuse_epoch_before_loaded(params.epoch, loaded[1], loaded[2])
        if params.epoch != self._params.epoch:
            self._params = params
            self._position = 0
            # Back in an epoch read before, the pass starts afresh and reads the rows
            # its earlier pass skipped: those skips no longer hold (a state keeping them
            # would claim rows ahead of its position skipped, which `states.parse`
            # refuses).
            self._skips = tuple(s for s in self._skips if s.epoch != params.epoch)
            self._moves += 1

    @property
    def acquires_next(self) -> bool:
        """Whether the block-mode walk acquires another shard (or ends the epoch) before
        it hands out the next batch: the batch handed last is then a copy (see
        `batches`). A consumer that keeps slices of earlier batches (a prefetcher's
        window) lets go of them before it asks for the next, or it maps the shard the
        walk leaves while the tier may evict it (docs/reading-plan.md, "What it means
        for batches"). False in sample mode, and when nothing was handed yet."""
        return self._acquires_next

    def batches(
        self, batch_size: int, *, columns: Sequence[str] | None = None, drop_last: bool = False
    ) -> Generator[pa.RecordBatch, None, None]:
        """Record batches of `batch_size` rows for the rest of the current epoch.

        The last batch may be short unless `drop_last`. `drop_last=True` also gives
        every rank of the epoch the same count: batches end after the last whole one
        within the first `least` positions, `least` being the fewest rows any rank
        reads in the epoch (ranks differ by one row); the rows after it count as
        consumed, so the state after it says the epoch is done
        (`shardcache.even_batches`). Without it, ranks' counts may differ by one.
        `state_dict()` taken after a batch was handed out counts that batch as read.
        Two iterators open at once share the position: each reads on from where the
        other's last batch left it.

        In block mode a batch inside one run of rows is a zero-copy slice of the mapped
        shard; one stitched from several runs is a copy, and so is the batch after
        which the next one needs another shard (or the epoch ends): the loop holds it
        while the next shard is acquired, and a slice would keep the shard it leaves
        mapped, pages the tier may have evicted that stay in the memory volume
        (docs/reading-plan.md, "What it means for batches"). A loop that keeps more
        than the batch in hand keeps those mapped.
        """
        columns = column_names(columns)
        stitched = (
            pieces[0] if len(pieces) == 1 else pa.concat_batches(pieces)
            for pieces in self._pieces(batch_size, columns=columns, drop_last=drop_last)
        )
        yield from self._timed(stitched)

    def batch_pieces(
        self,
        batch_size: int,
        *,
        columns: Sequence[str] | None = None,
        drop_last: bool = False,
        stride: int = 1,
    ) -> Generator[list[pa.RecordBatch], None, None]:
        """Like `batches`, but each batch as the zero-copy slices it is made of, in
        order: one slice, or several where the batch crosses a shuffle-block or shard
        boundary. For consumers that put the pieces together themselves (on a GPU,
        say) instead of having them copied into one batch here. The same copies as
        `batches` keep a shard left behind unmapped: the batch handed out last before
        the walk to the next acquires another shard is one copied piece, and a batch
        crossing into another shard starts with the rows of the one before as one
        copied piece.

        `stride`: only every `stride`-th batch from the position (the 1st, the
        stride+1-th, ...); the position moves past the ones between, which are never
        gathered in sample mode (loader workers that deal a rank's batches out,
        `batching.Reader`).
        """
        columns = column_names(columns)
        if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
            raise errors.InputError(f"stride must be an int >= 1, got {stride!r}")
        pieces = self._pieces(batch_size, columns=columns, drop_last=drop_last, stride=stride)
        yield from self._timed(pieces)

    def _pieces(
        self,
        batch_size: int,
        *,
        columns: Sequence[str] | None = None,
        drop_last: bool = False,
        stride: int = 1,
    ) -> Generator[list[pa.RecordBatch], None, None]:
        batch_size = _integers.integer(batch_size, "batch_size", minimum=1)
        self._batch_size = batch_size
        self._ensure_reader()
        if self._params.sampled:
            yield from self._gathered(
                batch_size, columns=columns, drop_last=drop_last, stride=stride
            )
            return
        sliced = self._sliced(batch_size, columns=columns, drop_last=drop_last, stride=stride)
        with contextlib.closing(sliced):
            yield from sliced

    def _sliced(
        self, batch_size: int, *, columns: Sequence[str] | None, drop_last: bool, stride: int = 1
    ) -> Generator[list[pa.RecordBatch], None, None]:
        """Block mode's batches: zero-copy slices of the mapped shards, every
        `stride`-th one from the position, except what would keep a shard mapped
        while the next is acquired.

        Why copies at all: the caller holds the batch it was last handed while it asks
        for the next (`for b in ds.batches(n)`), and a slice keeps its shard's whole
        mapping alive. Once the tier evicted that shard, its pages stay in the memory
        volume beyond the tier's limit; eight ranks on a volume sized from the tier
        each waited for the others' room (`shardcache.node.volume_cycles`). So a
        handed batch after which the walk to the next handed one acquires another
        shard (or the epoch ends) is a copy, one such batch per shard run (batch_size
        rows of the shard's); and pending slices of the old shard are copied into one
        before that acquire. Every other batch stays zero-copy.
        """
        lease: provider.ShardLease | None = None
        current = -1
        shard_batch: pa.RecordBatch | None = None
        pending: list[pa.RecordBatch] = []
        pending_rows = 0
        made = 0  # batches made so far: every stride-th is handed out
        #: Whether the batch handed last slices the current shard: then the walk acquires
        #: no other shard before the next is handed, unless a move comes in between.
        sliced = False
        #: After a move: the lease of the shard the batch in the caller's hand slices,
        #: kept through the acquires until the next batch is handed (see below).
        kept: provider.ShardLease | None = None
        try:
            while True:
                # A move between two batches (a skip, a loaded state, another epoch, or
                # the batches another open iterator of this dataset handed out) walks
                # the plan again from the new position (nothing is pending right after
                # a batch is yielded). `at` is where this walk left the position.
                seen, at = self._moves, self._position
                runs = list(plans.skip(self.runs(), at))
                if drop_last:
                    # Every rank of the epoch stops after the same count of batches
                    # (`shardcache.even_batches`).
                    runs = plans.head(runs, self._drop_stop(at, batch_size) - at)
                for i, run in enumerate(runs):
                    if run.shard != current:
                        if lease is not None and sliced:
                            # Only a move (a skip, a loaded state, another epoch) gets
                            # here with a slice in the caller's hand: the batch was
                            # handed before the walk knew it would leave the shard. A
                            # copy comes too late, so the shard stays leased (the tier
                            # cannot evict it under the slice) until the next batch is
                            # handed: two leases for one acquire, after a move only.
                            kept, lease, sliced = lease, None, False
                        if lease is not None:
                            lease.release()
                            lease = None
                        # Nothing of the old shard may stay mapped through the acquire:
                        # pending slices become one copy, and the batch handed last
                        # was a copy (`_leaves_shard`).
                        shard_batch = None
                        if pending:
                            pending = [_owned(pending)]
                        lease = self._acquire(
                            self._reader_id,
                            run.shard,
                            epoch=self._params.epoch,
                            position=self._position + pending_rows,
                        )
                        self._mappings.prune()
                        shard_batch = select(self._mappings.batch(lease.path), columns)
                        current = run.shard
                    assert shard_batch is not None
                    start = run.start
                    while start < run.stop and seen == self._moves and self._position == at:
                        take = min(batch_size - pending_rows, run.stop - start)
                        handed = made % stride == 0
                        if handed:  # the batches between are never sliced
                            pending.append(shard_batch.slice(start, take))
                        pending_rows += take
                        start += take
                        if pending_rows == batch_size:
                            out, pending, pending_rows = pending, [], 0
                            self._end_at(self._position + batch_size, batch_size, drop_last)
                            at = self._position
                            made += 1
                            if handed:
                                sliced = not _leaves_shard(runs, i, start, stride * batch_size)
                                if not sliced:
                                    out = [_owned(out)]
                                self._acquires_next = not sliced
                                yield out
                                # The caller let go of the batch before this one.
                                if kept is not None:
                                    kept.release()
                                    kept = None
                    if seen != self._moves or self._position != at:
                        break
                else:
                    if drop_last:
                        # No whole batch is left before the common end: the rest of the
                        # rank's rows are trimmed (`_end_at`).
                        at = self._end_at(at, batch_size, drop_last)
                    if pending_rows and not drop_last:
                        self._position += pending_rows
                        at = self._position
                        out, pending, pending_rows = pending, [], 0
                        made += 1
                        # The epoch ends: the next acquire is the next epoch's.
                        if out:
                            sliced = False
                            self._acquires_next = True
                            yield [_owned(out)]
                            if kept is not None:
                                kept.release()
                                kept = None
                    # Even after the epoch's last batch, a move reads on from there.
                    if seen == self._moves and self._position == at:
                        break
        finally:
            if lease is not None:
                lease.release()
            if kept is not None:
                kept.release()

    def _drop_stop(self, position: int, batch_size: int) -> int:
        """Where `drop_last` batches cut from `position` end: after the last whole batch
        before the fewest rows any rank of the epoch reads (`shardcache.even_batches`)."""
        least = even_batches.least_samples(self.manifest.total_rows, self._params)
        return even_batches.stop(position, batch_size, min(least, len(self)))

    def _end_at(self, position: int, batch_size: int, drop_last: bool) -> int:
        """Move to where a batch ending at `position` leaves the rank, and return it:
        `position`, or with `drop_last`, when no whole batch fits after it before the
        ranks' common end, the end of the epoch, so a state says the epoch is done (no
        rank reads them in this epoch; an elastic resume does not deal them out). The
        rows trimmed are recorded as a skip: never handed out, as `shardcache lineage`
        and the inspector must say (they read a rank's history from its states)."""
        if drop_last and self._drop_stop(position, batch_size) == position:
            end = len(self)
            if position < end:
                trimmed = states.Skip(self._params.epoch, position, end)
                self._skips = states.normalise([*self._skips, trimmed])
            position = end
        self._position = position
        return position

    def batch_selections(
        self, batch_size: int, *, columns: Sequence[str] | None = None, drop_last: bool = False
    ) -> Generator[selections.Selection, None, None]:
        """Sample mode's batches before they are gathered: per batch, the rows of its
        windows' mapped shards it is made of (`shardcache.selections`), for a consumer
        that gathers them itself (on a GPU, say). `Selection.gather()` is exactly the
        batch `batches()` yields. Positions, leases and `state_dict()` move as with
        `batches()`, except that the window the selection handed last reads stays
        leased until the next is handed (it maps that window's shards), while it and
        the windows acquired are two at most (docs/reading-plan.md, "What it means for
        batches"). A block-mode dataset has nothing to gather: an InputError.
        """
        columns = column_names(columns)
        if not self._params.sampled:
            raise errors.InputError(
                "batch_selections: expected a sample-mode dataset (shuffle='sample'); "
                "a block-mode batch is slices already: use batch_pieces()"
            )
        batch_size = _integers.integer(batch_size, "batch_size", minimum=1)
        self._batch_size = batch_size
        self._ensure_reader()
        yield from self._timed(self._handed_selections(batch_size, columns, drop_last))

    def _handed_selections(
        self, batch_size: int, columns: Sequence[str] | None, drop_last: bool
    ) -> Generator[selections.Selection, None, None]:
        planned = self._selections(
            batch_size, columns=columns, drop_last=drop_last, parts=True, follow=True, held=True
        )
        with contextlib.closing(planned):
            for _, selection in planned:
                if selection is not None:  # always: its leases are its own
                    yield selection

    def _gathered(
        self, batch_size: int, *, columns: Sequence[str] | None, drop_last: bool, stride: int
    ) -> Generator[list[pa.RecordBatch], None, None]:
        """Sample mode's batches: each one gathered (one copy) from its window's shards,
        the next ones ahead on `gather_threads` threads (`shardcache.gather_ahead`).

        The position moves when a batch is handed over, never when it is gathered. A
        move from outside between two batches (a skip, a loaded state, another epoch)
        drops what was gathered ahead and plans again from the new position, as the
        inline gather does by reading the position afresh at every batch.
        """
        # Left out, the pool is shared out among the loader processes a stride says
        # there are (each gathers its own batches).
        threads = (
            gather_ahead.default_threads(sharers=stride)
            if self._gather_threads is None
            else self._gather_threads
        )
        if threads <= 1:
            for _, selection in self._selections(
                batch_size,
                columns=columns,
                drop_last=drop_last,
                parts=False,
                follow=True,
                stride=stride,
            ):
                if selection is not None:  # always: its leases are its own
                    yield [selection.gather()]
                # Not held while the next is planned: its gatherer maps the window's
                # shards, released when the next window's are acquired (`_selections`).
                selection = None
            return
        while True:
            leases = _Leases()
            backlog = gather_ahead.Backlog()
            planned = self._selections(
                batch_size,
                columns=columns,
                drop_last=drop_last,
                parts=False,
                follow=False,
                leases=leases,
                stride=stride,
                backlog=backlog,
            )
            ahead = gather_ahead.gathered(
                planned, threads=threads, chunk_bytes=gather_ahead.CHUNK_BYTES, backlog=backlog
            )
            self._aheads.add(ahead)
            moved = False
            try:
                with contextlib.closing(ahead):
                    mark = self._moves
                    for (lo, hi), batch in ahead:
                        if self._moves != mark or self._position != lo:
                            moved = True
                            break
                        # The batches before this one are handed over: the shards only
                        # they read can go, as the inline gather lets them go.
                        leases.release_before(lo)
                        self._end_at(hi, batch_size, drop_last)
                        yield [batch]
                    else:
                        # close() ends the gathering early: not the epoch's end.
                        self._check_open()
                        # Even after the epoch's last batch, a move reads on from there,
                        # as the inline gather does.
                        moved = self._moves != mark
                        if not moved:
                            # No whole batch was left before the ranks' common end.
                            self._end_at(self._position, batch_size, drop_last)
            finally:
                leases.release_all()
            if not moved:
                return

    def _selections(
        self,
        batch_size: int,
        *,
        columns: Sequence[str] | None,
        drop_last: bool,
        parts: bool,
        follow: bool,
        leases: _Leases | None = None,
        stride: int = 1,
        backlog: gather_ahead.Backlog | None = None,
        held: bool = False,
    ) -> Generator[tuple[tuple[int, int], selections.Selection | None], None, None]:
        """Sample mode's batches as rows of the window's shards, each with the positions
        [lo, hi) of the rank's stream it moves past (the batch's, and with `stride`
        those of the batches between, which are skipped unread); with `parts`, also
        where they lie in their windows (`shardcache.selections`).

        `follow`: the position is read afresh at every batch and moved past it when it
        is yielded (a skip between batches moves it). Otherwise batches follow each other
        from the position at the start, and the position is the caller's to move (a
        caller that plans ahead of what it has handed over), as are `leases`: the shards
        of windows planned past are retired there, not released. With a `backlog`
        (gathering ahead), a batch that would lease shards beyond the window at the
        caller's position and the next yields its span with no selection instead while
        chunks wait for the caller, and is planned when it is next pulled: a reader
        leases at most the window the caller reads and the next, what the sidecar keeps
        resident and what its check of the memory limit counts (`windows.held_at`). With
        three, ranks whose two windows each fit waited for each other's room until the
        memory tier's wait ran out. With nothing queued the batch is planned whatever it
        spans: it is the caller's next (a batch larger than a window spans more than
        two), or the caller moved and plans again.

        `held` (with `follow`): the caller holds the selection it was handed last while
        it asks for the next (`batch_selections()`), and a selection's gatherer and
        window rows are views of its window's mappings. The shards of the window left
        behind then stay leased, so the tier cannot evict them under those views, until
        the next selection is handed: at most that window and the one acquired, what a
        reader gathering ahead holds too (`windows.held_at`).
        """
        from shardcache import gather, sequences  # numpy: sample mode only
        from shardcache import selections as selections_

        own = leases is None
        moves = self._moves
        leases = _Leases() if leases is None else leases
        #: With `held`: leases of the window the selection in the caller's hand reads,
        #: left behind by the plan, released once the next selection is handed.
        leaving: dict[int, provider.ShardLease] = {}
        #: With `held`: the windows the selection handed last reads.
        handed: set[tuple[int, int]] = set()
        holding: list[int] = []
        gatherer: gather.Gatherer | None = None
        slots = sequences.slots([], 0)
        by_shard: dict[int, pa.RecordBatch] = {}
        sources: list[pa.RecordBatch] = []
        #: The windows of the last batch, by (epoch, index): the batches of one window
        #: share one object (its identity tells a consumer its copy can be reused).
        made: dict[tuple[int, int], selections_.WindowRows] = {}
        pos = self._position
        since = pos
        count = 0
        try:
            while True:
                # Back here after a selection was handed (or first): the caller let
                # go of the one before it.
                for lease in leaving.values():
                    lease.release()
                leaving.clear()
                if follow and (pos != self._position or moves != self._moves):
                    # Read the position afresh each batch: a move between batches (a skip,
                    # a loaded state, another epoch) plans again from there.
                    pos = since = self._position
                    moves = self._moves
                    count = 0
                n = min(batch_size, len(self) - pos)
                if n <= 0 or (drop_last and self._drop_stop(pos, batch_size) == pos):
                    if follow:
                        # With drop_last, the rows no whole batch takes before the
                        # ranks' common end are trimmed (`_end_at`).
                        pos = self._end_at(pos, batch_size, drop_last)
                    break
                count += 1
                if (count - 1) % stride:
                    pos += n
                    if follow:
                        pos = self._end_at(pos, batch_size, drop_last)
                    continue
                seq = self.sequence()
                # The rank's stream as ranges of the global sequence: its rule-5 range,
                # or after an elastic resume its segments (positions count along them).
                ranges = plans.stream_ranges(seq.total, self._params)
                lo, hi = pos, pos + n
                # Every shard of the window(s) this batch reads stays leased while the
                # reader is in them; shards of windows left behind are released first
                # (or, planning ahead, once the batches before `lo` are handed over).
                want = seq.stream_window_shards(ranges, lo, hi)
                if want != holding or gatherer is None:
                    while backlog is not None and backlog.chunks and not self._within_reach(want):
                        yield (lo, lo), None
                    if backlog is not None and self._moves == moves:
                        # Every batch before the caller's position is handed over: the
                        # windows only they read go now, not at the next hand-over, so
                        # they are not held beside the two this plan may lease.
                        leases.release_before(self._position)
                    # Kept only while they and the windows acquired are two at most:
                    # a third would be room the sidecar's check of the memory limit
                    # does not count (`windows.held_at`), which ranks waited for.
                    keep = (
                        held
                        and gatherer is not None
                        and len(handed | self._windows_read(ranges, lo, hi)) <= 2
                    )
                    for shard in [s for s in leases.held if s not in want]:
                        if keep:
                            leaving[shard] = leases.held.pop(shard)
                        else:
                            leases.retire(shard, at=lo)
                    if follow:
                        leases.release_before(lo)
                    # The shards let go of above stay mapped while anything here holds
                    # them, and an evicted one's pages stay in the memory volume: the
                    # acquires below could wait for room this reader holds itself.
                    gatherer, sources, by_shard = None, [], {}
                    for shard in want:
                        if shard in leaving:
                            leases.held[shard] = leaving.pop(shard)
                        if not leases.reuse(shard):
                            leases.held[shard] = self._acquire(
                                self._reader_id,
                                shard,
                                epoch=self._params.epoch,
                                position=lo,
                            )
                    self._mappings.prune()
                    sources = [
                        select(self._mappings.batch(leases.held[s].path), columns) for s in want
                    ]
                    gatherer = gather.Gatherer(sources)
                    slots = sequences.slots(want, len(seq.offsets))
                    by_shard = dict(zip(want, sources, strict=True))
                    holding = want
                where: list[selections_.Part] = []
                if parts:
                    made = self._window_parts(seq, ranges, lo, hi, by_shard, made, where)
                pos = hi
                if follow:
                    pos = self._end_at(hi, batch_size, drop_last)
                if held:
                    handed = self._windows_read(ranges, lo, hi)
                span, since = (since, hi), hi
                yield (
                    span,
                    selections_.Selection(
                        gatherer,
                        seq.stream_indices(ranges, lo, hi),
                        seq.offsets,
                        seq.total,
                        slots,
                        where,
                    ),
                )
        finally:
            for lease in leaving.values():
                lease.release()
            if own:
                leases.release_all()

    def _windows_read(
        self, ranges: Sequence[streams.Range], lo: int, hi: int
    ) -> set[tuple[int, int]]:
        return _windows_read(ranges, lo, hi, width=self._params.window, epoch=self._params.epoch)

    def _within_reach(self, shards: Sequence[int]) -> bool:
        """Whether `shards` are all of the window the caller's position is in or of
        the next (`windows.held_at`): what a reader planning ahead may lease."""
        cached = self._windows_cache
        if cached is None or cached[0] != self._params:
            m = self.manifest
            wins = windows.rank_windows(m.shard_rows, m.digest, self._params)
            cached = self._windows_cache = (self._params, wins, windows.window_ends(wins))
        _, wins, ends = cached
        reach = set(windows.held_at(wins, ends, self._position))
        return reach.issuperset(shards)

    def _window_parts(
        self,
        seq: sequences.Sequence,
        ranges: Sequence[streams.Range],
        lo: int,
        hi: int,
        by_shard: Mapping[int, pa.RecordBatch],
        made: Mapping[tuple[int, int], selections.WindowRows],
        out: list[selections.Part],
    ) -> dict[tuple[int, int], selections.WindowRows]:
        """Append to `out` where stream positions [lo, hi) lie in their windows; the
        windows used (reusing `made`'s objects)."""
        from shardcache import selections as selections_

        used: dict[tuple[int, int], selections_.WindowRows] = {}
        width = self._params.window
        epoch = self._params.epoch
        for a, b in streams.cut(ranges, lo, hi):
            pos = a
            while pos < b:
                k = windows.window_of(pos, width)
                start, stop = windows.window_span(seq.total, width, k)
                cut = min(b, stop)
                window = used.get((epoch, k)) or made.get((epoch, k))
                if window is None:
                    pieces = [
                        by_shard[run.shard].slice(run.start, len(run)) for run in seq.window_runs(k)
                    ]
                    window = selections_.WindowRows(self._reader_id, epoch, k, pieces, stop - start)
                used[(epoch, k)] = window
                out.append(selections_.Part(window, seq.window_order(k)[pos - start : cut - start]))
                pos = cut
        return used

    def take(
        self, indices: Sequence[int] | Any, *, columns: Sequence[str] | None = None
    ) -> pa.RecordBatch:
        """The rows at dataset-wide sample indices `indices` (positions in manifest
        order, from 0), in the order asked, repeats allowed: one record batch gathered
        with one copy from the same cache the stream reads (embedded or the sidecar),
        under leases held only for the call. Does not move this rank's position.

        `indices` is a sequence of ints or an integer numpy array. An index outside
        [0, len(dataset's manifest)) is an InputError naming it. Needs numpy.
        """
        columns = column_names(columns)
        import numpy as np  # numpy: sample mode and take() only

        from shardcache import gather, sequences

        if isinstance(indices, Iterator):
            # np.asarray would make one object of it, named as "an array of object".
            raise errors.InputError(
                "take: expected a flat sequence of integer sample indices (a list, a range "
                f"or an integer numpy array), found {type(indices).__name__}, an iterator: "
                "pass list() of it"
            )
        idx = np.asarray(indices)
        # Ints past uint64's range stay Python ints in an object array: out of range,
        # and named so by `locate` below, which compares them as they were asked.
        huge = idx.ndim == 1 and idx.dtype == object and _python_ints(idx)
        if not huge and (
            idx.ndim != 1 or not (idx.size == 0 or np.issubdtype(idx.dtype, np.integer))
        ):
            raise errors.InputError(
                f"take: expected a flat sequence of integer sample indices, found an array "
                f"of {idx.dtype} with shape {idx.shape}"
            )
        m = self.manifest
        offsets = np.asarray(plans.shard_offsets(m.shard_rows), dtype=np.int64)
        # Uncast: locate checks the range in the indices' own type before it casts.
        shard_of, row_of = sequences.locate(offsets, m.total_rows, idx)
        used, source_of = sequences.group(shard_of)
        if not used:
            # No row asked: the schema still comes from a shard (the first with rows).
            used = [int(np.argmax(np.asarray(m.shard_rows) > 0))]
        self._ensure_reader()
        leases: list[provider.ShardLease] = []
        try:
            for shard in used:
                leases.append(
                    self._acquire(
                        self._reader_id, shard, epoch=self._params.epoch, position=self._position
                    )
                )
            self._mappings.prune()
            sources = [select(self._mappings.batch(lease.path), columns) for lease in leases]
            return gather.gather(sources, source_of, row_of)
        finally:
            for lease in leases:
                lease.release()

    def _timed(self, batches: Generator[B, None, None]) -> Generator[B, None, None]:
        """`batches`, timing the caller's loop around them (the data-stall signal,
        `StallMeter.wrap`): from asking for a batch to getting it is waiting on data,
        from getting one to asking for the next is its step, across epochs too.
        Outermost, so all the work of making a batch (stitching pieces included) counts
        as waiting. Closing it closes `batches`, which releases the lease an unfinished
        iteration holds."""
        reporter = self._stall_reporter

        def report() -> None:
            assert reporter is not None
            reporter.note_stalls(self._reader_id, self.stalls)

        yield from self.stalls.wrap(batches, on_batch=None if reporter is None else report)

    def skip_batches(self, batches: int, *, batch_size: int | None = None) -> states.Skip | None:
        """Skip this rank's next `batches` batches without reading them.

        The skipped range of positions is recorded in `state_dict()`, so a resumed run,
        the inspector and `shardcache lineage` know these samples were never read; they
        are never yielded and the rest of the epoch is read as planned. The batch size
        is `batch_size`, else the last `batches()` call's, else the loaded state's. A
        skip stops at the end of the epoch. May be called between batches while a
        `batches()` iterator is open: it continues after the skipped range. Returns the
        recorded range, or None when the epoch had nothing left to skip.
        """
        if batch_size is None:
            batch_size = self._batch_size
        new, skip = states.skip_batches(
            self._state(), batches, batch_size=batch_size, rank_samples=len(self)
        )
        self._position = new.position
        self._batch_size = new.batch_size
        self._skips = new.skips
        self._moves += 1
        return skip

    def add_mapping_listener(self, listener: MappingListener) -> None:
        """Have `listener` told of every shard mapping this reader makes and drops from
        now on (the device prefetcher registers them with the GPU driver)."""
        self._mappings.listeners.append(listener)

    def remove_mapping_listener(self, listener: MappingListener) -> None:
        self._mappings.listeners.remove(listener)

    def __iter__(self) -> Iterator[pa.RecordBatch]:
        return self.batches(1024)

    # --- state ------------------------------------------------------------------
    def _state(self) -> states.DataState:
        return states.DataState(
            digest=self.manifest.digest,
            params=self._params,
            position=self._position,
            batch_size=self._batch_size,
            skips=self._skips,
        )

    def state_dict(self) -> dict[str, Any]:
        """A small JSON-serialisable dict: where this rank is in the stream, and the
        ranges it skipped (docs/reading-plan.md, "State dict")."""
        return self._state().to_json()

    def load_state_dict(self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Resume at the exact next sample of the run that saved `state`, with its
        skips. States of every supported version load (version 1 has no skips).

        To resume at another world size, pass the list of every old rank's state from
        one checkpoint (any order): the samples no old rank consumed in that epoch are
        shared among the new ranks (`shardcache.elastic`, docs/reading-plan.md,
        "Elastic resume"). A list at this dataset's world size resumes this rank's own.

        All or nothing: a state refused (StateMismatchError) leaves the dataset as it
        was, epoch, position and skips, so it reads on where it stood.
        """
        resumed = self.checked_state(state)
        if self._registered and resumed.params.segments != self._params.segments:
            # The cache follows a reader's plan: register the new one.
            self._provider.close_reader(self._reader_id)
            self._registered = False
        self._params = resumed.params
        self._position = resumed.position
        self._skips = resumed.skips
        if resumed.batch_size is not None:
            self._batch_size = resumed.batch_size
        self._moves += 1
        self._loaded = (self._moves, self._params.epoch, self._position)

    def seek(self, position: int, *, epoch: int | None = None) -> None:
        """Move to `position` of `epoch` (this epoch when None): a reader's own move (each
        pass, and each loader process, starts at a place of its own), made as loading
        `states.moved` of this dataset's state, that epoch's later skips cut there.

        Not a resume: it never arms `set_epoch`'s refusal of an epoch before a loaded
        state's (a walk that found nothing left in epoch 1 may go back to epoch 0), and
        a state loaded and not read from yet stays armed when the move leaves it where
        it stood (the pass's first seek, before any batch)."""
        loaded = self._loaded
        armed = loaded is not None and loaded[0] == self._moves and loaded[2] == self._position
        self.load_state_dict(states.moved(self.state_dict(), position=position, epoch=epoch))
        if armed and loaded is not None and loaded[1:] == (self._params.epoch, self._position):
            self._loaded = (self._moves, loaded[1], loaded[2])
        else:
            self._loaded = loaded

    def checked_state(
        self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]
    ) -> states.DataState:
        """Where `load_state_dict(state)` would resume this dataset (its plan, with the
        state's epoch and segments, position and skips), checked the same way; changes
        nothing. For callers that check several states before loading any (a mixture
        loads all its sources' or none)."""
        saved = self._pick(state)
        differ = states.mismatches(saved, self._state())
        if differ:
            raise errors.StateMismatchError(
                self._older_manifest(saved.digest)
                or "cannot resume: the state was saved by another dataset or configuration ("
                + "; ".join(differ)
                + "); open the dataset with the same arguments as the run that saved it"
            )
        params = dataclasses.replace(
            self._params, epoch=saved.epoch, segments=saved.params.segments
        )
        # Segments name positions of the epoch's global sequence, one per row: one past
        # its end would be read as fewer rows than the state counts (len() and the
        # remaining rows would disagree), so it is no state of this dataset.
        total = self.manifest.total_rows
        seg = params.segments
        if seg is not None and seg.ranges and seg.ranges[-1][1] > total:
            raise errors.StateMismatchError(
                f"segments of epoch {seg.epoch}: expected ranges within the epoch's "
                f"{total} samples [0, {total}), found one ending at {seg.ranges[-1][1]} "
                f"({list(seg.ranges[-1])}): the state contradicts this dataset; was it "
                "edited by hand?"
            )
        samples = plans.rank_samples(total, params)
        # A skip the checkpoint agent applied at restore may run past the epoch's end.
        saved = states.clamp(saved, samples)
        if saved.position > samples:
            raise errors.StateMismatchError(
                f"position {saved.position} is past the end of epoch {saved.epoch} for rank "
                f"{params.rank} ({samples} samples)"
            )
        return dataclasses.replace(saved, params=params)

    def _older_manifest(self, digest: str) -> str | None:
        """Why a state of this very dataset, saved before manifest version 3, cannot
        resume here (None when `digest` is no such state's): said apart from "another
        dataset", which would send its owner looking for the wrong mistake."""
        if digest not in manifests.version_2_digests(self.manifest):
            return None
        return (
            f"cannot resume: the state was saved from this dataset's manifest of version 2 "
            f"(digest {digest}), by a shardcache older than manifest version "
            f"{manifests.MANIFEST_VERSION} (per-shard sha256), which digests it as "
            f"{self.manifest.digest}; the reading plan is seeded by the digest, so the "
            "saved position names rows of another order and resuming would repeat and "
            "skip samples. Resume it with the shardcache release that saved it, or go on "
            "with this one from the next epoch without the state "
            f"(set_epoch(state['epoch'] + 1)), which reads every sample of that epoch once"
        )

    def _pick(self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> states.DataState:
        """The state this rank resumes from: `state` itself, or from a list of every old
        rank's states, this rank's own (same world size) or its share (elastic)."""
        if isinstance(state, Mapping):
            saved = states.parse(state)
            if saved.world_size != self._params.world_size:
                differ = states.mismatches(saved, self._state())
                raise errors.StateMismatchError(
                    "cannot resume: the state was saved by another configuration ("
                    + "; ".join(differ)
                    + "): to resume at another world size pass the list of every old "
                    "rank's state (load_state_dict([...]))"
                )
            return saved
        if not isinstance(state, list | tuple):
            raise errors.StateMismatchError(
                "expected a state dict from Dataset.state_dict() or a list of every rank's, "
                f"got {type(state).__name__}"
            )
        parsed = [states.parse(s, where=f"state {i}") for i, s in enumerate(state)]
        old = elastic.gather(parsed)
        # Every old rank's state, not only the one this rank resumes from: the split
        # below trusts them all to fit this manifest and plan, and a list of which one
        # does not is no checkpoint of this run at any world size.
        ours = self._params
        unlike: list[str] = []
        for saved in old:
            probe = dataclasses.replace(
                saved,
                params=dataclasses.replace(
                    saved.params, world_size=ours.world_size, rank=ours.rank
                ),
            )
            unlike += [d for d in states.mismatches(probe, self._state()) if d not in unlike]
        if unlike:
            raise errors.StateMismatchError(
                self._older_manifest(old[0].digest)
                or "cannot resume: the states were saved by another dataset or configuration ("
                + "; ".join(unlike)
                + "); open the dataset with the same arguments as the run that saved them"
            )
        if old[0].world_size == ours.world_size:
            return old[ours.rank]
        new = elastic.resize(
            old, total_rows=self.manifest.total_rows, world_size=self._params.world_size
        )
        return new[self._params.rank]

    # --- lifecycle ----------------------------------------------------------------
    def _ensure_reader(self) -> None:
        self._check_open()
        if not self._registered:
            self._reader_id = self._provider.open_reader(self._params, position=self._position)
            self._registered = True

    def _check_open(self) -> None:
        if self._closed:
            raise errors.InputError(
                "this dataset was closed: expected an open dataset, found one whose "
                "close() was called; open it again (shardcache.open) to read on"
            )

    def _acquire(self, reader_id: str, shard: int, *, epoch: int, position: int) -> _Lease:
        # An iteration begun before close() must not read on through a closed provider.
        self._check_open()
        # Mappings of evicted files hold their pages in the memory volume, which the
        # acquire of a cold shard may need: let them go before, and while it waits.
        mappings = self._mappings
        mappings.prune()
        with mappings.waiting():
            return self._provider.acquire(reader_id, shard, epoch=epoch, position=position)

    def close(self) -> None:
        self._closed = True
        # An iteration left open stops gathering (its threads end) and ends there.
        for ahead in list(self._aheads):
            ahead.close()
        self._mappings.clear()
        if self._registered:
            self._provider.close_reader(self._reader_id)
            self._registered = False
        self._provider.close()

    def __enter__(self) -> Dataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
