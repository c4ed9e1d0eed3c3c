"""What `make bench-node` prints: a block per K, the summary table and the RESULT line."""

from __future__ import annotations

import collections
import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

from bench.node_ranks import Pass

MiB = 1 << 20


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile, q in 0..100; NaN for no values."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = -(-q * len(ordered) // 100)  # ceil
    return ordered[max(0, min(len(ordered) - 1, int(rank) - 1))]


def fmt(value: float | None, spec: str = ".3f") -> str:
    return "n/a" if value is None or value != value else format(value, spec)


@dataclasses.dataclass
class KResult:
    """K ranks: the raw and sidecar passes (same epochs) and the sidecar's side."""

    k: int
    raw: list[Pass]
    sidecar: list[Pass]
    #: Sidecar CPU seconds and control requests served, summed over its passes.
    cpu_s: float
    requests: float
    memory_tier_bytes: int
    sidecar_pss: int
    #: Of `cpu_s`, the sidecar's main thread (its event loop: every control request);
    #: the rest is its other threads (thread pool, fetch threads).
    loop_cpu_s: float = 0.0
    #: What the sidecar logged of its own slow requests and loop stalls over these
    #: passes (`bench.node_slow.report`), if anything.
    slow: str = ""
    #: Shards of the dataset times the sidecar passes: what the CPU was spent serving.
    #: Per shard is the figure to compare across protocol changes that fold several
    #: requests into one (notes, grants ahead), which raise the CPU per request.
    shard_epochs: int = 0

    def ratio(self) -> float:
        """Sidecar over raw on each process's first epoch (every shard a round trip)."""
        return self.sidecar[0].gbps() / self.raw[0].gbps()

    def later_ratio(self) -> float | None:
        """Best later epoch over best later epoch, in the same processes."""
        if len(self.sidecar) < 2:
            return None
        return max(p.gbps() for p in self.sidecar[1:]) / max(p.gbps() for p in self.raw[1:])

    def calls(self, route: str | None = None) -> list[float]:
        """Seconds of every control request the ranks made (or of one route's)."""
        return [
            seconds
            for p in self.sidecar
            for r in p.ranks
            for name, seconds, _ in r["calls"]
            if route is None or name == route
        ]

    def cpu_ms_per_request(self) -> float | None:
        return self.cpu_s / self.requests * 1e3 if self.requests else None

    def cpu_ms_per_shard(self) -> float | None:
        return self.cpu_s / self.shard_epochs * 1e3 if self.shard_epochs else None

    def figures(self) -> dict[str, Any]:
        return {
            "raw_gbps": self.raw[0].gbps(),
            "sidecar_gbps": self.sidecar[0].gbps(),
            "ratio": self.ratio(),
            "later_ratio": self.later_ratio(),
            "open_ms": [r["first_s"] * 1e3 for r in self.sidecar[0].ranks],
            "p50_control_ms": percentile(self.calls(), 50) * 1e3,
            "p99_control_ms": percentile(self.calls(), 99) * 1e3,
            "cpu_ms_per_request": self.cpu_ms_per_request(),
            "cpu_ms_per_shard": self.cpu_ms_per_shard(),
            "rank_pss_bytes": [r["pss"] for r in self.sidecar[-1].ranks],
            "memory_tier_bytes": self.memory_tier_bytes,
        }


