"""`shardcache demo`: the data path end to end on one machine, no cluster.

Generates a small tokenized-text dataset into a local S3-compatible server (MinIO, when
a binary is given; a `file://` directory otherwise), starts the sidecar as its own
process, runs a trainer loop through it for two epochs (cold, then warm), and prints
throughput and the sidecar's cache statistics.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pyarrow.compute as pc

from shardcache import errors
from shardcache.contract import parsers
from shardcache_sidecar import launcher

_READY_TIMEOUT_S = 60.0
_AT_LEAST_ONE = parsers.integer(minimum=1).flag_type
_MOUNT = "demo"
#: Where a pod keeps its memory tier: tmpfs.
_SHM = Path("/dev/shm")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("demo", help="run the data path end to end on this machine")
    parser.add_argument("--shards", type=_AT_LEAST_ONE, default=16, help="shards to generate (16)")
    parser.add_argument("--rows", type=_AT_LEAST_ONE, default=25_000, help="rows per shard (25000)")
    parser.add_argument("--batch-size", type=_AT_LEAST_ONE, default=1024)
    parser.add_argument("--epochs", type=_AT_LEAST_ONE, default=2)
    parser.add_argument(
        "--minio",
        type=Path,
        default=None,
        help="a MinIO binary to serve the dataset over S3 (default: a file:// directory)",
    )
    parser.add_argument("--workdir", type=Path, default=None, help="keep files here")
    parser.set_defaults(func=run)


class _Bar:
    """A progress line redrawn at most ten times a second (not per batch)."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label = total, label
        self.started = self.drawn = time.monotonic()

    def update(self, done: int) -> None:
        now = time.monotonic()
        if now - self.drawn >= 0.1 or done >= self.total:
            self.drawn = now
            _bar(done, self.total, self.started, self.label)


def _bar(done: int, total: int, started: float, label: str) -> None:
    width = 30
    filled = int(width * done / max(total, 1))
    rate = done / max(time.monotonic() - started, 1e-9)
    sys.stdout.write(
        f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {done:>9,}/{total:,} samples "
        f"{rate / 1e6:6.2f} M samples/s"
    )
    sys.stdout.flush()


def _cache_stats(metrics_url: str) -> dict[str, float]:
    with urllib.request.urlopen(metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    stats: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("shardcache_") and " " in line:
            name, value = line.rsplit(" ", 1)
            with contextlib.suppress(ValueError):
                stats[name] = float(value)
    return stats


def memory_backed_run_dir(shm: Path = _SHM, limit: int = launcher.MEMORY_LIMIT) -> Path | None:
    """A fresh run directory on tmpfs for the memory tier, as the pod's memory-backed
    volume is, where the machine has one with room for the tier twice over; else None
    (the run directory goes under the work directory, on its file system)."""
    try:
        if shutil.disk_usage(shm).free < 2 * limit:
            return None
        return Path(tempfile.mkdtemp(prefix="shardcache-demo-", dir=shm))
    except OSError:
        return None


def _terminated(signum: int, _: object) -> None:
    """SIGTERM (CI cancelling `make demo`, `timeout`) as an exception, so the clean-up
    runs as on Ctrl-C: the sidecar and MinIO stopped, the memory tier on /dev/shm (RAM)
    and the work directory removed. A second SIGTERM must not cut that clean-up short."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def run(args: argparse.Namespace) -> int:
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        return _run(args)
    except errors.InputError as exc:
        print(f"shardcache demo: {exc}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace) -> int:
    import shardcache

    work = args.workdir or Path(tempfile.mkdtemp(prefix="shardcache-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    run_dir = memory_backed_run_dir()
    where = f"{run_dir} (tmpfs, as in a pod)" if run_dir else f"{work / 'run'} (no room on {_SHM})"
    try:
        with launcher.object_store(args.minio, work) as (root, storage_env):
            started = time.monotonic()
            tokens = launcher.generate(root, storage_env, args.shards, args.rows)
            print(
                f"generated {args.shards} shards x {args.rows:,} rows ({tokens:,} tokens) "
                f"at {root} in {time.monotonic() - started:.1f}s",
                flush=True,
            )
            with launcher.sidecar(root, storage_env, work, mount=_MOUNT, run_dir=run_dir) as (
                trainer_env,
                base,
            ):
                print(f"sidecar ready ({trainer_env}); memory tier under {where}", flush=True)
                os.environ.update(trainer_env)
                # One trainer, as the demo's sidecar was started for: not a shell's $RANK.
                with shardcache.open(rank=0, world_size=1) as ds:
                    for epoch in range(args.epochs):
                        ds.set_epoch(epoch)
                        seen = 0
                        checksum = 0
                        bar = _Bar(len(ds), f"epoch {epoch}")
                        t0 = time.monotonic()
                        for batch in ds.batches(args.batch_size):
                            # Touch every token, as a trainer's collate would.
                            checksum += pc.sum(batch.column("tokens").flatten()).as_py() or 0
                            seen += batch.num_rows
                            bar.update(seen)
                        elapsed = time.monotonic() - t0
                        print(
                            f"\nepoch {epoch} ({'cold' if epoch == 0 else 'warm'}): "
                            f"{seen:,} samples in {elapsed:.2f}s = {seen / elapsed / 1e6:.2f} "
                            f"M samples/s, {tokens / elapsed / 1e6:.1f} M tokens/s "
                            f"(checksum {checksum})",
                            flush=True,
                        )
                stats = _cache_stats(f"{base}/metrics")
        _print_stats(stats)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
        if run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)
    return 0


def _print_stats(stats: dict[str, float]) -> None:
    print("\ncache statistics (from the sidecar's /metrics):")
    shown = sorted(n for n in stats if "_created" not in n and "_bucket" not in n)
    width = max((len(n) for n in shown), default=0)
    for name in shown:
        value = stats[name]
        text = f"{value:,.0f}" if value.is_integer() else f"{value:,.3f}"
        print(f"  {name:<{width}} {text:>16}")
