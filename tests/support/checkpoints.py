"""Checkpoint test helpers: writing a checkpoint directory, reading one back, agents on
the test's bucket (the `make_agent` fixture), and a rank's trainer beside its agent."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from shardcache_sidecar.checkpoint import Agent, CheckpointSettings

import shardcache
from shardcache import checkpoint
from shardcache.checkpoint import _protocol
from tests.support.s3server import S3Server

AgentFactory = Callable[..., Agent]


def write_checkpoint(root: Path, name: str, files: dict[str, bytes]) -> Path:
    """Write `files` (relative path -> bytes) into the directory `root/name`."""
    path = root / name
    for rel, content in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(content)
    return path


class TrainerPod:
    """One rank's trainer and its checkpoint agent (a pod, without the cluster), on the
    file:// store `store`, each rank under its `rank-<r>` prefix: the agent restores
    `latest` into `tmp/<generation>/ckpt-<rank>` before the trainer opens the dataset at
    `tmp/ds` and resumes from it as `resume_from="latest"` does."""

    def __init__(
        self,
        tmp: Path,
        generation: str,
        rank: int,
        world: int,
        store: str,
        *,
        seed: int,
        block_size: int,
    ) -> None:
        self.rank = rank
        self.root = tmp / generation / f"ckpt-{rank}"
        settings = CheckpointSettings(
            directory=self.root, uri=f"{store}/rank-{rank}", keep_last=100
        )
        self.agent = Agent(settings)
        self.restored = self.agent.restore()
        self.ds = shardcache.open(
            str(tmp / "ds"), cache_dir=tmp / "cache", rank=rank, world_size=world, seed=seed,
            block_size=block_size,
        )  # fmt: skip
        # What `resume_from="latest"` does, with this pod's checkpoint root.
        self.state: Any = checkpoint.data_state("latest", root=self.root, world_size=world)
        if self.state is not None:
            self.ds.load_state_dict(self.state)

    def commit(self, step: int) -> None:
        """Write and commit checkpoint `step` with the reader's state; the agent
        publishes it."""
        path = write_checkpoint(self.root, f"step-{step}", {"model.bin": b"w%d" % step})
        checkpoint.commit(path, step=step, data_state=self.ds.state_dict())
        assert self.agent.scan() == [step]

    def close(self) -> None:
        self.ds.close()


def tree(path: Path) -> dict[str, bytes]:
    """Every file of a checkpoint directory but the library's own reserved files."""
    return {
        p.relative_to(path).as_posix(): p.read_bytes()
        for p in sorted(path.rglob("*"))
        if p.is_file() and not p.name.startswith(_protocol.RESERVED_PREFIX)
    }


@pytest.fixture
def make_agent(s3_server: S3Server, s3_bucket: str, tmp_path: Path) -> Iterator[AgentFactory]:
    """Agents on the test's bucket; each `node` is a separate checkpoint directory."""
    made: list[Agent] = []

    def make(node: str = "node-a", *, uri: str | None = None, **options: object) -> Agent:
        settings = CheckpointSettings(
            directory=tmp_path / node,
            uri=uri or f"s3://{s3_bucket}/run",
            poll_interval=0.05,
            retry_interval=0.2,
            **options,  # type: ignore[arg-type]
        )
        agent = Agent(settings, storage_options=s3_server.env())
        made.append(agent)
        return agent

    yield make
    for agent in made:
        agent.stop(timeout=30)
