"""The training program the node tier runs in the trainer image (not a test module).

It is handed to the pods in a ConfigMap and run with the image's own `python3`, which
has the `shardcache` client library and pyarrow and nothing else. It reads its rank's
share of the DatasetMount through the injected sidecar, exactly as a user's trainer
would (`shardcache.open()` with no URI), and reports what it saw as JSON lines on
stdout, each prefixed with `TRAINER ` (tests/node/jobs.py parses them):

  start       first thing it does: whether the sidecar already answered on its socket,
              which AWS_* variables its own environment holds (names only), its uid,
              the run volume's mount (type, size), and what the checkpoint agent
              restored into the checkpoint volume
  resumed     the data position it continues from and the sample ids the restored
              checkpoint says were read before it (only with TRAINER_RESUME)
  progress    rows read so far, each time another TRAINER_PROGRESS_ROWS were read
  checkpoint  a checkpoint committed with the data state and published by the sidecar
  done        rows read, the sorted sample ids as [start, stop) runs, and checksums of
              the rows' content, so the test compares them with the dataset's totals

Settings (environment):
  JOB_COMPLETION_INDEX   rank (set by the Job controller for Indexed Jobs), else
                         TRAINER_RANK, else 0
  TRAINER_WORLD_SIZE     ranks (default 1); TRAINER_SEED the DatasetMount's seed
  TRAINER_BATCH_SIZE     rows per batch (default 8)
  TRAINER_STEP_SECONDS   pause after each batch, so a test can act mid-epoch
  TRAINER_PROGRESS_ROWS  report progress every this many rows (default 1: every batch)
  TRAINER_CHECKSUMS      0: skip the per-row content checksums (large datasets)
  TRAINER_CHECKPOINT_AT  rows after which to commit one checkpoint (0: never)
  TRAINER_HOLD_SECONDS   after that checkpoint is published, wait this long (a test
                         deletes the pod meanwhile); a resumed run does not hold
  TRAINER_RESUME         "latest": continue from the newest restored checkpoint
  TRAINER_LINGER_SECONDS after `done`, stay up this long (metrics are scraped meanwhile)
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import sys
import time
import zlib
from typing import Any

import shardcache
import shardcache.checkpoint
from shardcache import sidecar_client

PREFIX = "TRAINER "
UIDS_FILE = "uids.json"


def emit(event: str, **fields: Any) -> None:
    print(PREFIX + json.dumps({"event": event, "t": time.time(), **fields}), flush=True)


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name) or default)


def env_float(name: str, default: float) -> float:
    return float(os.environ.get(name) or default)


def sidecar_answers() -> bool:
    """GET /readyz on the control socket: True when the sidecar answered 200."""
    path = sidecar_client.ClientSettings.from_env().socket_path
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5)
            sock.connect(str(path))
            sock.sendall(b"GET /readyz HTTP/1.1\r\nHost: sidecar\r\nConnection: close\r\n\r\n")
            head = sock.recv(64)
    except OSError:
        return False
    return head.startswith(b"HTTP/1.1 200")


def run_volume() -> dict[str, str]:
    """The mount that holds the control socket and the memory tier (the run volume)."""
    directory = str(sidecar_client.ClientSettings.from_env().socket_path.parent)
    best: dict[str, str] = {}
    for line in pathlib.Path("/proc/self/mounts").read_text().splitlines():
        _, point, fstype, options, *_ = line.split()
        inside = directory == point or directory.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best.get("point", "")):
            best = {"point": point, "fstype": fstype, "options": options}
    return best


def runs(uids: list[int]) -> list[list[int]]:
    """Sorted ids as [start, stop) runs: a rank's share compresses to a few of them."""
    out: list[list[int]] = []
    for uid in sorted(uids):
        if out and out[-1][1] == uid:
            out[-1][1] = uid + 1
        else:
            out.append([uid, uid + 1])
    return out


