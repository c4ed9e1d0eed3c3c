"""Checkpoint test helpers: writing a checkpoint directory, reading one back, and
agents on the test's bucket (the `make_agent` fixture)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from shardcache_sidecar.checkpoint import Agent, CheckpointSettings

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
