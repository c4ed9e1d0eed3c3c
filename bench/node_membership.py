"""What a memory-tier membership question costs the event loop while another thread
wants the GIL: stat-based (`Tier.contains` asking the files) against a sole writer's
set (`Tier(sole_writer=True)`, `shardcache.node.tiers._membership`).

    python -m bench.node_membership [--keys 48] [--rounds 200] [--switch-interval S]

A thread runs pure Python (as a fetch thread's bookkeeping or the thread pool's plan
does), and the main thread, standing in for the sidecar's loop, asks whether each of
`--keys` committed entries is resident, `--rounds` times, as a warm epoch start asks for
a reader's shards. Each `stat` lets go of the GIL; taking it back from a busy thread
waits for that thread's switch interval (5 ms by default; the sidecar sets 0.5 ms,
`shardcache_sidecar.cli.SWITCH_INTERVAL_S`: `--switch-interval` compares). Prints the
wall time per round: median, p99 and max, for each kind, alternating rounds.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench import node_report
from shardcache.node import tiers


def _busy(stop: threading.Event) -> None:
    n = 0
    while not stop.is_set():
        for i in range(1000):
            n += i * i


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", type=int, default=48)
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        help="sys.setswitchinterval for the run, seconds (default: the interpreter's)",
    )
    args = p.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    work = Path(
        tempfile.mkdtemp(prefix="scmem-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    )
    try:
        keys = [f"k{i:04d}" for i in range(args.keys)]
        files = tiers.Tier(work, limit_bytes=1 << 30, name="memory", fsync=False, verify="never")
        for key in keys:
            files.insert(key, 8, lambda path: path.write_bytes(b"x" * 8)).release()
        sole = tiers.Tier(
            work, limit_bytes=1 << 30, name="memory", fsync=False, verify="never", sole_writer=True
        )
        kinds = {"stat per key": files, "sole writer's set": sole}
        times: dict[str, list[float]] = {name: [] for name in kinds}
        stop = threading.Event()
        thread = threading.Thread(target=_busy, args=(stop,), daemon=True)
        thread.start()
        try:
            for _ in range(args.rounds):
                for name, tier in kinds.items():
                    start = time.perf_counter()
                    assert all(tier.contains(key) for key in keys)
                    times[name].append(time.perf_counter() - start)
        finally:
            stop.set()
            thread.join()
        print(
            f"{args.keys} keys per round, {args.rounds} rounds, one busy thread beside, "
            f"switch interval {sys.getswitchinterval() * 1e3:g} ms"
        )
        print(f"{'membership':20} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
        for name, took in times.items():
            p99 = node_report.percentile(took, 99)
            print(
                f"{name:20} {statistics.median(took) * 1e3:8.3f} {p99 * 1e3:8.3f} "
                f"{max(took) * 1e3:8.3f}"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
