"""Where the fetch slots sat idle in `make bench-node`'s cold epoch.

The sidecar of the cold epoch runs with its timeline logger on (`SHARDCACHE_LOG_LEVEL=
DEBUG`, JSON lines): one line per shard with when it was queued, took a fetch slot, was
fetched, decoded and inserted (`shardcache.node.timelines`), on the machine-wide
monotonic clock this process shares. From them:

- *occupancy*: a slot is busy from the moment a shard takes it (`slot`) until the shard
  is in the memory tier (`inserted`): the fetch, the decode and the write of the
  decoded file, the work the ceiling's threads do per shard. Mean busy slots over the
  cold epoch, and the idle slot-seconds in its three phases: the *start* (from /healthz
  answering until every slot is first busy at once), the *tail* (from the last shard
  taking a slot to the last rank's end) and the *middle* between;
- a strip of the mean busy slots in twenty equal spans of the epoch;
- per stage, the p50 and the largest time a shard spent in it, and how long shards
  waited to be started (queued to slot).

`python -m bench.node_timeline SIDECAR_LOG [--slots N]` prints the same for a kept log.
"""

from __future__ import annotations

import argparse
import calendar
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: `shardcache.node.timelines.MESSAGE` (not imported: the bench reads logs of any tree).
MESSAGE = "shard timeline"
STRIP_SPANS = 20


@dataclasses.dataclass(frozen=True)
class Shard:
    shard: int
    why: str
    thread: str
    outcome: str
    times: dict[str, float]

    @property
    def busy(self) -> tuple[float, float] | None:
        """When it held a slot and its thread: slot taken until inserted (or let go)."""
        start = self.times.get("t_slot")
        end = self.times.get("t_inserted", self.times.get("t_decoded"))
        return None if start is None or end is None else (start, end)


@dataclasses.dataclass(frozen=True)
class Log:
    shards: list[Shard]
    #: The sidecar's fetch concurrency, from its "serving" line; None if not logged.
    slots: int | None
    #: When it logged "serving" (the manifest resolved, the cache node made), on the
    #: wall clock (`time.time()`); None if not logged.
    serving: float | None


def _wall(ts: str) -> float:
    """A log line's "ts" (UTC, milliseconds) as `time.time()`."""
    whole, _, ms = ts.rstrip("Z").partition(".")
    return calendar.timegm(time.strptime(whole, "%Y-%m-%dT%H:%M:%S")) + int(ms or 0) / 1e3


def read(log: Path) -> Log:
    """The timeline lines of a sidecar's JSON log, and what its "serving" line says."""
    shards: list[Shard] = []
    slots = serving = None
    for line in log.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        try:
            doc: dict[str, Any] = json.loads(line)
        except ValueError:
            continue
        if doc.get("msg") == MESSAGE:
            times = {k: float(v) for k, v in doc.items() if k.startswith("t_")}
            shards.append(
                Shard(int(doc["shard"]), doc["why"], doc["worker"], doc["outcome"], times)
            )
        elif "fetch_concurrency" in doc and slots is None:
            slots = int(doc["fetch_concurrency"])
            serving = _wall(doc["ts"])
    return Log(shards, slots, serving)


def busy_between(intervals: Sequence[tuple[float, float]], a: float, b: float) -> float:
    """Slot-seconds busy in [a, b]."""
    return sum(max(0.0, min(end, b) - max(start, a)) for start, end in intervals)


