"""The data-stall signal, measured where the training loop meets its batches.

A `StallMeter` wraps the iterator a training loop pulls batches from and splits the
loop's wall time in two: time spent inside `next()` (waiting for data) and time between
batches (the step). The stall fraction is the first over both: 0 when data is always
ready, near 1 when the step waits on data. Totals are kept for export (a counter of
seconds), and a recent fraction (exponentially weighted by batch) for alerts that
should clear when a job recovers.

The meter times the loop, not one iterator: the time from the last batch of one
iteration (an epoch's `batches()`) to the first of the next is that batch's step, and the
time inside a `next()` that ended an iteration counts as its wait. Timed per iterator,
an epoch's first batch had no step before it and counted as a wait and nothing else
(a share of 1 in the recent fraction), so a loop of short epochs read as half stalled
while its data was always ready.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


# eq=False: a meter is one loop's, compared and hashed by identity (the sidecar client
# keeps, per meter, what of it a sidecar counted already).
@dataclasses.dataclass(eq=False)
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
    #: When the last batch was handed over (`time.perf_counter()`), in any iteration.
    _handed: float | None = dataclasses.field(default=None, repr=False)
    #: Waiting and stepping around an iteration's end, owed to the next batch.
    _owed_wait: float = dataclasses.field(default=0.0, repr=False)
    _owed_step: float = dataclasses.field(default=0.0, repr=False)

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

    def handed(self, asked: float, got: float) -> None:
        """A batch asked for at `asked` came at `got` (`time.perf_counter()` times): its
        step runs from the previous batch handed over, in this iteration or an earlier."""
        step = self._owed_step + (0.0 if self._handed is None else asked - self._handed)
        self.record(self._owed_wait + got - asked, step)
        self._owed_wait = self._owed_step = 0.0
        self._handed = got

    def ended(self, asked: float, got: float) -> None:
        """The iteration asked for a batch at `asked` and ended at `got` instead: the
        time is owed to the next batch handed over, whichever iteration hands it."""
        if self._handed is not None:
            self._owed_step += asked - self._handed
            self._handed = got
        self._owed_wait += got - asked

    def snapshot(self) -> dict[str, Any]:
        """A JSON dict of the totals and fractions."""
        return {
            "wait_seconds": self.wait_seconds,
            "step_seconds": self.step_seconds,
            "batches": self.batches,
            "stall_fraction": self.fraction,
            "recent_stall_fraction": self.recent_fraction,
        }

    def wrap(
        self, iterable: Iterable[T], *, on_batch: Callable[[], None] | None = None
    ) -> Iterator[T]:
        """`iterable`'s items, timing every wait for one and every step between two;
        `on_batch()` after each is timed (a reporter's hook). Closing this closes the
        iterator (a generator releases what it holds at once, not when collected)."""
        it = iter(iterable)
        try:
            while True:
                asked = time.perf_counter()
                try:
                    item = next(it)
                except StopIteration:
                    self.ended(asked, time.perf_counter())
                    return
                except BaseException:
                    # A wait that ended in an error (an acquire's timeout) was waited
                    # all the same: owed to the batch a loop that carries on gets next.
                    self.ended(asked, time.perf_counter())
                    raise
                self.handed(asked, time.perf_counter())
                if on_batch is not None:
                    on_batch()
                yield item
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()
