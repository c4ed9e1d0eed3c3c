"""Sample mode's gather, run ahead of the consumer on a few threads.

A sample-mode batch is gathered with one copy of every row (`shardcache.gather`), and
one thread copying rows from random places in the mapped shards is bound by memory
latency: each row starts with a DRAM and TLB miss the prefetchers cannot hide, so the
copy alone reaches 0.17-0.31x block mode's zero-copy read (docs/benchmarks.md, "Sample
mode's gather: ... its floor"). Several threads each waiting on their own misses hide
one another's, and the gather's kernels (numpy's fancy indexing, Arrow's `take`)
release the GIL: so while the consumer works on batch n, the next batches are gathered
on a small pool of threads.

Gathering ahead, consecutive batches of one window are gathered in chunks: one copy of
all their rows (about `CHUNK_BYTES`, at most `MAX_CHUNK_BATCHES` batches), handed out
as zero-copy slices of it (`selections.gather_many`). A gather's fixed cost under the
GIL (the numpy and Arrow calls around the copy) and the hand-over through a future are
paid once a chunk, and a thread runs one long copy without the GIL instead of many short
ones that each take it back: per-batch gathers on two threads were no faster than one
inline on the 2-core bench machine, chunks of 16 MiB were (docs/benchmarks.md, "Sample
mode, session 7"). The first chunks of an iteration are one batch, then two, four, ...,
so the first batch waits for one batch's gather, not a chunk's.

What does not change: the batches are the same, in the same order (batch n is the
n-th selection's rows, byte for byte what `Selection.gather()` makes, and they are
handed over in order), and the position (`state_dict()`) moves only when a batch is
handed over; gathered batches not handed over yet are dropped, never counted. Memory is
bounded: at most `threads * AHEAD_PER_THREAD` chunks are gathered or being gathered
beyond the one the consumer takes batches from, and a batch handed out keeps its whole
chunk's buffers alive while the caller holds it.

The pool lives as long as one iteration: closing the iterator (or dropping it, or the
end of the epoch) cancels what was queued, waits for the gathers running (they read
mapped shards) and stops the threads. A process forked while an iteration was open
(DataLoader workers) has none of its parent's threads: it neither waits on nor stops
them.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
from collections.abc import Generator
from typing import TYPE_CHECKING, Generic, TypeVar

import pyarrow as pa

from shardcache import errors
from shardcache.node import quotas

if TYPE_CHECKING:
    # numpy's: `import shardcache` imports neither (sample mode needs them).
    from shardcache import selections

#: The pool's threads are named so (a test counts them; a profile shows them).
THREAD_NAME = "shardcache-gather"
#: The default pool is one thread per CPU the container may use but one (the caller's
#: own: it works on the batches), at most this many. Every gather thread still runs a
#: little Python per batch under the GIL, and so does the consumer between its own
#: calls: past a few threads they mostly wait on each other for it. On the 16-core
#: device (2026-11-26 15:08 UTC) 2 threads gave 0.43x block mode, 4 gave 0.36x, 8 and
#: 16 less (docs/benchmarks.md, "Sample mode under the GIL").
MAX_DEFAULT_THREADS = 4
#: Chunks gathered (or being gathered) ahead, per thread: one running and one done
#: and waiting keeps every thread busy while the consumer takes the oldest.
AHEAD_PER_THREAD = 2
#: Bytes one gather copies at once when gathering ahead (`chunk_bytes`): consecutive
#: batches of one window are gathered by one copy of this size or so and handed out as
#: slices of it (see `gathered`).
CHUNK_BYTES = 16 << 20
#: Chunks are queued from at most this many windows at once: the one the caller reads
#: and the next (what the sidecar prefetches, `windows.next_shards`). A window's shards
#: are leased while a queued chunk reads them, and small windows would otherwise let
#: `threads * AHEAD_PER_THREAD` chunks lease as many windows. The plan itself leases no
#: window past those two (`Dataset._selections` waits, an item with no selection), so
#: the next chunk's first batch, planned to find its window, leases no third.
WINDOWS_AHEAD = 2
#: The most batches in one chunk, whatever their size (it bounds how far the plan, and
#: so the leases, run ahead of the caller).
MAX_CHUNK_BATCHES = 16

K = TypeVar("K")


def default_threads(quota: quotas.Quota | None = None, *, sharers: int = 1) -> int:
    """Gather threads when the option is left out: the CPUs the cgroup quota and the
    affinity allow (`shardcache.node.quotas`) less the caller's, at least 2 and at most
    `MAX_DEFAULT_THREADS`; with one CPU, 1 (the inline gather: no CPU to gather on
    beside the caller). `sharers` processes reading the rank's batches (DataLoader
    workers) share the CPUs: each gets its part.

    Two CPUs get two threads, not one: what pays is two copies at once (one thread
    beside the caller gave little over the inline gather), and a trainer's caller
    thread mostly waits on its accelerator, so the gathers run during the step instead
    of before the next one. On the 2-core bench machine with nothing else running, 2
    threads read 0.31-0.34x block mode against 0.23-0.25x inline; the inline gather won
    only while another process held the second core (docs/benchmarks.md, "Sample mode,
    session 7", "Two CPUs: two gather threads").
    """
    cpus = (quota or quotas.read()).cpus // max(1, sharers)
    if cpus < 2:
        return 1
    return max(2, min(MAX_DEFAULT_THREADS, cpus - 1))


def check_threads(value: object, *, where: str = "gather_threads") -> int:
    """`value` as a thread count, or InputError naming what was expected."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise errors.InputError(
            f"{where}: expected a thread count (an int >= 0; 0 or 1 gathers in the "
            f"consumer's thread), found {type(value).__name__} {value!r}"
        )
    return value


