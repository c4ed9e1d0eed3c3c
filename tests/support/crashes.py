"""The crash-matrix harness: run a real process armed to SIGKILL itself at a named fault
point (`shardcache.faultpoints`), restart it unarmed, and check what it left behind.

Two kinds of episode, each a plain function so the fixed matrix (pytest) and the soak
(`make soak`, randomized) share them:

- `checkpoint_episode`: the checkpoint agent (`python -m shardcache_sidecar.checkpoint`)
  publishing, pruning, restoring at start, or answering a trainer's restore request.
  Afterwards: no partial or unverified checkpoint is listed or restored; `latest` names
  the newest complete step once the restarted agent has scanned; no uploaded step is
  lost (the newest keep-last commits are all published); retention never left no
  complete step; a fresh node restores the latest step byte for byte.
- `cache_episode`: the sidecar's node cache fetching, decoding, inserting or evicting.
  Afterwards every row the restarted sidecar serves equals the source, in plan order,
  and every disk-tier entry still matches its checksum.

An episode whose armed process never reached its point fails: a kill that did not
happen is not a kill survived.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
from shardcache_sidecar.checkpoint import restorer

import shardcache
from shardcache import checkpoint, contract, faultpoints, manifests, plans, sidecar_client
from shardcache.checkpoint import _protocol, layout
from shardcache.node import tiers
from tests.support import datasets, waiting
from tests.support.checkpoints import tree, write_checkpoint
from tests.support.s3server import S3Server
from tests.support.sidecar import SidecarProcess

CHECKPOINT_POINTS = sorted(p for p in faultpoints.POINTS if p.startswith("checkpoint."))
CACHE_POINTS = sorted(p for p in faultpoints.POINTS if p.startswith("cache."))
KEEP_LAST = 2
# How many times each point can be reached in one episode (the soak draws n up to this).
CHECKPOINT_REACHES = {
    "checkpoint.upload.file": 9,  # 3 steps x 3 files
    "checkpoint.upload.manifest": 3,
    "checkpoint.latest": 3,
    "checkpoint.status": 3,
    "checkpoint.retention": 1,  # 3 steps, keep 2: one deletion
    "checkpoint.restore.fetch": 3,  # ranges of the restored step's files
    "checkpoint.restore.assemble": 1,
    "checkpoint.answer": 1,
}
CACHE_REACHES = {"cache.fetch": 4, "cache.decode": 4, "cache.insert": 6, "cache.evict": 1}
PROCESS_TIMEOUT_S = 120.0


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One episode: where it killed, and the checks the restarted process passed."""

    point: str
    count: int
    checks: tuple[str, ...]


def checkpoint_files(step: int) -> dict[str, bytes]:
    """Three files per step, one large enough for several ranges and multipart parts."""
    rng = random.Random(step)
    return {
        "model.bin": rng.randbytes(6 << 20),
        "optim/state.bin": rng.randbytes(70_000 + step),
        "meta.json": f'{{"step": {step}}}'.encode(),
    }


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class AgentProcess:
    """`python -m shardcache_sidecar.checkpoint` on one node directory."""

    def __init__(self, s3: S3Server, uri: str, root: Path, **env: str) -> None:
        self.root = root
        self.log_path = root.parent / f"{root.name}-agent.log"
        self.env = {
            **os.environ,
            **s3.env(),
            contract.ENV_CHECKPOINT_URI: uri,
            contract.ENV_CHECKPOINT_DIR: str(root),
            contract.ENV_CHECKPOINT_KEEP_LAST: str(KEEP_LAST),
            **env,
        }
        self.env.pop(faultpoints.ENV_TEST_FAULT, None)
        self.process: subprocess.Popen[bytes] | None = None
        #: Every process started, so an episode that fails leaves none running.
        self.started: list[subprocess.Popen[bytes]] = []
        self._log_mark = 0

    def start(self, fault: str | None = None) -> None:
        env = dict(self.env)
        if fault is not None:
            env[faultpoints.ENV_TEST_FAULT] = fault
        self.root.mkdir(parents=True, exist_ok=True)
        self._log_mark = self.log_path.stat().st_size if self.log_path.exists() else 0
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "shardcache_sidecar.checkpoint"],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.started.append(self.process)

    def cleanup(self) -> None:
        for process in self.started:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=PROCESS_TIMEOUT_S)

    def killed(self) -> bool:
        """Whether it died of its own SIGKILL (None while it runs)."""
        assert self.process is not None
        return self.process.poll() == -signal.SIGKILL

    def wait_killed(self, point: str) -> None:
        waiting.wait_until(
            f"the agent to kill itself at {point}",
            self.killed,
            timeout=PROCESS_TIMEOUT_S,
            describe=self.log_tail,
        )

    def stop(self) -> None:
        """SIGTERM once it said ready (its handler is installed by then); it drains."""
        process = self.process
        if process is None or process.poll() is not None:
            return
        waiting.wait_until(
            "the agent to start (print ready) before it is stopped",
            lambda: "ready" in self.log_since_start() or process.poll() is not None,
            timeout=PROCESS_TIMEOUT_S,
            describe=self.log_tail,
        )
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=PROCESS_TIMEOUT_S)
        assert code == 0, f"agent exited {code}:\n{self.log_tail()}"

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=PROCESS_TIMEOUT_S)

    def log_since_start(self) -> str:
        with self.log_path.open("rb") as log:
            log.seek(self._log_mark)
            return log.read().decode(errors="replace")

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no agent log)"


