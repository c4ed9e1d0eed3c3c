"""A local stand-in for a cluster, for `shardcache demo` and the benchmarks.

A MinIO process (or a `file://` directory), a generated tokenized-text dataset, and a
sidecar process configured the way the webhook configures it in a pod. Nothing here is
used on the data path itself.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from shardcache import errors, source, unix_http
from shardcache.contract import names, protocol, variables
from shardcache_sidecar.listening import free_port

READY_TIMEOUT_S = 120.0
#: The memory tier's limit of a sidecar started here unless the caller gives one.
MEMORY_LIMIT = 1 << 30


def wait_http(
    url: str,
    what: str,
    proc: subprocess.Popen[bytes],
    log: Path,
    *,
    refused: Callable[[], str | None] | None = None,
) -> None:
    """Wait until `url` answers 200. SystemExit when `proc` exits, when `refused()`
    gives a reason (the process said it will never get there), or after
    `READY_TIMEOUT_S`, with the last answer's body (a /readyz says why)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    last = ""
    asked = 0.0
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except urllib.error.HTTPError as exc:
            last = exc.read().decode(errors="replace")[-2000:]
        except OSError:
            pass
        if refused is not None and time.monotonic() - asked >= 1.0:
            asked = time.monotonic()
            reason = refused()
            if reason is not None:
                raise SystemExit(f"{what} refuses to start: {reason}")
        time.sleep(0.1)
    why = f": {last}" if last else ""
    raise SystemExit(f"{what} was not ready at {url} after {READY_TIMEOUT_S:.0f}s{why}")


def refusal(socket_path: Path) -> str | None:
    """Why the sidecar on `socket_path` will not serve its dataset until restarted with
    other settings (its data routes answer an input error: an empty or unusable source,
    refused credentials, another digest), or None: serving, still starting, or not yet
    listening. /readyz alone cannot tell a refusal from a slow start."""
    try:
        status, body = unix_http.exchange(socket_path, "GET", protocol.MANIFEST, None, 2.0)
    except (OSError, http.client.HTTPException):
        return None
    if status < 400:
        return None
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(error, dict) or error.get("kind") != protocol.KIND_INPUT:
        return None
    return str(error.get("message"))


@contextlib.contextmanager
def process(cmd: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
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
def object_store(minio: Path | None, work: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """(dataset root URI, storage env): MinIO when a binary is given, else a local
    directory. A binary given that is not an executable file is refused (InputError):
    serving file:// instead would measure something else without a word."""
    if minio is None:
        print("no MinIO binary given: serving the dataset from file://", flush=True)
        yield f"file://{work / 'source'}", {}
        return
    if not minio.is_file() or not os.access(minio, os.X_OK):
        found = "not an executable file" if minio.exists() else "no such file"
        raise errors.InputError(f"--minio {minio}: expected a MinIO binary, found {found}")
    port = free_port()
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
    with process(cmd, env, work / "minio.log") as proc:
        wait_http(f"http://127.0.0.1:{port}/minio/health/live", "MinIO", proc, work / "minio.log")
        print(f"MinIO serving s3:// on 127.0.0.1:{port}", flush=True)
        yield "s3://demo/tokens", creds


#: The modification time of every shard `generate` writes to a local directory (2024-01-01
#: 00:00 UTC). A file:// shard's store identity is its mtime (`source.content_identity`),
#: which the manifest digest covers, and the reading plan is a function of the digest:
#: with the time of writing, two identical `shardcache demo` runs would read in other
#: orders, and docs/debugging.md's outputs would be nobody's. Object stores give an
#: ETag, a function of the bytes for these single-part uploads.
FIXED_MTIME_NS = 1_704_067_200 * 10**9


def generate(
    root: str, env: dict[str, str], shards: int, rows: int, *, compression: str = "zstd"
) -> int:
    """Write `shards` Parquet shards of `rows` rows (`uid`, `tokens: list<int32>` of
    64 to 319 tokens); return the number of tokens. The same arguments give the same
    dataset digest on every run (`FIXED_MTIME_NS`), with the same pyarrow (its version
    is in the Parquet footer)."""
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
        shard = f"{path}/part-{i:05d}.parquet"
        with fs.open_output_stream(shard) as out:
            pq.write_table(table, out, compression=compression)
        if isinstance(fs, pafs.LocalFileSystem):
            os.utime(shard, ns=(FIXED_MTIME_NS, FIXED_MTIME_NS))
        total += count
    return total


@contextlib.contextmanager
def sidecar(
    root: str,
    storage_env: dict[str, str],
    work: Path,
    *,
    mount: str = "local",
    memory_limit: int = MEMORY_LIMIT,
    disk_limit: int = 4 << 30,
    wait_ready: bool = True,
    extra_env: dict[str, str] | None = None,
    run_dir: Path | None = None,
) -> Iterator[tuple[dict[str, str], str]]:
    """A `shardcache sidecar` process; yields (the trainer's env, the metrics base URL).

    The trainer's env is what the webhook gives trainer containers: the run directory
    and the mount name, from which `shardcache.open()` finds the socket. `run_dir`
    (default `work/run`) holds the socket and the memory tier, as the pod's
    memory-backed volume does.
    """
    run_dir = work / "run" if run_dir is None else run_dir
    port = free_port()
    # What the webhook would write into the sidecar container, for this machine:
    # probes on loopback only, and logs for a person rather than a log pipeline.
    sidecar_env = variables.environ(
        [
            (variables.SOURCE_URI, root),
            (variables.RUN_DIR, run_dir),
            (variables.MOUNT, mount),
            (variables.DISK_DIR, work / "disk"),
            (variables.MEMORY_LIMIT, memory_limit),
            (variables.DISK_LIMIT, disk_limit),
            (variables.METRICS_PORT, port),
            (variables.UI_PORT, free_port()),
            (variables.METRICS_HOST, "127.0.0.1"),
            (variables.LOG_FORMAT, "text"),
        ]
    )
    env = {**os.environ, **storage_env, **sidecar_env, **(extra_env or {})}
    log = work / f"sidecar-{port}.log"
    base = f"http://127.0.0.1:{port}"
    given = (extra_env or {}).get(variables.SOCKET.env)
    control = Path(given) if given else names.socket_path(run_dir, mount)
    with process([sys.executable, "-m", "shardcache", "sidecar"], env, log) as proc:
        wait_http(
            f"{base}/readyz" if wait_ready else f"{base}/healthz",
            "the sidecar",
            proc,
            log,
            refused=lambda: refusal(control),
        )
        # The trainer's env: what the webhook writes into trainer containers.
        yield variables.environ([(variables.RUN_DIR, run_dir), (variables.MOUNT, mount)]), base
