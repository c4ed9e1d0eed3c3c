"""Where a slow control request's time went, and when the event loop stalled.

Why: with eight ranks on one sidecar the control path's p99 was tens of milliseconds
while its p50 was under one (issue 14; docs/benchmarks.md, "The control path's tail"),
and a client-side latency cannot say whether a request queued behind other callbacks
on the loop, ran long in its route, waited for a thread, or sat through a collection.
The sidecar says it itself, as DEBUG lines of the `shardcache_sidecar.slow` logger (in
JSON logs, one object a line; `bench.node_slow` reads them back):

- `SLOW_REQUEST` per control request on the lean socket protocol that took longer than
  `SLOW_REQUEST_S` from its last byte parsed to its answer written: `queued_ms` (parsed
  until its route started: nothing but the clock reads, its first step runs at once,
  `eager`), `route_ms`
  (the route, awaits included), of which `cpu_ms` (the loop thread's CPU meanwhile: the
  route's own, plus other callbacks run while it awaited) and `gc_ms` (collector
  pauses meanwhile), and `waited` (whether the answer was written after the loop read
  the request, not inside that callback: the route awaited a thread or another
  request's fetch);
- `LOOP_STALL` when the loop ran a watchdog callback `STALL_S` or more later than due
  (`Watchdog`, every `WATCH_INTERVAL_S`): time no request could be read, whatever held
  the loop (a long callback, a collection, a thread holding the GIL), with the
  collector's pauses in that span;
  and `held_by`: where the loop thread was when a sampling thread looked during the
  stall (`Sampler`: every `SAMPLE_S`, only while the loop is overdue; a collection
  shows as nothing, the sampler cannot run while it holds the GIL);
- `GC_PAUSE` per collection of `GC_PAUSE_S` or longer, with its generation.

`at` fields are `time.monotonic()` (machine-wide on Linux), so a benchmark can put them
in its own windows. All of it is off unless the logger is at DEBUG when the server starts
(one attribute test per request); on, it costs two clock reads and a thread-time read a
request, a callback every 5 ms on the loop, a thread waking about as often (every 2 ms
while the loop is overdue), and a callback per collection.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import threading
import time
import traceback
import types
from pathlib import Path
from typing import Any

log = logging.getLogger("shardcache_sidecar.slow")

SLOW_REQUEST = "slow control request"
LOOP_STALL = "event loop stalled"
GC_PAUSE = "gc pause"

#: A request slower than this is logged: twice the p50 of a warm acquire at K=8 on the
#: 16-core machine, and half the issue's 2 ms p99 target.
SLOW_REQUEST_S = 0.001
#: The watchdog's period: short enough to catch the stalls that make a 2 ms p99. Not
#: free: each wake-up of a loop that would sleep costs about 0.2 ms of CPU on the 2-core
#: machine, and with the sampler the account was half of a warm pass's sidecar CPU
#: (docs/benchmarks.md, "Issue 14 on 2 cores, session 7"): on only when asked for.
WATCH_INTERVAL_S = 0.005
#: A watchdog callback this late is a stall worth logging (the p99 target).
STALL_S = 0.002
#: A collection at least this long is logged (a young collection takes microseconds).
GC_PAUSE_S = 0.001
#: How often the sampling thread samples the loop while it is overdue.
SAMPLE_S = 0.002
#: Frames of the loop thread's stack kept per sample, innermost last.
SAMPLE_FRAMES = 6


def enabled() -> bool:
    return log.isEnabledFor(logging.DEBUG)


class GcPauses:
    """Sums the collector's pauses (`gc.callbacks`), and logs the long ones."""

    def __init__(self) -> None:
        self.total = 0.0
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._started = now
            return
        took = now - self._started
        self.total += took
        if took >= GC_PAUSE_S:
            log.debug(
                GC_PAUSE,
                extra={
                    "at": time.monotonic(),
                    "ms": round(took * 1e3, 3),
                    "generation": info.get("generation"),
                    "collected": info.get("collected"),
                },
            )


#: Innermost frames of a thread that is waiting, not running Python.
_WAITING = ("wait (", "select (", "sleep (", "_worker (", "get (")


def _where(frame: types.FrameType, limit: int) -> str:
    """A thread's innermost `limit` frames, innermost first."""
    stack = traceback.extract_stack(frame, limit=limit)
    return " < ".join(f"{f.name} ({Path(f.filename).name}:{f.lineno})" for f in reversed(stack))


