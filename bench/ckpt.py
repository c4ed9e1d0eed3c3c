"""`make bench-ckpt`: what a checkpoint costs the trainer, and how fast it goes up.

One checkpoint of >= 1 GiB over files of mixed sizes (a large model file, optimizer
shards, small metadata files), on this machine against a local MinIO:

* stall:  how long `shardcache.checkpoint.commit()` blocks the trainer;
* sync:   how long a synchronous upload of the same bytes would block it instead (a raw
          parallel PUT through the same client library, pyarrow's S3 filesystem);
* upload: the agent's throughput, from `commit()` returning to the checkpoint being
          published (sha256 of every file, size checks, manifest, pointer, and the
          agent's pick-up delay all included; retention runs after), against
* raw:    the raw parallel PUT of the same bytes with the same concurrency.

The agent runs as its own process (`python -m shardcache_sidecar.checkpoint`), as it
does inside the sidecar. After one warm-up round of each (not counted), raw and agent
rounds alternate; every timed round starts after `sync` and after the agent's
retention (which deletes the previous round) has finished. The median round of each
is reported (robust against other work on a shared machine), the best one too.
Throughputs are in gigabits per second. This is a benchmark, not a test: it prints
what it measured. Targets: ratio >= 0.9 and stall_ms <= 2% of sync_ms.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.fs as pafs

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from shardcache_sidecar.checkpoint import agent, agent_config  # noqa: E402

from bench import tree  # noqa: E402
from shardcache import (  # noqa: E402
    checkpoint,
    contract,
    source,
)
from shardcache.checkpoint import _protocol  # noqa: E402
from tests.support import s3server  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
CHUNK = 16 * MiB
# (count, size): a model file, optimizer shards, smaller tensors, metadata.
MIX = [(1, 512 * MiB), (2, 160 * MiB), (2, 64 * MiB), (4, 16 * MiB), (8, 2 * MiB), (24, 64 << 10)]


def make_files(directory: Path) -> int:
    """Write the checkpoint's files (incompressible bytes); their total size."""
    directory.mkdir(parents=True)
    block = os.urandom(CHUNK)
    total = 0
    for kind, (count, size) in enumerate(MIX):
        for i in range(count):
            sub = directory / ("optim" if kind in (1, 2) else "model")
            sub.mkdir(exist_ok=True)
            with open(sub / f"part-{kind}-{i}.bin", "wb") as out:
                left = size
                while left:
                    n = min(left, CHUNK)
                    # Vary each chunk so no two parts of any file are the same bytes.
                    out.write(n.to_bytes(8, "little") + os.urandom(8) + block[16:n])
                    left -= n
            total += size
    return total


def clone(src: Path, dest: Path) -> None:
    """A new checkpoint directory with the same bytes (hard links: no copy, same cache)."""
    shutil.copytree(src, dest, copy_function=os.link)


def raw_put(fs: pafs.FileSystem, src: Path, prefix: str, concurrency: int) -> float:
    files = sorted((p for p in src.rglob("*") if p.is_file()), key=lambda p: -p.stat().st_size)

    def put(path: Path) -> None:
        with (
            open(path, "rb") as f,
            fs.open_output_stream(f"{prefix}/{path.relative_to(src)}") as out,
        ):
            while chunk := f.read(CHUNK):
                out.write(chunk)

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(put, files))
    return time.perf_counter() - started


