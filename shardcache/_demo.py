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
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from shardcache.node import names

_READY_TIMEOUT_S = 60.0
_MOUNT = "demo"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("demo", help="run the data path end to end on this machine")
    parser.add_argument("--shards", type=int, default=16, help="shards to generate (16)")
    parser.add_argument("--rows", type=int, default=25_000, help="rows per shard (25000)")
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument(
        "--minio", type=Path, default=None, help="a MinIO binary to serve the dataset over S3"
    )
    parser.add_argument("--workdir", type=Path, default=None, help="keep files here")
    parser.set_defaults(func=run)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_http(url: str, what: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        time.sleep(0.1)
    raise SystemExit(f"{what} was not ready at {url} after {_READY_TIMEOUT_S:.0f}s")


@contextlib.contextmanager
def _process(cmd: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def _object_store(minio: Path | None, work: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """(dataset root URI, storage env): MinIO when available, else a local directory."""
    if minio is None or not minio.is_file():
        print("no MinIO binary given: serving the dataset from file://", flush=True)
        yield f"file://{work / 'source'}", {}
        return
    port = _free_port()
    creds = {
        "AWS_ACCESS_KEY_ID": "demo-" + secrets.token_hex(4),
        "AWS_SECRET_ACCESS_KEY": secrets.token_urlsafe(18),
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_REGION": "us-east-1",
    }
    env = {
        **os.environ,
        "MINIO_ROOT_USER": creds["AWS_ACCESS_KEY_ID"],
        "MINIO_ROOT_PASSWORD": creds["AWS_SECRET_ACCESS_KEY"],
        "MINIO_BROWSER": "off",
    }
    cmd = [str(minio), "server", str(work / "minio"), "--address", f"127.0.0.1:{port}", "--quiet"]
    with _process(cmd, env, work / "minio.log") as proc:
        _wait_http(f"http://127.0.0.1:{port}/minio/health/live", "MinIO", proc, work / "minio.log")
        print(f"MinIO serving s3:// on 127.0.0.1:{port}", flush=True)
        yield "s3://demo/tokens", creds


def _generate(root: str, env: dict[str, str], shards: int, rows: int) -> int:
    from shardcache import source

    fs, path = source.filesystem(root, storage_options=env or None)
    if root.startswith("s3://"):
        endpoint = env["AWS_ENDPOINT_URL"].split("://", 1)[1]
        admin = pafs.S3FileSystem(
            access_key=env["AWS_ACCESS_KEY_ID"],
            secret_key=env["AWS_SECRET_ACCESS_KEY"],
            endpoint_override=endpoint,
            scheme="http",
            region=env["AWS_REGION"],
            allow_bucket_creation=True,
        )
        admin.create_dir(path.split("/")[0])
    fs.create_dir(path, recursive=True)
    total = 0
    # One pool of token ids, sliced per shard: building Python ranges per shard is slow.
    pool = pc.bit_wise_and(pa.array(range(rows * 320), pa.int64()), 32767).cast(pa.int32())
    for i in range(shards):
        uid = pa.array(range(i * rows, (i + 1) * rows), pa.int64())
        lengths = pc.add(pc.bit_wise_and(pc.multiply(uid, 7), 255), 64).cast(pa.int32())
        offsets = pa.concat_arrays([pa.array([0], pa.int32()), pc.cumulative_sum(lengths)])
        count = offsets[-1].as_py()
        tokens = pa.ListArray.from_arrays(offsets, pool.slice(i % 7, count))
        table = pa.table({"uid": uid, "tokens": tokens})
        with fs.open_output_stream(f"{path}/part-{i:05d}.parquet") as out:
            pq.write_table(table, out, compression="zstd")
        total += count
    return total


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


def run(args: argparse.Namespace) -> int:
    import shardcache

    work = args.workdir or Path(tempfile.mkdtemp(prefix="shardcache-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        with _object_store(args.minio, work) as (root, storage_env):
            started = time.monotonic()
            tokens = _generate(root, storage_env, args.shards, args.rows)
            print(
                f"generated {args.shards} shards x {args.rows:,} rows ({tokens:,} tokens) "
                f"at {root} in {time.monotonic() - started:.1f}s",
                flush=True,
            )
            run_dir = work / "run"
            metrics_port = _free_port()
            env = {
                **os.environ,
                **storage_env,
                names.ENV_SOURCE_URI: root,
                names.ENV_RUN_DIR: str(run_dir),
                names.ENV_MOUNT: _MOUNT,
                names.ENV_DISK_DIR: str(work / "disk"),
                names.ENV_MEMORY_LIMIT: str(1 << 30),
                names.ENV_DISK_LIMIT: str(4 << 30),
                names.ENV_METRICS_PORT: str(metrics_port),
                "SHARDCACHE_METRICS_HOST": "127.0.0.1",
                "SHARDCACHE_LOG_FORMAT": "text",
            }
            cmd = [sys.executable, "-m", "shardcache", "sidecar"]
            log = work / "sidecar.log"
            with _process(cmd, env, log) as sidecar:
                base = f"http://127.0.0.1:{metrics_port}"
                _wait_http(f"{base}/readyz", "the sidecar", sidecar, log)
                print(f"sidecar ready (control socket {names.socket_path(run_dir, _MOUNT)})")
                os.environ[names.ENV_RUN_DIR] = str(run_dir)
                os.environ[names.ENV_MOUNT] = _MOUNT
                with shardcache.open() as ds:
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
    return 0


def _print_stats(stats: dict[str, float]) -> None:
    print("\ncache statistics (from the sidecar's /metrics):")
    for name in sorted(stats):
        if "_created" in name or "_bucket" in name:
            continue
        value = stats[name]
        shown = f"{value:,.0f}" if value.is_integer() else f"{value:,.3f}"
        print(f"  {name:<72} {shown:>16}")
