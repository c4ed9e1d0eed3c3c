"""`checkpoint.restore(step)` of a published step that is not on the node: the trainer
writes a request file, a real agent on a real S3-compatible server (MinIO) restores the
step, every byte verified, and answers in the same file."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import shutil
import time
from pathlib import Path

import pytest
from shardcache_sidecar.checkpoint import Agent

from shardcache import checkpoint, errors
from shardcache.checkpoint import _protocol, layout
from tests.support import rot
from tests.support.checkpoints import AgentFactory, tree, write_checkpoint
from tests.support.s3server import S3Server

pytestmark = pytest.mark.integration


def files_of(step: int) -> dict[str, bytes]:
    seed = hashlib.sha256(str(step).encode()).digest()
    return {
        "model.bin": (seed * ((1 << 20) // len(seed) + 1))[: 1 << 20],
        "optimizer/state.bin": bytes([step]) * 50_000,
    }


def publish(make_agent: AgentFactory, steps: tuple[int, ...]) -> None:
    """Steps a previous pod committed and published, with their data state."""
    agent = make_agent("previous-pod")
    root = agent.root
    for step in steps:
        path = write_checkpoint(root, f"step-{step}", files_of(step))
        checkpoint.commit(path, step=step, data_state={"position": step * 100})
        assert agent.scan() == [step]


def requests_in(root: Path) -> list[Path]:
    return [p for p in root.iterdir() if _protocol.request_id_of(p.name) is not None]


def restore_served_by(agent: Agent, step: int) -> Path | None:
    """checkpoint.restore(step) in a trainer thread while this thread drives the agent."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        trainer = pool.submit(checkpoint.restore, step, timeout=60, root=agent.root)
        deadline = time.monotonic() + 60
        while not trainer.done() and time.monotonic() < deadline:
            agent.serve_requests()
            time.sleep(0.02)
        return trainer.result(timeout=1)


def test_older_published_step_is_restored_on_demand_with_its_bytes_and_data_state(
    make_agent: AgentFactory,
) -> None:
    publish(make_agent, (1, 2, 3))
    agent = make_agent("node-b")
    agent.start()
    assert agent.wait_ready(60)
    root = agent.root
    assert [c.step for c in _protocol.local_checkpoints(root)] == [3]

    path = checkpoint.restore(1, timeout=60, root=root)

    assert path == root / "step-1"
    assert tree(path) == files_of(1)
    assert checkpoint.data_state(1, root=root) == {"position": 100}
    assert [c.step for c in _protocol.local_checkpoints(root)] == [1, 3]
    assert checkpoint.restore(1, timeout=0, root=root) == path  # now local: no request
    assert requests_in(root) == []


def test_step_restored_on_demand_is_kept_from_retention_until_the_trainer_commits_after_it(
    make_agent: AgentFactory,
) -> None:
    publish(make_agent, (1, 2, 3))
    agent = make_agent("node-b", keep_last=2)
    agent.restore()
    root = agent.root
    asked_at = time.time()
    assert restore_served_by(agent, 1) == root / "step-1"

    # A checkpoint written before the rollback and published after it: retention must
    # not take the step the trainer is loading.
    write_checkpoint(root, "step-4", files_of(4))
    _protocol.write_marker(root / "step-4", _protocol.Marker(4, committed_at=asked_at - 1))
    assert agent.scan() == [4]
    assert [c.step for c in _protocol.local_checkpoints(root)] == [1, 3, 4]

    # The trainer commits from the restored step on: it has moved on, retention resumes.
    checkpoint.commit(write_checkpoint(root, "step-5", files_of(5)), step=5)
    assert agent.scan() == [5]
    assert [c.step for c in _protocol.local_checkpoints(root)] == [4, 5]


def test_step_never_published_is_an_input_error_naming_the_published_ones(
    make_agent: AgentFactory,
) -> None:
    publish(make_agent, (1, 2))
    agent = make_agent("node-b")
    agent.start()
    assert agent.wait_ready(60)
    with pytest.raises(errors.InputError, match=r"step 9 .*published steps: \[1, 2\]"):
        checkpoint.restore(9, timeout=10, root=agent.root)
    assert requests_in(agent.root) == []


def test_damaged_step_in_the_store_fails_with_the_agents_reason_and_leaves_nothing_listed(
    make_agent: AgentFactory, s3_server: S3Server, s3_bucket: str
) -> None:
    publish(make_agent, (1, 2))
    rot.flip_bit(s3_server.filesystem(), f"{s3_bucket}/run/step-000000000001/data/model.bin", 4321)
    agent = make_agent("node-b")
    agent.start()
    assert agent.wait_ready(60)
    root = agent.root

    with pytest.raises(errors.InputError) as info:
        checkpoint.restore(1, timeout=60, root=root)

    message = str(info.value)
    assert "step 1 was not restored" in message
    assert "step-000000000001/data/model.bin: expected sha256" in message
    assert [c.step for c in _protocol.local_checkpoints(root)] == [2]
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["step-2"]
    assert [p.name for p in root.iterdir() if p.name.startswith(".shardcache-restore-")] == []
    assert requests_in(root) == []