def commit_steps(root: Path, steps: list[int]) -> None:
    for step in steps:
        path = write_checkpoint(root, f"step-{step}", checkpoint_files(step))
        checkpoint.commit(path, step=step, data_state={"position": step * 10})


def published_everything(agent: AgentProcess, steps: list[int]) -> None:
    for step in steps:
        try:
            checkpoint.wait(step, timeout=PROCESS_TIMEOUT_S, root=agent.root)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\nagent log:\n{agent.log_tail()}") from exc


def published_steps(root: Path) -> list[int]:
    """What the agent told the trainer the store holds (the node's latest file)."""
    steps = (_protocol.read_root_file(root, _protocol.LATEST_NAME) or {}).get("steps")
    return steps if isinstance(steps, list) else []


def newest_published(published: list[int], committed: list[int]) -> bool:
    """The newest keep-last commits are all published (older ones may linger: retention
    runs after a publish, so a kill just before it leaves one more until the next)."""
    return set(sorted(committed)[-KEEP_LAST:]) <= set(published)


def restored(root: Path, step: int) -> bool:
    status = _protocol.read_status(root / f"step-{step}")
    return status is not None and status.phase == "restored"


def check_store(fs: pafs.FileSystem, prefix: str, committed: list[int]) -> list[str]:
    """The store's invariants after the restarted agent settled; the checks made."""
    complete, incomplete = layout.list_steps(fs, prefix)
    assert complete, "retention left no complete step"
    want = sorted(committed)[-KEEP_LAST:]
    assert newest_published(complete, committed), f"published {complete}, lost some of {want}"
    # At most one publish's worth of retention deferred by the kill.
    assert set(complete) <= set(committed) and len(complete) <= KEEP_LAST + 1, complete
    for step in complete:
        raw = layout.read_json(fs, layout.manifest_path(prefix, step))
        manifest = layout.CheckpointManifest.from_json(raw, where=f"step {step}")
        files = checkpoint_files(step)
        assert {f.path: (f.size, f.sha256) for f in manifest.files} == {
            rel: (len(data), sha256(data)) for rel, data in files.items()
        }, f"step {step}'s manifest does not list its files as committed"
        for rel, data in files.items():
            with fs.open_input_stream(layout.data_path(prefix, step, rel)) as f:
                assert sha256(f.read()) == sha256(data), f"step {step} {rel}: other bytes"
    # An unfinished upload may linger until the next publish prunes it; it is never
    # what `latest` names, and never newer than the newest complete step.
    assert all(s < complete[-1] for s in incomplete), f"incomplete {incomplete} after {complete}"
    pointer = layout.parse_pointer(layout.read_json(fs, layout.pointer_path(prefix)))
    assert pointer == complete[-1], f"latest is {pointer}, the newest complete step {complete[-1]}"
    return ["published steps complete and verified", "latest is the newest", "nothing lost"]