def k_block(r: KResult) -> str:
    first = r.sidecar[0]
    opens = [x["first_s"] * 1e3 for x in first.ranks]
    raw_opens = [x["first_s"] * 1e3 for x in r.raw[0].ranks]
    calls, acquires = r.calls(), r.calls("acquire")
    routes = collections.Counter(
        name for p in r.sidecar for x in p.ranks for name, _, _ in x["calls"]
    )
    # Control calls made on the rank's main thread block its loop; the notifier's do not.
    blocked = [sum(s for _, s, main in x["calls"] if main) / x["end_s"] for x in first.ranks]
    pss = [x["pss"] / MiB for x in r.sidecar[-1].ranks]
    raw_pss = [x["pss"] / MiB for x in r.raw[-1].ranks]
    lines = [
        f"-- K={r.k}",
        f"   first epoch: raw {r.raw[0].gbps():.2f} GB/s, sidecar {first.gbps():.2f} GB/s, "
        f"ratio {r.ratio():.3f}",
    ]
    later = r.later_ratio()
    if later is not None:
        lines.append(
            f"   later epochs (best of {len(r.sidecar) - 1}): raw "
            f"{max(p.gbps() for p in r.raw[1:]):.2f} GB/s, sidecar "
            f"{max(p.gbps() for p in r.sidecar[1:]):.2f} GB/s, ratio {later:.3f}"
        )
    lines += [
        f"   time to open (open + first batch), ms: p50 {statistics.median(opens):.1f}, max "
        f"{max(opens):.1f}, spread {max(opens) - min(opens):.1f} (raw p50 "
        f"{statistics.median(raw_opens):.1f}); per rank: " + " ".join(f"{x:.0f}" for x in opens),
        f"   control requests, client side: {len(calls)}, p50 {percentile(calls, 50) * 1e3:.3f} "
        f"ms, p99 {percentile(calls, 99) * 1e3:.3f} ms; acquire p50 "
        f"{percentile(acquires, 50) * 1e3:.3f} ms, p99 {percentile(acquires, 99) * 1e3:.3f} ms",
        "   requests per rank-epoch by route: "
        + ", ".join(f"{name} {n / len(r.sidecar) / r.k:.1f}" for name, n in routes.most_common()),
        f"   first epoch blocked in control calls: median {statistics.median(blocked):.1%} of a "
        f"rank's pass, max {max(blocked):.1%}",
        f"   sidecar CPU {r.cpu_s:.3f} s for {r.requests:.0f} control requests: "
        f"{fmt(r.cpu_ms_per_request())} ms per request, {fmt(r.cpu_ms_per_shard())} ms per "
        f"shard of an epoch; event-loop thread {r.loop_cpu_s:.3f} s, other threads "
        # The two counts are read a moment apart: a loop that ran meanwhile and threads
        # that did not can leave the difference a few microseconds below zero.
        f"{max(0.0, r.cpu_s - r.loop_cpu_s):.3f} s",
        f"   PSS per rank p50 {statistics.median(pss):.0f} MiB (raw ranks "
        f"{statistics.median(raw_pss):.0f} MiB); sidecar {r.sidecar_pss / MiB:.0f} MiB; "
        f"memory tier {r.memory_tier_bytes / MiB:.0f} MiB",
    ]
    # Calls on the rank's main thread block its read path; the others are the client's
    # notifier (notes), whose time includes waiting for the rank's own GIL.
    every = [(s, main) for p in r.sidecar for x in p.ranks for _, s, main in x["calls"]]
    on_main = [s for s, main in every if main]
    behind = [s for s, main in every if not main]
    lines.append(
        f"   client side, p99 of calls on the read path (rank's main thread) "
        f"{fmt(percentile(on_main, 99) * 1e3, '.3f')} ms ({len(on_main)}), in the background "
        f"(notifier) {fmt(percentile(behind, 99) * 1e3, '.3f')} ms ({len(behind)})"
    )
    slow_calls = [c for p in r.sidecar for x in p.ranks for c in x.get("slow_calls", [])]
    if slow_calls:
        took = sum(seconds for _, seconds, _ in slow_calls)
        rank_gc = sum(gc_s for _, _, gc_s in slow_calls)
        lines.append(
            f"   client side, calls over 1 ms: {len(slow_calls)}, {took * 1e3:.1f} ms in all, "
            f"of which the rank's own collections {rank_gc * 1e3:.1f} ms; on the read path "
            f"{sum(1 for s in on_main if s >= 0.001)}, in the background "
            f"{sum(1 for s in behind if s >= 0.001)}"
        )
    if r.slow:
        lines.append(r.slow)
    return "\n".join(lines)


def summary(ks: Sequence[int], results: Sequence[KResult], max_ranks: int) -> str:
    by_k = {r.k: r for r in results}
    lines = ["K ranks | raw GB/s | sidecar GB/s | ratio | later-epoch ratio | memory tier MiB"]
    for k in ks:
        if k not in by_k:
            lines.append(f"{k:7d} | n/a: more ranks than the {max_ranks} usable cores")
            continue
        r = by_k[k]
        lines.append(
            f"{k:7d} | {r.raw[0].gbps():8.2f} | {r.sidecar[0].gbps():12.2f} | {r.ratio():5.3f} | "
            f"{fmt(r.later_ratio()):>17} | {r.memory_tier_bytes / MiB:.0f}"
        )
    return "\n".join(lines)


def result_line(results: Sequence[KResult], cold_ratio: float) -> str:
    """`RESULT k8_ratio=… k16_ratio=… cpu_ms_per_request=… p99_control_ms=… cold_ratio=…`,
    then `p99_at_k`: the K the p99 is from (8, else the largest K run).

    The CPU per request is over every warm sidecar pass of every K together; so is
    `cpu_ms_per_shard` (per dataset shard and epoch served, all ranks), after the rest."""
    by_k = {r.k: r for r in results}
    requests = sum(r.requests for r in results)
    cpu_ms = sum(r.cpu_s for r in results) / requests * 1e3 if requests else None
    shard_epochs = sum(r.shard_epochs for r in results)
    per_shard = sum(r.cpu_s for r in results) / shard_epochs * 1e3 if shard_epochs else None
    p99_k = 8 if 8 in by_k else max(by_k)
    p99_ms = percentile(by_k[p99_k].calls(), 99) * 1e3

    def ratio(k: int) -> str:
        return f"{by_k[k].ratio():.3f}" if k in by_k else "n/a"

    return (
        f"RESULT k8_ratio={ratio(8)} k16_ratio={ratio(16)} cpu_ms_per_request={fmt(cpu_ms)} "
        f"p99_control_ms={fmt(p99_ms)} cold_ratio={cold_ratio:.3f} p99_at_k={p99_k} "
        f"cpu_ms_per_shard={fmt(per_shard)}"
    )