def checkpoint_root() -> pathlib.Path | None:
    value = os.environ.get("SHARDCACHE_CHECKPOINT_DIR")
    return pathlib.Path(value) if value else None


def listing(root: pathlib.Path | None) -> dict[str, Any]:
    if root is None or not root.is_dir():
        return {"dirs": [], "restore": None}
    marker = root / ".shardcache-restore"
    restore = json.loads(marker.read_text()) if marker.is_file() else None
    dirs = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    return {"dirs": dirs, "restore": restore}


def main() -> int:
    rank = env_int("JOB_COMPLETION_INDEX", env_int("TRAINER_RANK", 0))
    world_size = env_int("TRAINER_WORLD_SIZE", 1)
    root = checkpoint_root()
    emit(
        "start",
        rank=rank,
        uid=os.getuid(),
        sidecar_answering=sidecar_answers(),
        run_volume=run_volume(),
        aws_env=sorted(k for k in os.environ if k.startswith("AWS_")),
        checkpoints=listing(root),
    )
    resume = os.environ.get("TRAINER_RESUME") or None
    ds = shardcache.open(
        rank=rank,
        world_size=world_size,
        seed=env_int("TRAINER_SEED", 0),
        resume_from=resume,
    )
    read_before: list[list[int]] = []
    if resume is not None and ds.position > 0:
        restored = shardcache.checkpoint.restore()
        assert restored is not None, "a data state was restored but no checkpoint directory"
        read_before = json.loads((restored / UIDS_FILE).read_text())["runs"]
        emit("resumed", rank=rank, position=ds.position, directory=restored.name, runs=read_before)
    checkpoint_at = env_int("TRAINER_CHECKPOINT_AT", 0)
    step_seconds = env_float("TRAINER_STEP_SECONDS", 0.0)
    progress_every = env_int("TRAINER_PROGRESS_ROWS", 1)
    checksums = env_int("TRAINER_CHECKSUMS", 1) == 1
    uids: list[int] = []
    text_crc = 0
    token_sum = 0
    for batch in ds.batches(env_int("TRAINER_BATCH_SIZE", 8)):
        uids += batch.column("uid").to_pylist()
        if checksums:
            text_crc += sum(zlib.crc32(t.encode()) for t in batch.column("text").to_pylist())
            token_sum += sum(sum(t) for t in batch.column("tokens").to_pylist())
        if len(uids) // progress_every != (len(uids) - batch.num_rows) // progress_every:
            emit("progress", rank=rank, rows=len(uids), position=ds.position)
        if checkpoint_at and not read_before and len(uids) >= checkpoint_at and root:
            commit_and_hold(ds, root, rank=rank, uids=uids)
            checkpoint_at = 0
        if step_seconds:
            time.sleep(step_seconds)
    emit(
        "done",
        rank=rank,
        rows=len(uids),
        runs=runs(uids),
        uid_sum=sum(uids),
        text_crc=text_crc,
        token_sum=token_sum,
        position=ds.position,
    )
    ds.close()
    time.sleep(env_float("TRAINER_LINGER_SECONDS", 0.0))
    return 0


def commit_and_hold(
    ds: shardcache.Dataset, root: pathlib.Path, *, rank: int, uids: list[int]
) -> None:
    """Commit a checkpoint whose "model" is the ids read so far, wait until the sidecar
    published it, then hold (the test deletes this pod while it holds)."""
    step = ds.position
    directory = root / f"step-{step}"
    directory.mkdir()
    (directory / UIDS_FILE).write_text(json.dumps({"runs": runs(uids)}))
    shardcache.checkpoint.commit(directory, step=step, data_state=ds.state_dict())
    shardcache.checkpoint.wait(step, timeout=120)
    emit("checkpoint", rank=rank, step=step, position=ds.position, runs=runs(uids))
    time.sleep(env_float("TRAINER_HOLD_SECONDS", 0.0))


if __name__ == "__main__":
    sys.exit(main())