class Sampler:
    """A thread that, while the loop's next watchdog tick is overdue by `STALL_S`,
    notes where the loop thread is (`sys._current_frames`), every `SAMPLE_S`."""

    def __init__(self) -> None:
        self.due = float("inf")  # perf_counter of the watchdog's next tick
        self.samples: list[str] = []
        self._loop_thread = threading.get_ident()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shardcache-stalls", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        pause = SAMPLE_S
        while not self._stop.wait(pause):
            # Asleep until the loop's tick is overdue: a thread that wakes takes the
            # GIL, and a busy loop hands it over at its next switch interval.
            remaining = self.due + STALL_S - time.perf_counter()
            if remaining > 0:
                pause = min(remaining, WATCH_INTERVAL_S + STALL_S)
                continue
            pause = SAMPLE_S
            frames = sys._current_frames()
            frame = frames.pop(self._loop_thread, None)
            frames.pop(threading.get_ident(), None)
            if frame is None or len(self.samples) >= 8:  # a long stall: 8 samples say enough
                continue
            sample = _where(frame, SAMPLE_FRAMES)
            if frame.f_code.co_name == "select":
                # Ready to run (its timer was due) but not running: waiting for a core or
                # for the GIL. What the other threads were doing says who may hold it.
                busy = sorted(
                    where
                    for other in frames.values()
                    if not (where := _where(other, 1)).startswith(_WAITING)
                )
                sample += " | others: " + (", ".join(busy) or "all waiting")
            self.samples.append(sample)

    def take(self) -> list[str]:
        samples, self.samples = self.samples, []
        return samples

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class Watchdog:
    """A callback every `WATCH_INTERVAL_S` on the loop; one that runs `STALL_S` late
    says the loop was held that long."""

    def __init__(self, loop: asyncio.AbstractEventLoop, pauses: GcPauses, sampler: Sampler) -> None:
        self._loop = loop
        self._pauses = pauses
        self._sampler = sampler
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0
        self._gc = 0.0
        self._arm()

    def _arm(self) -> None:
        self._due = time.perf_counter() + WATCH_INTERVAL_S
        self._sampler.due = self._due
        self._gc = self._pauses.total
        self._handle = self._loop.call_later(WATCH_INTERVAL_S, self._tick)

    def _tick(self) -> None:
        late = time.perf_counter() - self._due
        samples = self._sampler.take()
        if late >= STALL_S:
            log.debug(
                LOOP_STALL,
                extra={
                    "at": time.monotonic(),
                    "late_ms": round(late * 1e3, 3),
                    "gc_ms": round((self._pauses.total - self._gc) * 1e3, 3),
                    "held_by": samples,
                },
            )
        self._arm()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class Timer:
    """What the control socket's connections report their requests to."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.pauses = GcPauses()
        self.sampler = Sampler()
        self.watchdog = Watchdog(loop, self.pauses, self.sampler)

    def close(self) -> None:
        self.watchdog.close()
        self.sampler.close()
        self.pauses.close()


class Request:
    """One request's clocks, from its last byte parsed (`Timer` on)."""

    __slots__ = ("_timer", "cpu", "gc", "parsed", "started", "waited")

    def __init__(self, timer: Timer) -> None:
        self._timer = timer
        self.parsed = time.perf_counter()
        self.started = self.parsed
        self.cpu = 0.0
        self.gc = timer.pauses.total
        self.waited = False

    def start(self) -> None:
        """The route starts (in the request's task)."""
        self.started = time.perf_counter()
        self.cpu = time.thread_time()

    def done(self, route: str, status: int) -> None:
        """The answer is written: log the request if it was slow."""
        now = time.perf_counter()
        took = now - self.parsed
        if took < SLOW_REQUEST_S:
            return
        log.debug(
            SLOW_REQUEST,
            extra={
                "at": time.monotonic() - took,
                "route": route,
                "status": status,
                "ms": round(took * 1e3, 3),
                "queued_ms": round((self.started - self.parsed) * 1e3, 3),
                "route_ms": round((now - self.started) * 1e3, 3),
                "cpu_ms": round((time.thread_time() - self.cpu) * 1e3, 3),
                "gc_ms": round((self._timer.pauses.total - self.gc) * 1e3, 3),
                "waited": self.waited,
            },
        )