def settle(root: Path, step: int) -> None:
    """Wait for the agent's retention (it deletes the previous round after publishing),
    so its deletes do not run during the next raw round."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        latest = _protocol.read_root_file(root, _protocol.LATEST_NAME) or {}
        if latest.get("steps") == [step]:
            return
        time.sleep(0.05)
    raise SystemExit(f"the agent's retention did not finish after step {step}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minio", type=Path, default=None, help="MinIO binary")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="shardcache-bench-ckpt-", dir=args.workdir))
    server = s3server.S3Server(args.minio or s3server.minio_binary(), work / "minio")
    agent_process: subprocess.Popen[str] | None = None
    try:
        server.start()
        bucket = server.make_bucket("bench")
        env = server.env()
        uri = f"s3://{bucket}/ckpt"
        fs, _ = source.filesystem(uri, storage_options=env)
        src = work / "source"
        total = make_files(src / "files")
        assert total >= GiB, "the checkpoint must be at least 1 GiB"
        files = sum(count for count, _ in MIX)
        print(f"checkpoint: {total / GiB:.2f} GiB in {files} files; concurrency {args.concurrency}")

        root = work / "volume"
        root.mkdir()
        agent_env = {
            **os.environ,
            **env,
            "PYTHONPATH": tree.python_path(),
            contract.ENV_CHECKPOINT_URI: uri,
            contract.ENV_CHECKPOINT_DIR: str(root),
            contract.ENV_CHECKPOINT_KEEP_LAST: "1",
            contract.ENV_CHECKPOINT_CONCURRENCY: str(args.concurrency),
        }
        agent_process = subprocess.Popen(
            [sys.executable, "-m", "shardcache_sidecar.checkpoint"],
            env=agent_env,
            stdout=subprocess.PIPE,
            stderr=open(work / "agent.log", "w"),  # noqa: SIM115 - lives as long as the agent
            text=True,
        )
        assert agent_process.stdout is not None
        if agent_process.stdout.readline().strip() != "ready":
            raise SystemExit(f"the agent did not start:\n{(work / 'agent.log').read_text()}")

        raw_s: list[float] = []
        upload_s: list[float] = []
        stall_s: list[float] = []
        for r in range(args.warmup + args.rounds):
            prefix = f"{bucket}/raw-{r}"
            # Each timed round starts with no dirty pages: the kernel's writeback of
            # the round before (1 GiB through MinIO) must not land in this one.
            os.sync()
            raw_s.append(raw_put(fs, src / "files", prefix, args.concurrency))
            fs.delete_dir(prefix)

            step = r + 1
            path = root / f"step-{step}"
            clone(src / "files", path)
            os.sync()
            started = time.perf_counter()
            checkpoint.commit(path, step=step, data_state={"position": step})
            committed = time.perf_counter()
            checkpoint.wait(step, timeout=600, root=root)
            upload_s.append(time.perf_counter() - committed)
            stall_s.append(committed - started)
            settle(root, step)
            if r < args.warmup:
                # Not counted: first connections, thread pools and allocator warm-up
                # of both processes; the agent runs for the whole life of a pod.
                print(f"warm-up round: raw PUT {raw_s.pop():.2f}s, agent {upload_s.pop():.2f}s")
                stall_s.pop()
                continue
            print(
                f"round {r + 1 - args.warmup}: raw PUT {raw_s[-1]:.2f}s, agent upload {upload_s[-1]:.2f}s, "
                f"commit stall {stall_s[-1] * 1000:.2f}ms",
                flush=True,
            )

        gbit = total * 8 / 1e9
        # For the record (not a target): a new node restoring the last checkpoint.
        restore_root = work / "other-node"
        restorer = agent.Agent(
            agent_config.CheckpointSettings(directory=restore_root, uri=uri),
            storage_options=env,
        )
        started = time.perf_counter()
        restored = restorer.restore()
        took = time.perf_counter() - started
        print(
            f"restore of step {restored.step} on a new node: {took:.2f}s "
            f"({gbit / took:.2f} Gbit/s, every byte verified)"
        )
        print(
            f"best rounds: upload {gbit / min(upload_s):.2f} Gbit/s, raw {gbit / min(raw_s):.2f} "
            f"Gbit/s, ratio {min(raw_s) / min(upload_s):.3f}"
        )
        raw_mid, upload_mid = statistics.median(raw_s), statistics.median(upload_s)
        upload_gbps, raw_gbps = gbit / upload_mid, gbit / raw_mid
        stall_ms = statistics.median(stall_s) * 1000
        sync_ms = raw_mid * 1000
        print(
            f"RESULT upload_gbps={upload_gbps:.2f} raw_gbps={raw_gbps:.2f} "
            f"ratio={upload_gbps / raw_gbps:.3f} stall_ms={stall_ms:.2f} sync_ms={sync_ms:.0f}"
        )
        return 0
    finally:
        if agent_process is not None:
            agent_process.terminate()
            agent_process.wait(60)
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
