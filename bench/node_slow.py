"""The sidecar's own account of its slow control requests and event-loop stalls over a
benchmark's passes (`shardcache_sidecar.server.service_times`: DEBUG lines of the
`shardcache_sidecar.slow` logger in its JSON log, `at` on the machine-wide monotonic
clock), so that `make bench-node` says where a p99 went: queued on the loop, in the
route (its CPU, a collection), or waiting on a thread.

A client-side outlier with no slow line of its own was slow outside the request's
handling: before the loop read it (a loop stall covers that, with its collector share),
or in the rank (its own GIL, its own collections) or the kernel.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import node_report

LOGGER = "shardcache_sidecar.slow"
SLOW_REQUEST = "slow control request"
LOOP_STALL = "event loop stalled"
GC_PAUSE = "gc pause"
#: Innermost frames of a stall's first sample that name where the loop was.
FRAMES = 3


def read(log: Path) -> list[dict[str, Any]]:
    """The `shardcache_sidecar.slow` lines of a sidecar's JSON log."""
    found = []
    for line in log.read_text(errors="replace").splitlines():
        if not line.startswith("{") or LOGGER not in line:
            continue
        try:
            doc: dict[str, Any] = json.loads(line)
        except ValueError:
            continue
        if doc.get("logger") == LOGGER and "at" in doc:
            found.append(doc)
    return found


def within(
    lines: Sequence[dict[str, Any]], windows: Sequence[tuple[float, float]]
) -> list[dict[str, Any]]:
    """The lines whose `at` falls in one of the (start, end) windows."""
    return [d for d in lines if any(a <= float(d["at"]) <= b for a, b in windows)]


def _ms(values: Sequence[float]) -> str:
    return f"p50 {node_report.percentile(values, 50):.1f}, max {max(values):.1f} ms"


def held_by(stalls: Sequence[dict[str, Any]], top: int = 3) -> list[str]:
    """The loop's stalls grouped by where its thread was first seen during each (its
    innermost `FRAMES` frames), the longest total first: "12.3 ms in 2 stall(s): ...".
    Stalls with no sample (a collection, or too short to be sampled) are "unsampled"."""
    by: dict[str, list[float]] = {}
    others: dict[str, str] = {}
    for d in stalls:
        samples = d.get("held_by") or []
        frames, _, busy = samples[0].partition(" | others: ") if samples else ("", "", "")
        where = " < ".join(frames.split(" < ")[:FRAMES]) if samples else "unsampled"
        by.setdefault(where, []).append(float(d["late_ms"]))
        if busy:
            others.setdefault(where, busy)
    ranked = sorted(by.items(), key=lambda kv: -sum(kv[1]))[:top]
    return [
        f"{sum(v):.1f} ms in {len(v)} stall(s): {where}"
        + (f" (other threads, first seen: {others[where]})" if where in others else "")
        for where, v in ranked
    ]


def report(lines: Sequence[dict[str, Any]]) -> str:
    """Two or three indented lines for `node_report.k_block`: slow requests, loop stalls,
    long collections."""
    slow = [d for d in lines if d.get("msg") == SLOW_REQUEST]
    stalls = [d for d in lines if d.get("msg") == LOOP_STALL]
    pauses = [d for d in lines if d.get("msg") == GC_PAUSE]
    out = []
    if slow:
        total = sum(float(d["ms"]) for d in slow)
        queued = sum(float(d["queued_ms"]) for d in slow)
        cpu = sum(float(d["cpu_ms"]) for d in slow)
        gc = sum(float(d["gc_ms"]) for d in slow)
        waited = sum(1 for d in slow if d.get("waited"))
        worst = max(slow, key=lambda d: float(d["ms"]))
        out.append(
            f"   sidecar side, requests over 1 ms: {len(slow)}, {_ms([float(d['ms']) for d in slow])}; "
            f"of their time queued on the loop {queued / total:.0%}, loop-thread CPU "
            f"{cpu / total:.0%}, gc {gc / total:.0%}; {waited} answered after a wait; the "
            f"slowest: {worst['route']} {float(worst['ms']):.1f} ms (queued "
            f"{float(worst['queued_ms']):.1f}, route {float(worst['route_ms']):.1f}, cpu "
            f"{float(worst['cpu_ms']):.1f}, gc {float(worst['gc_ms']):.1f}"
            f"{', waited' if worst.get('waited') else ''})"
        )
    else:
        out.append("   sidecar side, requests over 1 ms: none")
    if stalls:
        late = [float(d["late_ms"]) for d in stalls]
        out.append(
            f"   event loop held >= 2 ms (a 5 ms watchdog late): {len(stalls)}, {_ms(late)}, "
            f"total {sum(late):.1f} ms, of which gc {sum(float(d['gc_ms']) for d in stalls):.1f} ms"
        )
        out += [f"     {line}" for line in held_by(stalls)]
    else:
        out.append("   event loop held >= 2 ms: never")
    if pauses:
        out.append(
            f"   collections >= 1 ms: {len(pauses)}, {_ms([float(d['ms']) for d in pauses])}, "
            "generations "
            + ",".join(str(g) for g in sorted({int(d.get("generation") or 0) for d in pauses}))
        )
    return "\n".join(out)
