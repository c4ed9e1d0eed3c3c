"""The data-stall signal, measured where the training loop meets its batches.

A `StallMeter` wraps the iterator a training loop pulls batches from and splits the
loop's wall time in two: time spent inside `next()` (waiting for data) and time between
batches (the step). The stall fraction is the first over both: 0 when data is always
ready, near 1 when the step waits on data. Totals are kept for export (a counter of
seconds), and a recent fraction (exponentially weighted by batch) for alerts that
should clear when a job recovers.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


@dataclasses.dataclass
class StallMeter:
    """Waiting vs. stepping time of one rank's training loop."""

    #: Weight of the newest batch in `recent_fraction` (about the last 1/alpha batches).
    alpha: float = 0.05
    #: Seconds spent inside the iterator, waiting for a batch.
    wait_seconds: float = 0.0
    #: Seconds between batches, outside the iterator (the training step).
    step_seconds: float = 0.0
    batches: int = 0
    recent_fraction: float = 0.0

    @property
    def fraction(self) -> float:
        """Waiting over all the loop's time since the meter started."""
        total = self.wait_seconds + self.step_seconds
        return self.wait_seconds / total if total > 0 else 0.0

    def record(self, wait: float, step: float) -> None:
        """One batch: `wait` seconds inside the iterator after `step` seconds outside."""
        self.wait_seconds += wait
        self.step_seconds += step
        self.batches += 1
        total = wait + step
        if total > 0:
            share = wait / total
            self.recent_fraction += self.alpha * (share - self.recent_fraction)

    def snapshot(self) -> dict[str, Any]:
        """A JSON dict of the totals and fractions."""
        return {
            "wait_seconds": self.wait_seconds,
            "step_seconds": self.step_seconds,
            "batches": self.batches,
            "stall_fraction": self.fraction,
            "recent_stall_fraction": self.recent_fraction,
        }

    def wrap(self, iterable: Iterable[T]) -> Iterator[T]:
        """`iterable`'s items, timing every wait for one and every step between two."""
        it = iter(iterable)
        handed: float | None = None
        while True:
            start = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                return
            end = time.perf_counter()
            self.record(end - start, 0.0 if handed is None else start - handed)
            handed = end
            yield item