def most_ahead(threads: int) -> int:
    """The most batches planned (their windows leased) beyond the one the caller holds,
    gathering ahead on `threads` threads: `threads * AHEAD_PER_THREAD` chunks of at most
    `MAX_CHUNK_BATCHES`, and the batch that starts the next chunk (0 inline)."""
    return 0 if threads <= 1 else threads * AHEAD_PER_THREAD * MAX_CHUNK_BATCHES + 1


def chunk_batches(selection: selections.Selection, chunk_bytes: int) -> int:
    """How many batches like `selection` one gather copies at once: as many as fit
    in `chunk_bytes` (by its gatherer's mean row size), at least 1, at most
    `MAX_CHUNK_BATCHES`."""
    batch_bytes = max(1.0, len(selection) * selection.gatherer.row_bytes)
    return max(1, min(MAX_CHUNK_BATCHES, int(chunk_bytes // batch_bytes)))


class Backlog:
    """How many gathered chunks wait for the caller to take their batches, as of the
    last time `gathered` pulled an item: a plan that leases no window past the caller's
    and the next waits only while there are some (`Dataset._selections`), since only
    the caller taking them moves it on."""

    def __init__(self) -> None:
        self.chunks = 0


def gathered(
    items: Generator[tuple[K, selections.Selection | None], None, None],
    *,
    threads: int,
    chunk_bytes: int = 0,
    backlog: Backlog | None = None,
) -> Generator[tuple[K, pa.RecordBatch], None, None]:
    """Each item's key with its selection gathered, in the items' order; `items` is
    closed when this is (after the gathers running are done).

    `threads` <= 1 gathers each one when it is asked for, in the caller's thread. More
    gather up to `threads * AHEAD_PER_THREAD` chunks ahead on that many threads: items
    are pulled from `items` ahead of the caller, in the caller's thread (so whatever
    makes them, leases and plan caches included, stays single-threaded). A chunk is
    consecutive items of one gatherer (window), as many as `chunk_batches` allows for
    `chunk_bytes` (0: one item each), gathered with one copy and handed out as slices
    (`selections.gather_many`). A chunk whose gather fails raises when the caller reaches
    its first batch: the chunks before it are handed out whole, nothing of it. An item
    whose selection is None says the next one cannot be planned before the caller has
    taken the batches queued (`Dataset._selections`, the windows it leases): nothing more
    is queued until they are taken, and it is asked for again. `backlog` is kept up to
    date with the chunks queued before every item is pulled.
    """
    if threads <= 1:
        try:
            for key, selection in items:
                # None waits for queued batches; inline, nothing is queued to wait for.
                if selection is not None:
                    yield key, selection.gather()
        finally:
            items.close()
        return
    # numpy's, like the selections themselves: imported only once gathering ahead.
    from shardcache import selections as selections_

    depth = threads * AHEAD_PER_THREAD
    pid = os.getpid()
    pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=THREAD_NAME)
    queue: collections.deque[tuple[list[K], concurrent.futures.Future[list[pa.RecordBatch]]]] = (
        collections.deque()
    )
    chunker = _Chunker(items, chunk_bytes)
    # The window (gatherer) of each queued chunk, in the queue's order.
    windows: collections.deque[object] = collections.deque()
    try:
        while True:
            while len(queue) < depth:
                if backlog is not None:
                    backlog.chunks = len(queue)
                upcoming = chunker.peek()
                if upcoming is None:
                    break
                if upcoming.gatherer not in windows and len(set(map(id, windows))) >= (
                    WINDOWS_AHEAD
                ):
                    break
                keys, chunk = chunker.take()
                queue.append((keys, pool.submit(selections_.gather_many, chunk)))
                windows.append(chunk[0].gatherer)
            if not queue:
                if chunker.exhausted:
                    return
                # The plan waits only while chunks are queued (`backlog`).
                raise errors.CacheError(
                    "gathering ahead: the plan waits for leases to be released with no "
                    "batch queued to release them (a bug: please report it)"
                )
            keys, future = queue.popleft()
            windows.popleft()
            for key, batch in zip(keys, future.result(), strict=True):
                yield key, batch
    finally:
        for _, future in queue:
            future.cancel()
        if os.getpid() == pid:
            # Waits for the gathers running: they read the shards `items` holds leases
            # on, which closing it (the caller's part) releases.
            pool.shutdown(wait=True, cancel_futures=True)
        items.close()


class _Chunker(Generic[K]):
    """`items` cut into chunks: consecutive items of one gatherer, at most
    `chunk_batches` of them (one each where `chunk_bytes` is 0). The first chunks are
    small, so the first batch comes after one batch's gather, not a whole chunk's: the
    n-th chunk holds at most 2**n items. An item is pulled from `items` (and its window
    leased) only by `peek`, for the next chunk, or while a chunk is filled."""

    def __init__(
        self,
        items: Generator[tuple[K, selections.Selection | None], None, None],
        chunk_bytes: int,
    ) -> None:
        self._items = items
        self._chunk_bytes = chunk_bytes
        self._held: tuple[K, selections.Selection] | None = None
        self._ramp = 1
        #: `items` has no more.
        self.exhausted = False

    def peek(self) -> selections.Selection | None:
        """The next chunk's first selection (None when `items` is exhausted, or says
        to wait: then the next peek asks it again)."""
        if self._held is None:
            item = next(self._items, None)
            if item is None:
                self.exhausted = True
                return None
            key, selection = item
            if selection is None:
                return None
            self._held = (key, selection)
        return self._held[1]

    def take(self) -> tuple[list[K], list[selections.Selection]]:
        """The next chunk's keys and selections (empty when `items` is exhausted)."""
        keys: list[K] = []
        chunk: list[selections.Selection] = []
        limit = 1
        while len(chunk) < limit:
            selection = self.peek()
            if selection is None or (chunk and selection.gatherer is not chunk[0].gatherer):
                break
            if not chunk and self._chunk_bytes:
                limit = min(self._ramp, chunk_batches(selection, self._chunk_bytes))
                self._ramp *= 2
            assert self._held is not None
            keys.append(self._held[0])
            chunk.append(selection)
            self._held = None
        return keys, chunk
