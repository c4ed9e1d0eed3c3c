"""Training loops that stall on purpose, for the data-stall signal's tests.

`SlowShards` wraps a real provider (the sidecar client) and holds every shard acquire
back while `slow` is set: storage that cannot keep up. With batches larger than a
shard, every batch waits for a shard, so a loop that computes nothing between batches
spends nearly all its time waiting on data; clearing `slow` (and computing between
batches) is a job whose data keeps up.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import shardcache
from shardcache import plans, provider, stalls

#: Seconds each acquire is held back while slow: far longer than a warm acquire or a
#: loop iteration, so the waiting share is close to 1 even on a loaded machine.
DELAY_S = 0.05


class SlowShards:
    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.slow = threading.Event()
        self.slow.set()

    @property
    def manifest(self) -> Any:
        return self.inner.manifest

    def open_reader(self, params: plans.PlanParams, *, position: int) -> str:
        return str(self.inner.open_reader(params, position=position))

    def acquire(self, reader_id: str, shard: int, *, epoch: int, position: int) -> Any:
        if self.slow.is_set():
            threading.Event().wait(DELAY_S)
        return self.inner.acquire(reader_id, shard, epoch=epoch, position=position)

    def note_stalls(self, reader_id: str, meter: stalls.StallMeter) -> None:
        self.inner.note_stalls(reader_id, meter)

    def close_reader(self, reader_id: str) -> None:
        self.inner.close_reader(reader_id)

    def close(self) -> None:
        self.inner.close()


assert isinstance(SlowShards(None), provider.StallReporter)


def read_until(
    stop: threading.Event, ds: shardcache.Dataset, batch_size: int, step: Callable[[], None]
) -> None:
    """Read epoch after epoch, calling `step()` between batches, until `stop`."""
    epoch = 0
    while not stop.is_set():
        ds.set_epoch(epoch)
        for _ in ds.batches(batch_size):
            step()
            if stop.is_set():
                return
        epoch += 1