def first_peak(intervals: Sequence[tuple[float, float]]) -> tuple[float, int]:
    """The first instant the most intervals overlap, and how many do then."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    running = peak = 0
    when = events[0][0] if events else 0.0
    for t, step in events:
        running += step
        if running > peak:
            peak, when = running, t
    return when, peak


def _ms(values: list[float]) -> str:
    if not values:
        return "n/a"
    return f"p50 {statistics.median(values) * 1e3:.0f} ms, max {max(values) * 1e3:.0f} ms"


def report(
    shards: list[Shard],
    slots: int,
    t0: float,
    t1: float,
    *,
    go: float | None = None,
    serving: float | None = None,
) -> str:
    """The occupancy report of a cold epoch from `t0` (/healthz answering) to `t1` (the
    last rank's end); `go` is when the ranks were told to start, `serving` when the
    sidecar had its manifest and cache node (both on `t0`'s clock), if known."""
    done = [s for s in shards if s.busy is not None]
    intervals = [s.busy for s in done if s.busy is not None]
    span = t1 - t0
    if not intervals or span <= 0:
        return (
            "cold-epoch timeline: no shard lines (was the sidecar's log level DEBUG, format json?)"
        )
    total = busy_between(intervals, t0, t1)
    peak_at, peak = first_peak(intervals)
    start_end = min(max(peak_at, t0), t1)
    last_slot = max(s for s, _ in intervals)
    tail_start = max(start_end, min(last_slot, t1))
    lines = [
        f"cold-epoch timeline ({len(done)} shards, {slots} fetch slots, {span:.2f} s from "
        f"the start (/healthz answering or the first fetch) to the last rank's end):",
        f"   mean busy slots {total / span:.2f} of {slots} "
        f"({total / (slots * span):.0%} occupancy)",
    ]
    for name, a, b in (
        (f"start (until {peak} slots are first busy, the peak)", t0, start_end),
        ("middle", start_end, tail_start),
        ("tail (after the last shard took a slot)", tail_start, t1),
    ):
        length = max(0.0, b - a)
        idle = slots * length - busy_between(intervals, a, b)
        lines.append(
            f"   {name}: {length:.2f} s, {idle:.2f} idle slot-s"
            + (f" ({idle / (slots * length):.0%} idle)" if length > 0 else "")
        )
    first = min(s for s, _ in intervals)
    lines.append(
        f"   first slot taken {first - t0:.3f} s after the start"
        + (f"; serving (manifest resolved) at {serving - t0:.3f} s" if serving else "")
        + (f"; the ranks were told to go at {go - t0:.3f} s" if go is not None else "")
        + f"; last shard inserted {max(e for _, e in intervals) - t0:.3f} s, "
        f"the last rank ended at {span:.3f} s"
    )
    width = span / STRIP_SPANS
    strip = [
        busy_between(intervals, t0 + i * width, t0 + (i + 1) * width) / width
        for i in range(STRIP_SPANS)
    ]
    lines.append(f"   busy slots per {width * 1e3:.0f} ms: " + " ".join(f"{b:.1f}" for b in strip))

    def stage(since: str, until: str) -> list[float]:
        a, b = f"t_{since}", f"t_{until}"
        return [s.times[b] - s.times[a] for s in done if a in s.times and b in s.times]

    for label, since, until in (
        ("queued -> slot", "queued", "slot"),
        ("fetch (slot -> fetched)", "slot", "fetched"),
        ("fetched -> decode (decode budget)", "fetched", "decode"),
        ("decode", "decode", "decoded"),
        ("insert (decoded -> inserted)", "decoded", "inserted"),
    ):
        lines.append(f"   {label}: {_ms(stage(since, until))}")
    by_why: dict[str, int] = {}
    for s in shards:
        by_why[f"{s.why}/{s.outcome}"] = by_why.get(f"{s.why}/{s.outcome}", 0) + 1
    threads = {s.thread for s in done}
    lines.append(
        "   shards by why/outcome: "
        + ", ".join(f"{k} {v}" for k, v in sorted(by_why.items()))
        + f"; {len(threads)} threads took slots"
    )
    return "\n".join(lines)


def figures(shards: list[Shard], slots: int, t0: float, t1: float) -> dict[str, Any]:
    """The report's numbers for `--json`."""
    intervals = [s.busy for s in shards if s.busy is not None]
    span = t1 - t0
    total = busy_between(intervals, t0, t1)
    return {
        "slots": slots,
        "mean_busy_slots": total / span if span > 0 else None,
        "peak_busy_slots": first_peak(intervals)[1],
        "first_peak_s": first_peak(intervals)[0] - t0,
        "shards": [
            {"shard": s.shard, "why": s.why, "thread": s.thread, "outcome": s.outcome}
            | {k: round(v - t0, 6) for k, v in s.times.items()}
            for s in shards
        ],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("log", type=Path, help="a sidecar log in JSON lines, level DEBUG")
    p.add_argument("--slots", type=int, default=None, help="fetch slots (default: from the log)")
    args = p.parse_args(argv)
    found = read(args.log)
    shards, slots = found.shards, args.slots or found.slots
    if not shards or slots is None:
        raise SystemExit(f"{args.log}: no timeline lines or no fetch concurrency found")
    t0 = min(min(s.times.values()) for s in shards)
    t1 = max(max(s.times.values()) for s in shards)
    print(report(shards, slots, t0, t1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
