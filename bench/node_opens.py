"""The cost of opening a dataset through the sidecar, alone and K ranks at once.

    python -m bench.node_opens [--ks 1,8,16] [--rounds 5] [--shards 48]

A rank's open (`shardcache.open()` and its first batch: the manifest, the reader's
registration and plan, the first acquire) is paid once per process, but on a node of
eight or sixteen ranks every rank opens at the same instant, on the sidecar's one event
loop. This starts K rank processes (imports done), tells them to open at one instant,
read their first batch and close, `--rounds` times, against one sidecar whose memory
tier holds every shard (file:// source, warm: no fetch is timed), and prints, per K:

* the rank's time to its first batch, p50 and max over every rank and round;
* the sidecar's user + system CPU (all threads, /proc) per open, over the rounds, less
  what it spends idle (its timers) over the same time;
* the rank's own CPU per open (`time.process_time`, all its threads: its plan, the
  manifest, taking over its first shards, its first batch), p50.

The sidecar CPU is meaningful on two cores too; the times to open are only where the
ranks have a core each.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from shardcache_sidecar import launcher

from bench import node_dataset, node_probes, node_profile
from shardcache import contract

#: Seconds between the order and the instant the ranks open: they are all waiting.
LEAD_S = 0.3
#: Seconds for the ranks' background notes and unregistrations to reach the sidecar.
SETTLE_S = 0.2


def rank(rank_index: int, world_size: int, block_size: int) -> int:
    """A rank process: `{"go": T0}` on stdin, open at T0, answer the seconds taken."""
    import shardcache

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        order = json.loads(line)
        if order.get("stop"):
            break
        while (wait := order["go"] - time.monotonic()) > 0:
            time.sleep(wait)
        cpu = time.process_time()
        ds = shardcache.open(
            rank=rank_index, world_size=world_size, seed=0, shuffle=True, block_size=block_size
        )
        next(iter(ds.batches(256)))
        took = time.monotonic() - order["go"]
        # The rank's own CPU for it (all its threads): its plan, the manifest, pinning.
        cpu = time.process_time() - cpu
        ds.close()
        print(json.dumps({"open_s": took, "cpu_s": cpu}), flush=True)
    return 0


def idle_cpu(sidecar_pid: int, seconds: float = 3.0) -> float:
    """The sidecar's CPU seconds per second with nothing asked of it (its timers), once
    what it does after start (the startup plan's readahead) has settled."""
    time.sleep(2.0)
    before, start = node_probes.cpu_seconds(sidecar_pid), time.monotonic()
    time.sleep(seconds)
    return (node_probes.cpu_seconds(sidecar_pid) - before) / (time.monotonic() - start)


def burst(
    sidecar_pid: int, procs: list[subprocess.Popen[str]], rounds: int, idle: float
) -> dict[str, Any]:
    """Open `rounds` times on every rank at once; the sidecar's CPU beyond `idle`."""
    opens: list[float] = []
    rank_cpu: list[float] = []
    cpu = 0.0
    for _ in range(rounds):
        before, start = node_probes.cpu_seconds(sidecar_pid), time.monotonic()
        go = time.monotonic() + LEAD_S
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(json.dumps({"go": go}) + "\n")
            p.stdin.flush()
        for p in procs:
            assert p.stdout is not None
            answer = json.loads(p.stdout.readline())
            opens.append(answer["open_s"])
            rank_cpu.append(answer.get("cpu_s", float("nan")))
        time.sleep(SETTLE_S)
        cpu += node_probes.cpu_seconds(sidecar_pid) - before
        cpu -= idle * (time.monotonic() - start)
    opens.sort()
    return {
        "opens": len(opens),
        "open_p50_ms": statistics.median(opens) * 1e3,
        "open_max_ms": opens[-1] * 1e3,
        "cpu_ms_per_open": cpu / len(opens) * 1e3,
        "rank_cpu_ms_p50": statistics.median(rank_cpu) * 1e3,
    }


def ranks(k: int, block_size: int, env: dict[str, str]) -> list[subprocess.Popen[str]]:
    """K rank processes, each answered `{"ready": true}` (imports done)."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "bench.node_opens", "--rank", str(r), str(k), str(block_size)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(k)
    ]
    for proc in procs:
        assert proc.stdout is not None
        json.loads(proc.stdout.readline())
    return procs


def stop(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        if proc.stdin is not None and not proc.stdin.closed:
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.write(json.dumps({"stop": True}) + "\n")
                proc.stdin.close()
    for proc in procs:
        proc.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ks", default="1,8,16", help="ranks opening at once (default 1,8,16)")
    p.add_argument("--rounds", type=int, default=5, help="opens per rank and K (default 5)")
    p.add_argument("--shards", type=int, default=48)
    p.add_argument("--rows", type=int, default=8192, help="rows per shard (default 8192)")
    p.add_argument(
        "--block-size",
        type=int,
        default=196,
        help="rows per shuffle block (default 196: 42 blocks a shard, the plan's shape "
        "in bench/node_device.sh's 48 shards of 172,032 rows at 4,096)",
    )
    p.add_argument("--profile", type=Path, help="py-spy the sidecar into this file")
    p.add_argument("--rank", nargs=3, type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank:
        return rank(*args.rank)
    shm = Path("/dev/shm")
    work = Path(tempfile.mkdtemp(prefix="scno-", dir=shm if shm.is_dir() else None))
    try:
        run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.profile:
        print(node_profile.summary(args.profile))
    return 0


def run(args: argparse.Namespace, work: Path) -> None:
    root = f"file://{work / 'source'}"
    node_dataset.generate(root, {}, args.shards, args.rows, threads=node_probes.usable_cores())
    sidecar_env = {
        # The startup plan warms every shard: the opens find them all resident.
        contract.ENV_READY_SHARDS: str(args.shards),
        contract.ENV_BLOCK_SIZE: str(args.block_size),
        "SHARDCACHE_LOG_LEVEL": "WARNING",
    }
    with launcher.sidecar(root, {}, work, extra_env=sidecar_env) as (trainer_env, _):
        pid = node_probes.find_child("shardcache sidecar")
        env = {**os.environ, **trainer_env}
        idle = idle_cpu(pid)
        print(f"sidecar CPU while idle: {idle * 1e3:.2f} ms/s (subtracted below)")
        print(
            f"{'K':>3} {'opens':>6} {'open p50 ms':>12} {'open max ms':>12} "
            f"{'sidecar CPU ms/open':>20} {'rank CPU ms/open p50':>21}"
        )
        for k in [int(x) for x in args.ks.split(",")]:
            procs = ranks(k, args.block_size, env)
            try:
                with (
                    node_profile.sampling(pid, args.profile)
                    if args.profile
                    else contextlib.nullcontext()
                ):
                    out = burst(pid, procs, args.rounds, idle)
            finally:
                stop(procs)
            print(
                f"{k:3d} {out['opens']:6d} {out['open_p50_ms']:12.1f} "
                f"{out['open_max_ms']:12.1f} {out['cpu_ms_per_open']:20.2f} "
                f"{out['rank_cpu_ms_p50']:21.2f}",
                flush=True,
            )


if __name__ == "__main__":
    sys.exit(main())