def check_restored(root: Path, step: int) -> list[str]:
    """A restored step on a node: its bytes, its data state, no staging left."""
    assert tree(root / f"step-{step}") == checkpoint_files(step)
    assert checkpoint.data_state(step, root=root) == {"position": step * 10}
    leftovers = [p.name for p in root.iterdir() if p.name.startswith(restorer.STAGING_PREFIX)]
    assert leftovers == [], f"restore staging left behind: {leftovers}"
    listed = [c.step for c in _protocol.local_checkpoints(root)]
    assert step in listed, f"restored step {step} not listed ({listed})"
    return [f"step {step} restored byte for byte"]


def check_nothing_partial_listed(root: Path) -> list[str]:
    """After a kill mid-restore: no checkpoint on the node looks restored but is not."""
    for ckpt in _protocol.local_checkpoints(root):
        assert ckpt.status is not None and ckpt.status.phase == "restored", ckpt
        assert tree(ckpt.path) == checkpoint_files(ckpt.step), f"{ckpt.path} is partial"
    return ["no partial restore listed"]


def checkpoint_episode(
    s3: S3Server, bucket: str, workdir: Path, point: str, count: int = 1
) -> Outcome:
    """Kill the agent the `count`-th time it reaches `point`; restart; check."""
    agents: list[AgentProcess] = []
    try:
        return _checkpoint_episode(s3, bucket, workdir, point, count, agents)
    finally:
        for agent in agents:
            agent.cleanup()


def _checkpoint_episode(
    s3: S3Server,
    bucket: str,
    workdir: Path,
    point: str,
    count: int,
    agents: list[AgentProcess],
) -> Outcome:
    uri = f"s3://{bucket}/run"
    fs = s3.filesystem()
    prefix = f"{bucket}/run"
    steps = [1, 2, 3]
    checks: list[str] = []
    if point in ("checkpoint.restore.fetch", "checkpoint.restore.assemble", "checkpoint.answer"):
        # A previous pod published the steps; this node restores.
        previous = AgentProcess(s3, uri, workdir / "previous")
        agents.append(previous)
        commit_steps(previous.root, steps)
        previous.start()
        try:
            published_everything(previous, steps)
        finally:
            previous.stop()
        node = AgentProcess(s3, uri, workdir / "node")
        agents.append(node)
        if point == "checkpoint.answer":
            checks += _answer_episode(node, point, count)
        else:
            node.start(fault=f"{point}:{count}")
            node.wait_killed(point)
            checks += check_nothing_partial_listed(node.root)
            node.start()
            try:
                waiting.wait_until(
                    "the restarted agent to restore the latest step",
                    lambda: restored(node.root, 3),
                    timeout=PROCESS_TIMEOUT_S,
                    describe=node.log_tail,
                )
            finally:
                node.stop()
            checks += check_restored(node.root, 3)
        checks += check_store(fs, prefix, steps)
        return Outcome(point, count, tuple(checks))
    node = AgentProcess(s3, uri, workdir / "node")
    agents.append(node)
    commit_steps(node.root, steps)
    node.start(fault=f"{point}:{count}")
    node.wait_killed(point)
    node.start()
    try:
        published_everything(node, steps)
        # One more scan after the last publish: `latest` may lag by at most one.
        waiting.wait_until(
            "the node's latest file to list the published steps",
            lambda: newest_published(published_steps(node.root), steps),
            timeout=PROCESS_TIMEOUT_S,
            describe=node.log_tail,
        )
    finally:
        node.stop()
    checks += check_store(fs, prefix, steps)
    fresh = AgentProcess(s3, uri, workdir / "fresh")
    agents.append(fresh)
    fresh.start()
    try:
        waiting.wait_until(
            "a fresh node to restore the latest step",
            lambda: restored(fresh.root, 3),
            timeout=PROCESS_TIMEOUT_S,
            describe=fresh.log_tail,
        )
    finally:
        fresh.stop()
    checks += check_restored(fresh.root, 3)
    return Outcome(point, count, tuple(checks))


