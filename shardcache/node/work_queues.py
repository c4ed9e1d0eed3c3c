"""The prefetcher's queue of shards to make resident, most urgent first.

A FIFO of submitted fetches (a thread pool's queue) serves shards in the order their
readers happened to ask, so a shard one rank needs now can wait behind another rank's
fifth: in a cold epoch the fetch slots then sit on readahead while ranks wait
(docs/benchmarks.md, issue 14's cold fill). Here every shard is queued at most once,
under the most urgent priority anyone asked it with, and each free fetch thread takes
the most urgent shard left: no waves, no slot idle while a shard is wanted.

A priority is `(index, kind)`: `index` is how many shards the asking reader reads
before this one (0: it needs it now), `kind` 0 for a registered reader's readahead and
1 for the fill (the epoch's plans beyond the readers' depth, for ranks that may not
have registered yet), so at the same index a reader that exists goes first.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time

Priority = tuple[int, int]
READAHEAD = 0
FILL = 1


class WorkQueue:
    """Shards with their best priority; `get` blocks until one is queued or it is closed."""

    def __init__(self) -> None:
        self._heap: list[tuple[Priority, int, int]] = []
        #: shard -> (its best priority, why it was asked for, when it was first queued).
        self._best: dict[int, tuple[Priority, str, float]] = {}
        self._order = itertools.count()
        self._changed = threading.Condition()
        self._closed = False
        #: Shards queued or handed out and not yet `done`.
        self._unfinished = 0

    def put(self, shard: int, priority: Priority, why: str) -> bool:
        """Queue `shard`, or raise its priority; False if it was queued as urgently
        already (or the queue is closed)."""
        with self._changed:
            if self._closed:
                return False
            found = self._best.get(shard)
            if found is not None and found[0] <= priority:
                return False
            # A shard asked for again keeps the time it was first asked for: its wait
            # in the timeline is from then.
            queued = time.monotonic() if found is None else found[2]
            if found is None:
                self._unfinished += 1
            self._best[shard] = (priority, why, queued)
            # The entry under the old priority stays in the heap and is skipped in `get`.
            heapq.heappush(self._heap, (priority, next(self._order), shard))
            self._changed.notify()
            return True

    def get(self) -> tuple[int, Priority, str, float] | None:
        """The most urgent shard (oldest first among equals), its priority, why, and
        when it was queued; blocks while none is queued; None once closed."""
        with self._changed:
            while True:
                if self._closed:
                    return None
                while self._heap:
                    priority, _, shard = heapq.heappop(self._heap)
                    found = self._best.get(shard)
                    if found is not None and found[0] == priority:
                        del self._best[shard]
                        return shard, priority, found[1], found[2]
                self._changed.wait()

    def done(self) -> None:
        """A shard `get` handed out is dealt with (made resident, or given up)."""
        with self._changed:
            self._unfinished -= 1

    @property
    def unfinished(self) -> int:
        """Shards queued, or handed out and not `done`: 0 when the prefetcher is idle."""
        with self._changed:
            return self._unfinished

    def __contains__(self, shard: int) -> bool:
        with self._changed:
            return shard in self._best

    def __len__(self) -> int:
        with self._changed:
            return len(self._best)

    def close(self) -> None:
        """Wake every `get` with None; what is still queued is dropped."""
        with self._changed:
            self._closed = True
            self._unfinished -= len(self._best)
            self._best.clear()
            self._heap.clear()
            self._changed.notify_all()
