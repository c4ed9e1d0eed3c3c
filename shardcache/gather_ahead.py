"""Sample mode's gather, run ahead of the consumer on a few threads.

A sample-mode batch is gathered with one copy of every row (`shardcache.gather`), and
one thread copying rows from random places in the mapped shards is bound by memory
latency: each row starts with a DRAM and TLB miss the prefetchers cannot hide, so the
copy alone reaches 0.17-0.31x block mode's zero-copy read (docs/benchmarks.md, "Sample
mode's gather: ... its floor"). Several threads each waiting on their own misses hide
one another's, and the gather's kernels (numpy's fancy indexing, Arrow's `take`)
release the GIL: so while the consumer works on batch n, the next batches are gathered
on a small pool of threads.

What does not change: the batches are the same, in the same order (batch n is still
`Selection.gather()` of the n-th selection, and they are handed over in order), and the
position (`state_dict()`) moves only when a batch is handed over; gathered batches not
handed over yet are dropped, never counted. Memory is bounded: at most `depth` batches
are gathered or being gathered beyond the one the consumer holds.

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
from typing import TYPE_CHECKING, TypeVar

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
#: Batches gathered (or being gathered) ahead, per thread: one running and one done
#: and waiting keeps every thread busy while the consumer takes the oldest.
AHEAD_PER_THREAD = 2

K = TypeVar("K")


def default_threads(quota: quotas.Quota | None = None, *, sharers: int = 1) -> int:
    """Gather threads when the option is left out: the CPUs the cgroup quota and the
    affinity allow (`shardcache.node.quotas`) less the caller's, at most
    `MAX_DEFAULT_THREADS`. With two CPUs or fewer that is 1, the inline gather: on the
    2-core bench machine two gather threads beside the caller were slower than none
    (docs/benchmarks.md, "Gathering ahead"). `sharers` processes reading the rank's
    batches (DataLoader workers) share the CPUs: each gets its part."""
    cpus = (quota or quotas.read()).cpus // max(1, sharers)
    return max(1, min(MAX_DEFAULT_THREADS, cpus - 1))


def check_threads(value: object, *, where: str = "gather_threads") -> int:
    """`value` as a thread count, or InputError naming what was expected."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise errors.InputError(
            f"{where}: expected a thread count (an int >= 0; 0 or 1 gathers in the "
            f"consumer's thread), found {type(value).__name__} {value!r}"
        )
    return value


def gathered(
    items: Generator[tuple[K, selections.Selection], None, None], *, threads: int
) -> Generator[tuple[K, pa.RecordBatch], None, None]:
    """Each item's key with its selection gathered, in the items' order; `items` is
    closed when this is (after the gathers running are done).

    `threads` <= 1 gathers each one when it is asked for, in the caller's thread. More
    gather up to `threads * AHEAD_PER_THREAD` items ahead on that many threads: items are
    pulled from `items` ahead of the caller, in the caller's thread (so whatever makes
    them, leases and plan caches included, stays single-threaded).
    """
    if threads <= 1:
        try:
            for key, selection in items:
                yield key, selection.gather()
        finally:
            items.close()
        return
    depth = threads * AHEAD_PER_THREAD
    pid = os.getpid()
    pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=THREAD_NAME)
    queue: collections.deque[tuple[K, concurrent.futures.Future[pa.RecordBatch]]] = (
        collections.deque()
    )
    exhausted = False
    try:
        while True:
            while not exhausted and len(queue) < depth:
                try:
                    key, selection = next(items)
                except StopIteration:
                    exhausted = True
                    break
                queue.append((key, pool.submit(selection.gather)))
            if not queue:
                return
            key, future = queue.popleft()
            yield key, future.result()
    finally:
        for _, future in queue:
            future.cancel()
        if os.getpid() == pid:
            # Waits for the gathers running: they read the shards `items` holds leases
            # on, which closing it (the caller's part) releases.
            pool.shutdown(wait=True, cancel_futures=True)
        items.close()