def _answer_episode(node: AgentProcess, point: str, count: int) -> list[str]:
    """The trainer asks for step 2 while the agent dies before answering; it restarts
    and answers the request still waiting, with the whole step."""
    node.start(fault=f"{point}:{count}")
    answer: list[Path | None] = []
    failure: list[BaseException] = []

    def trainer() -> None:
        try:
            answer.append(checkpoint.restore(2, timeout=PROCESS_TIMEOUT_S, root=node.root))
        except BaseException as exc:
            failure.append(exc)

    waiting.wait_until(
        "the agent's start-up restore and its list of published steps",
        lambda: 2 in published_steps(node.root),
        timeout=PROCESS_TIMEOUT_S,
        describe=node.log_tail,
    )
    asking = threading.Thread(target=trainer, daemon=True)
    asking.start()
    waiting.wait_until(
        f"the agent to kill itself at {point} (or the trainer's request to fail)",
        lambda: node.killed() or failure,
        timeout=PROCESS_TIMEOUT_S,
        describe=node.log_tail,
    )
    assert failure == [], f"the trainer's restore failed: {failure}\n{node.log_tail()}"
    node.start()
    try:
        asking.join(PROCESS_TIMEOUT_S)
        assert not asking.is_alive(), f"the trainer's request was never answered\n{node.log_tail()}"
    finally:
        node.stop()
    assert failure == [], failure
    assert answer == [node.root / "step-2"]
    return [*check_restored(node.root, 2), "the pending request answered after the restart"]


# -- the node cache ------------------------------------------------------------------------

CACHE_SHARDS = [400, 250, 0, 380, 300, 420, 260]


def cache_episode(workdir: Path, point: str, count: int = 1) -> Outcome:
    """Kill the sidecar the `count`-th time its node cache reaches `point` during the
    warm-up; restart it unarmed; read every row through it and check the tiers."""
    root = workdir / "ds"
    table = datasets.write_dataset(pafs.LocalFileSystem(), str(root), CACHE_SHARDS)
    uri = f"file://{root}"
    sizes = [p.stat().st_size for p in sorted(root.iterdir())]
    env = {
        contract.ENV_READY_SHARDS: "4",
        contract.ENV_PREFETCH_DEPTH: "4",
        # Room for about three source shards on disk: the warm-up evicts.
        contract.ENV_DISK_LIMIT: str(sum(sorted(sizes)[-3:]) + 1024),
        faultpoints.ENV_TEST_FAULT: f"{point}:{count}",
    }
    # Its own short directory under /tmp: the socket path must stay under 108 bytes.
    proc = SidecarProcess(uri, env=env, args=["--no-shuffle"])
    try:
        proc.start(wait="none")
        waiting.wait_until(
            f"the sidecar to kill itself at {point}",
            lambda: proc.process is not None and proc.process.poll() == -signal.SIGKILL,
            timeout=PROCESS_TIMEOUT_S,
            describe=proc.log_tail,
        )
        proc.process = None
        del proc.extra_env[faultpoints.ENV_TEST_FAULT]
        proc.start(wait="ready")
        shards = sidecar_client.SidecarProvider.from_env(environ=proc.client_env())
        want = table.column("uid").to_pylist()
        for epoch in (0, 1):
            params = plans.PlanParams(seed=3, epoch=epoch, block_size=64)
            with shardcache.Dataset(shards, params) as ds:
                got = [u for b in ds.batches(100) for u in b.column("uid").to_pylist()]
            assert sorted(got) == want, f"epoch {epoch}: rows other than the source's"
            assert got == expected_order(table, shards.manifest, params)
        report = tiers.Tier(
            proc.disk_dir, limit_bytes=1 << 40, name="disk", fsync=False, verify="always"
        ).scan()
        assert report.corrupted == 0, f"disk tier entries failing their checksum: {report}"
        assert proc.stop() == 0
    finally:
        proc.cleanup()
    return Outcome(
        point, count, ("every row served equals the source, in plan order", "disk tier verified")
    )


def expected_order(
    table: pa.Table, manifest: manifests.Manifest, params: plans.PlanParams
) -> list[int]:
    """The source's uids in the order the plan reads them, without shardcache's cache."""
    offsets = plans.shard_offsets(manifest.shard_rows)
    uids = table.column("uid").to_pylist()
    return [
        uids[offsets[r.shard] + i]
        for r in plans.rank_runs(manifest.shard_rows, manifest.digest, params)
        for i in range(r.start, r.stop)
    ]
