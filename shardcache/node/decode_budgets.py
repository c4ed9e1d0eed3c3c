"""The bytes of decoded shards one process holds at once, bounded across its fetches.

Each fetch decodes one shard in memory before writing it to the memory tier, so
`fetch_concurrency` decodes at once would take that many times a shard. A decode first
reserves its decoded size here (from the shard's metadata, or its budget when the
format cannot tell) and holds it until the shard is written: the process's decoded
bytes stay within the memory tier's limit however many fetches run (issue 13;
docs/security.md).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from shardcache import errors


class DecodeBudget:
    def __init__(self, capacity: int) -> None:
        #: Bytes all reservations together may hold: the memory tier's limit.
        self.capacity = capacity
        self._held = 0
        self._changed = threading.Condition()

    @property
    def held(self) -> int:
        with self._changed:
            return self._held

    @contextlib.contextmanager
    def reserve(self, nbytes: int) -> Iterator[None]:
        """Hold `nbytes` for the block, waiting while others hold too much for it.

        A reservation over the whole capacity could never be granted: the caller checks
        sizes against the memory limit first, so that is a bug, raised at once."""
        if nbytes > self.capacity:
            raise errors.CacheError(
                f"a decode of {nbytes} bytes cannot fit the decode budget of "
                f"{self.capacity} bytes (the memory tier's limit)"
            )
        with self._changed:
            self._changed.wait_for(lambda: self._held + nbytes <= self.capacity)
            self._held += nbytes
        try:
            yield
        finally:
            with self._changed:
                self._held -= nbytes
                self._changed.notify_all()