def test_no_agent_running_is_a_timeout_that_asks_about_the_agent(
    make_agent: AgentFactory,
) -> None:
    publish(make_agent, (1, 2))
    agent = make_agent("node-b")
    agent.restore()  # restored at start, then the agent died: nobody serves requests
    with pytest.raises(TimeoutError, match=r"step 1 .*within 0\.5s.*checkpoint agent running"):
        checkpoint.restore(1, timeout=0.5, root=agent.root)
    assert requests_in(agent.root) == []  # withdrawn


def test_malformed_request_is_answered_as_failed_and_the_agent_serves_the_next(
    make_agent: AgentFactory,
) -> None:
    publish(make_agent, (1, 2))
    agent = make_agent("node-b")
    agent.start()
    assert agent.wait_ready(60)
    root = agent.root
    junk = _protocol.request_path(root, "junk")
    junk.write_text("restore step 1 please")
    bad_step = _protocol.request_path(root, "badstep")
    _protocol.write_json_atomic(
        bad_step, {"version": 1, "kind": "restore", "id": "badstep", "step": "one"}
    )

    assert checkpoint.restore(1, timeout=60, root=root) == root / "step-1"

    assert tree(root / "step-1") == files_of(1)
    for path, reason in ((junk, "expected a JSON restore request"), (bad_step, "integer >= 0")):
        # Requests are served in name order and the trainer's id is random: a bad request
        # may come after the good one, so wait for its answer.
        deadline = time.monotonic() + 30
        while "phase" not in path.read_text() and time.monotonic() < deadline:
            time.sleep(0.02)
        answer = json.loads(path.read_text())
        assert answer["phase"] == "failed" and reason in answer["error"]
    assert agent.readiness()[0]


def test_request_name_that_cannot_be_answered_is_reported_once_and_skipped(
    make_agent: AgentFactory, caplog: pytest.LogCaptureFixture
) -> None:
    publish(make_agent, (1,))
    agent = make_agent("node-b")
    agent.restore()
    _protocol.request_path(agent.root, "adir").mkdir()
    for _ in range(3):
        assert agent.serve_requests() == []
    assert len([r for r in caplog.records if "cannot answer" in r.getMessage()]) == 1
    assert restore_served_by(agent, 1) == agent.root / "step-1"


def test_restore_into_a_name_holding_an_unpublished_commit_goes_beside_it_and_keeps_it(
    make_agent: AgentFactory, s3_server: S3Server, s3_bucket: str
) -> None:
    # A trainer that recycles two slot directories.
    agent = make_agent("node-a", keep_last=5)
    agent.restore()
    root = agent.root
    for step, slot in ((1, "slot-a"), (2, "slot-b")):
        checkpoint.commit(write_checkpoint(root, slot, files_of(step)), step=step)
        assert agent.scan() == [step]
    shutil.rmtree(root / "slot-a")
    checkpoint.commit(write_checkpoint(root, "slot-a", files_of(3)), step=3)  # not uploaded yet

    path = restore_served_by(agent, 1)

    assert path == root / "slot-a.restored-1"
    assert tree(path) == files_of(1)
    assert checkpoint.restore(1, timeout=0, root=root) == path
    # The newer commit is untouched, and published on the agent's next scan.
    assert tree(root / "slot-a") == files_of(3)
    marker = _protocol.read_marker(root / "slot-a")
    assert marker is not None and marker.step == 3
    assert agent.scan() == [3]
    fs = s3_server.filesystem()
    assert layout.list_steps(fs, f"{s3_bucket}/run")[0] == [1, 2, 3]


def test_restore_into_a_name_holding_a_published_checkpoint_replaces_that_copy(
    make_agent: AgentFactory,
) -> None:
    agent = make_agent("node-a", keep_last=5)
    agent.restore()
    root = agent.root
    checkpoint.commit(write_checkpoint(root, "slot-a", files_of(1)), step=1)
    assert agent.scan() == [1]
    shutil.rmtree(root / "slot-a")
    checkpoint.commit(write_checkpoint(root, "slot-a", files_of(2)), step=2)
    assert agent.scan() == [2]

    # Step 2 is in the store: restoring step 1 under its own name loses nothing.
    assert restore_served_by(agent, 1) == root / "slot-a"
    assert tree(root / "slot-a") == files_of(1)
