"""The checkpoint agent against a real S3-compatible server (MinIO).

The agent runs in the test process here (embedded mode, as on a laptop); the
SIGKILL tests in test_checkpoint_sidecar.py run it inside `shardcache sidecar`.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import prometheus_client
import pyarrow as pa
import pyarrow.fs as pafs
import pytest
from shardcache_sidecar.checkpoint import (
    Agent,
    CheckpointSettings,
    CorruptCheckpointError,
    Metrics,
    metrics,
    uploader,
)

import shardcache
from shardcache import checkpoint, contract, errors, source
from shardcache.checkpoint import _protocol, layout
from tests.support import datasets, rot, waiting
from tests.support.checkpoints import AgentFactory, tree, write_checkpoint
from tests.support.faultproxy import FaultProxy
from tests.support.s3server import S3Server

pytestmark = pytest.mark.integration


def model_files(step: int, big: int = 3 << 20) -> dict[str, bytes]:
    rng = hashlib.sha256(str(step).encode()).digest()
    return {
        "model.bin": (rng * (big // len(rng) + 1))[:big],
        "optimizer/state.bin": bytes([step % 256]) * 70_000,
        "meta.json": json.dumps({"step": step}).encode(),
    }


def remote_keys(s3_server: S3Server, bucket: str) -> list[str]:
    infos = s3_server.filesystem().get_file_info(pafs.FileSelector(bucket, recursive=True))
    return sorted(i.path for i in infos if i.type == pafs.FileType.File)


def test_empty_bucket_gives_a_clean_start(make_agent: AgentFactory, tmp_path: Path) -> None:
    agent = make_agent()
    result = agent.restore()
    assert result.step is None
    assert checkpoint.latest(root=tmp_path / "node-a") is None
    assert checkpoint.restore(root=tmp_path / "node-a") is None
    assert agent.readiness() == (True, "no checkpoint to restore")


def test_commit_returns_at_once_and_the_agent_publishes_it_verified(
    make_agent: AgentFactory, s3_server: S3Server, s3_bucket: str, tmp_path: Path
) -> None:
    agent = make_agent()
    agent.start()
    assert agent.wait_ready(30)
    root = tmp_path / "node-a"
    files = model_files(7)
    path = write_checkpoint(root, "step-7", files)

    checkpoint.commit(path, step=7, data_state={"position": 3})
    checkpoint.wait(7, timeout=60, root=root)

    assert checkpoint.latest(root=root) == 7
    prefix = f"{s3_bucket}/run"
    assert remote_keys(s3_server, s3_bucket) == sorted(
        [f"{prefix}/latest", f"{prefix}/step-000000000007/checkpoint.json"]
        + [f"{prefix}/step-000000000007/data/{rel}" for rel in files]
    )
    fs = s3_server.filesystem()
    manifest = layout.CheckpointManifest.from_json(
        layout.read_json(fs, f"{prefix}/step-000000000007/checkpoint.json"), where="test"
    )
    assert manifest.name == "step-7"
    assert manifest.data_state == {"position": 3}
    assert {f.path: f.sha256 for f in manifest.files} == {
        rel: hashlib.sha256(content).hexdigest() for rel, content in files.items()
    }
    assert layout.read_json(fs, f"{prefix}/latest") == {"version": 1, "step": 7, "name": "step-7"}

    # Another node restores it, byte for byte, with the data state.
    other = make_agent("node-b")
    result = other.restore()
    assert result.step == 7 and result.downloaded_bytes == sum(map(len, files.values()))
    restored = checkpoint.restore(root=tmp_path / "node-b")
    assert restored == tmp_path / "node-b" / "step-7"
    assert tree(restored) == files
    assert checkpoint.data_state("latest", root=tmp_path / "node-b") == {"position": 3}


def test_intact_copy_on_the_node_is_reused_and_a_damaged_file_is_fetched_again(
    make_agent: AgentFactory, tmp_path: Path
) -> None:
    agent = make_agent()
    root = tmp_path / "node-a"
    files = model_files(3)
    checkpoint.commit(write_checkpoint(root, "ckpt", files), step=3)
    assert agent.scan() == [3]

    first = make_agent().restore()  # same node, same volume: nothing to download
    assert (first.step, first.downloaded_bytes) == (3, 0)
    assert first.reused_bytes == sum(map(len, files.values()))

    damaged = bytearray((root / "ckpt" / "model.bin").read_bytes())
    damaged[1000] ^= 0xFF
    (root / "ckpt" / "model.bin").write_bytes(bytes(damaged))
    (root / "ckpt" / "stray.tmp").write_bytes(b"not part of the checkpoint")
    second = make_agent().restore()
    assert second.downloaded_bytes == len(files["model.bin"])
    assert tree(root / "ckpt") == files


def test_retention_keeps_the_last_n_in_the_bucket_and_on_the_node(
    make_agent: AgentFactory, s3_server: S3Server, s3_bucket: str, tmp_path: Path
) -> None:
    agent = make_agent(keep_last=2)
    root = tmp_path / "node-a"
    for step in (10, 20, 30, 40):
        checkpoint.commit(write_checkpoint(root, f"s{step}", model_files(step, 1 << 16)), step=step)
        assert agent.scan() == [step]

    fs = s3_server.filesystem()
    assert layout.list_steps(fs, f"{s3_bucket}/run") == ([30, 40], [])
    assert not [k for k in remote_keys(s3_server, s3_bucket) if "/step-000000000010/" in k]
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["s30", "s40"]
    latest = _protocol.read_root_file(root, _protocol.LATEST_NAME)
    assert latest is not None and (latest["step"], latest["steps"]) == (40, [30, 40])
    # A step that retention removed from the node still counts as uploaded.
    checkpoint.wait(30, timeout=1, root=root)


def publish_steps_1_and_2(agent: Agent, root: Path) -> None:
    for step in (1, 2):
        checkpoint.commit(write_checkpoint(root, f"step-{step}", model_files(step)), step=step)
        assert agent.scan() == [step]


def test_corrupted_object_is_detected_on_restore_and_fallback_happens_only_when_told(
    make_agent: AgentFactory, s3_server: S3Server, s3_bucket: str, tmp_path: Path
) -> None:
    root = tmp_path / "node-a"
    publish_steps_1_and_2(make_agent(), root)
    # Bit rot in the store: same size, other bytes.
    victim = f"{s3_bucket}/run/step-000000000002/data/model.bin"
    rot.flip_bit(s3_server.filesystem(), victim, 12345)

    strict = make_agent("node-b")
    with pytest.raises(CorruptCheckpointError) as info:
        strict.restore()
    message = str(info.value)
    assert "step-000000000002/data/model.bin" in message
    assert "expected sha256" in message and "RESTORE_FALLBACK" in message
    # The trainer is told, rather than silently starting from scratch.
    with pytest.raises(errors.InputError, match=r"restore failed.*model\.bin"):
        checkpoint.restore(root=tmp_path / "node-b")
    assert [p.name for p in (tmp_path / "node-b").iterdir() if not p.name.startswith(".")] == []

    # Started as in the sidecar: never ready, and the reason (for /readyz) says why.
    strict_bg = make_agent("node-c")
    strict_bg.start()
    waiting.wait_until(
        "the background restore to report its failure",
        lambda: "failed" in strict_bg.readiness()[1],
        describe=lambda: str(strict_bg.readiness()),
    )
    ready, why = strict_bg.readiness()
    assert not ready and "model.bin" in why

    lenient = make_agent("node-d", restore_fallback=True)
    result = lenient.restore()
    assert result.step == 1 and [s for s, _ in result.skipped] == [2]
    assert tree(tmp_path / "node-d" / "step-1") == model_files(1)


def test_pinned_step_is_restored_and_an_unknown_step_is_a_clear_error(
    make_agent: AgentFactory, tmp_path: Path
) -> None:
    agent = make_agent()
    root = tmp_path / "node-a"
    for step in (5, 6):
        checkpoint.commit(write_checkpoint(root, f"step-{step}", model_files(step)), step=step)
    assert agent.scan() == [5, 6]

    assert make_agent("node-b", restore="5").restore().step == 5
    assert make_agent("node-c", restore="none").restore().step is None
    with pytest.raises(errors.InputError, match=r"step 9\b.*published steps: \[5, 6\]"):
        make_agent("node-d", restore="9").restore()


def test_marker_file_written_without_the_library_is_uploaded(
    make_agent: AgentFactory, tmp_path: Path
) -> None:
    agent = make_agent()
    root = tmp_path / "node-a"
    path = write_checkpoint(root, "from-bash", {"weights.pt": b"w" * 1000})
    # What `echo 12 > .tmp && mv .tmp .shardcache-commit` does in a shell trainer.
    (path / ".tmp-marker").write_text("12\n")
    os.replace(path / ".tmp-marker", path / _protocol.MARKER_NAME)
    assert agent.scan() == [12]
    checkpoint.wait(12, timeout=1, root=root)
    assert make_agent("node-b").restore().step == 12
    assert tree(tmp_path / "node-b" / "from-bash") == {"weights.pt": b"w" * 1000}


def test_duplicate_step_is_refused_and_the_published_checkpoint_stays_intact(
    make_agent: AgentFactory, tmp_path: Path
) -> None:
    agent = make_agent()
    root = tmp_path / "node-a"
    original = model_files(4)
    checkpoint.commit(write_checkpoint(root, "step-4", original), step=4)
    assert agent.scan() == [4]

    # On the same node: refused by commit itself.
    again = write_checkpoint(root, "step-4-again", {"x": b"other"})
    with pytest.raises(errors.InputError, match="step 4 is already committed"):
        checkpoint.commit(again, step=4)

    # From another node sharing the URI: refused by the agent, reported to wait().
    other = make_agent("node-b")
    other_root = tmp_path / "node-b"
    checkpoint.commit(write_checkpoint(other_root, "step-4", {"x": b"other"}), step=4)
    assert other.scan() == []
    with pytest.raises(errors.InputError, match="already published"):
        checkpoint.wait(4, timeout=5, root=other_root)

    result = make_agent("node-c").restore()
    assert result.step == 4
    assert tree(tmp_path / "node-c" / "step-4") == original


def test_missing_directory_and_bad_commits_are_clear_errors(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    root.mkdir()
    with pytest.raises(errors.InputError, match="does not exist: write the checkpoint"):
        checkpoint.commit(root / "nope", step=1)
    path = write_checkpoint(root, "ok", {"a": b"1"})
    with pytest.raises(errors.InputError, match="integer >= 0"):
        checkpoint.commit(path, step=-1)
    with pytest.raises(errors.InputError, match="JSON-serialisable"):
        checkpoint.commit(path, step=1, data_state={"x": object()})
    assert _protocol.read_marker(path) is None


def test_unwritable_destination_is_a_clear_error_and_earlier_checkpoints_stay_intact(
    make_agent: AgentFactory, s3_server: S3Server, tmp_path: Path
) -> None:
    good = make_agent()
    root = tmp_path / "node-a"
    checkpoint.commit(write_checkpoint(root, "step-1", model_files(1)), step=1)
    assert good.scan() == [1]

    # The same volume, now pointed at a bucket that does not exist.
    missing = make_agent(uri="s3://no-such-bucket-for-shardcache/run")
    checkpoint.commit(write_checkpoint(root, "step-2", model_files(2)), step=2)
    assert missing.scan() == []
    with pytest.raises(errors.InputError, match="no-such-bucket-for-shardcache"):
        checkpoint.wait(2, timeout=5, root=root)
    status = _protocol.read_status(root / "step-2")
    assert status is not None and status.phase == "failed" and not status.retryable

    assert checkpoint.latest(root=root) == 1
    assert make_agent("node-b").restore().step == 1
    assert tree(tmp_path / "node-b" / "step-1") == model_files(1)

    # A restore destination that cannot be a directory: a clear error, never ready.
    (tmp_path / "not-a-dir").write_text("a file where the volume should be")
    blocked = make_agent("not-a-dir")
    with pytest.raises(errors.InputError, match="cannot use the checkpoint volume"):
        blocked.restore()
    assert not blocked.readiness()[0]


def test_metrics_count_bytes_steps_and_age(make_agent: AgentFactory, tmp_path: Path) -> None:
    registry = prometheus_client.CollectorRegistry()
    agent = make_agent(verify_uploads=True)
    agent.observer = Metrics(registry)
    files = model_files(11)
    assert registry.get_sample_value("shardcache_checkpoint_last_committed_step") == -1
    before_commit = time.time()
    checkpoint.commit(write_checkpoint(tmp_path / "node-a", "s11", files), step=11)
    assert agent.scan() == [11]

    def sample(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert sample("shardcache_checkpoint_bytes_total", direction="upload") == sum(
        map(len, files.values())
    )
    assert sample("shardcache_checkpoint_last_committed_step") == 11
    assert sample("shardcache_checkpoint_uploads_in_flight") == 0
    assert sample("shardcache_checkpoint_upload_duration_seconds_count") == 1
    age = sample("shardcache_checkpoint_age_seconds")
    # Measured from the commit: no more than the time since just before it, however slow.
    assert age is not None and 0 <= age <= time.time() - before_commit


def test_resume_with_the_data_state_continues_the_uninterrupted_stream(
    make_agent: AgentFactory,
    s3_server: S3Server,
    s3_bucket: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    datasets.write_dataset(s3_server.filesystem(), f"{s3_bucket}/ds", [300, 250, 400, 280])
    uri = f"s3://{s3_bucket}/ds"
    opts = {"seed": 5, "block_size": 32, "storage_options": s3_server.env()}

    def uids(batch: pa.RecordBatch) -> list[int]:
        return list(batch.column("uid").to_pylist())

    with shardcache.open(uri, cache_dir=tmp_path / "c0", **opts) as ds:  # type: ignore[arg-type]
        uninterrupted = [uids(b) for b in ds.batches(40)]

    # Train 9 steps, checkpoint model and data position together, then lose the node.
    agent = make_agent()
    root = tmp_path / "node-a"
    with shardcache.open(uri, cache_dir=tmp_path / "c1", **opts) as ds:  # type: ignore[arg-type]
        stream = ds.batches(40)
        seen = [uids(next(stream)) for _ in range(9)]
        path = write_checkpoint(root, "step-9", {"model.bin": b"weights after 9 steps"})
        checkpoint.commit(path, step=9, data_state=ds.state_dict())
        stream.close()
    assert agent.scan() == [9]
    assert seen == uninterrupted[:9]

    # A new node: the agent restores, the trainer resumes model and data together.
    make_agent("node-b").restore()
    monkeypatch.setenv(contract.ENV_CHECKPOINT_DIR, str(tmp_path / "node-b"))
    model = checkpoint.restore()
    assert model is not None and (model / "model.bin").read_bytes() == b"weights after 9 steps"
    with shardcache.open(uri, cache_dir=tmp_path / "c2", resume_from="latest", **opts) as ds:  # type: ignore[arg-type]
        rest = [uids(b) for b in ds.batches(40)]
    assert rest == uninterrupted[9:]
    with shardcache.open(uri, cache_dir=tmp_path / "c3", resume_from=9, **opts) as ds:  # type: ignore[arg-type]
        assert uids(next(iter(ds.batches(40)))) == uninterrupted[9]


def test_store_outage_during_upload_is_retried_until_published(
    s3_server: S3Server, s3_bucket: str, fault_proxy: FaultProxy, tmp_path: Path
) -> None:
    root = tmp_path / "node-a"
    settings = CheckpointSettings(
        directory=root,
        uri=f"s3://{s3_bucket}/run",
        poll_interval=0.05,
        retry_interval=0.2,
        retry=source.RetryPolicy(attempts=2, initial_delay=0.05, max_delay=0.1),
    )
    env = {**s3_server.env(), "AWS_ENDPOINT_URL": fault_proxy.endpoint_url}
    agent = Agent(settings, storage_options=env)
    agent.start()
    try:
        assert agent.wait_ready(60)
        fault_proxy.refuse_connections()
        checkpoint.commit(write_checkpoint(root, "step-1", model_files(1)), step=1)
        # The store is down: the trainer's wait() keeps waiting and says why on timeout.
        with pytest.raises(TimeoutError, match="last error"):
            checkpoint.wait(1, timeout=3, root=root)
        status = _protocol.read_status(root / "step-1")
        assert status is not None and status.phase in ("failed", "uploading")
        assert status.retryable and "connect" in str(status.error)
        fault_proxy.accept_connections()
        checkpoint.wait(1, timeout=60, root=root)
    finally:
        agent.stop(timeout=30)
    assert checkpoint.latest(root=root) == 1


def test_object_missing_from_the_store_is_a_damaged_checkpoint_and_fallback_applies(
    make_agent: AgentFactory, s3_server: S3Server, s3_bucket: str, tmp_path: Path
) -> None:
    root = tmp_path / "node-a"
    publish_steps_1_and_2(make_agent(), root)
    # Deleted behind the manifest's back (a lifecycle rule, a person).
    victim = f"{s3_bucket}/run/step-000000000002/data/optimizer/state.bin"
    s3_server.filesystem().delete_file(victim)

    with pytest.raises(CorruptCheckpointError, match="missing from the store") as info:
        make_agent("node-b").restore()
    assert "step-000000000002/data/optimizer/state.bin" in str(info.value)

    result = make_agent("node-c", restore_fallback=True).restore()
    assert result.step == 1 and [s for s, _ in result.skipped] == [2]
    assert "missing from the store" in result.skipped[0][1]
    assert tree(tmp_path / "node-c" / "step-1") == model_files(1)


def test_file_whose_object_key_would_be_too_long_is_refused_for_good_before_upload(
    make_agent: AgentFactory, s3_server: S3Server, s3_bucket: str, tmp_path: Path
) -> None:
    agent = make_agent()
    root = tmp_path / "node-a"
    long_path = "/".join(["layer" + "x" * 240] * 5) + "/weights.bin"
    checkpoint.commit(
        write_checkpoint(root, "step-1", {long_path: b"w", "model.bin": b"m"}), step=1
    )
    started = time.monotonic()
    assert agent.scan() == []
    assert time.monotonic() - started < 5  # no retries with backoff
    with pytest.raises(errors.InputError, match=r"object key of \d+ bytes.*over the 1024"):
        checkpoint.wait(1, timeout=5, root=root)
    assert remote_keys(s3_server, s3_bucket) == []
    # The same limit as the store's own: a path that fits is published.
    room = layout.MAX_KEY_BYTES - len("run/step-000000000002/data/")
    fits = "/".join(["d" * 199] * 4)  # components a filesystem takes
    fits += "/" + "f" * (room - len(fits) - 1)
    checkpoint.commit(write_checkpoint(root, "step-2", {fits: b"w"}), step=2)
    assert agent.scan() == [2]


def test_a_request_the_store_refuses_with_a_4xx_is_not_retried(
    s3_server: S3Server, s3_bucket: str, tmp_path: Path
) -> None:
    fs = s3_server.filesystem()
    directory = write_checkpoint(tmp_path, "step-1", {"model.bin": b"m"})
    tries = []

    def put() -> str:
        tries.append(1)
        return uploader.put_file(
            fs,
            directory,
            "model.bin",
            f"{s3_bucket}/{'k' * 1100}",
            expected_size=1,
            observer=metrics.NullObserver(),
        )

    with pytest.raises(errors.InputError, match=r"HTTP status 400.*KeyTooLong"):
        source.with_retries(put, what="uploading", policy=source.RetryPolicy(initial_delay=0.1))
    assert len(tries) == 1


def test_empty_directories_of_a_checkpoint_are_restored_on_another_node(
    make_agent: AgentFactory, tmp_path: Path
) -> None:
    agent = make_agent()
    root = tmp_path / "node-a"
    path = write_checkpoint(root, "step-1", model_files(1, 1 << 10))
    (path / "empty").mkdir()
    (path / "shards" / "rank-3").mkdir(parents=True)
    checkpoint.commit(path, step=1)
    assert agent.scan() == [1]

    def dirs(p: Path) -> list[str]:
        return sorted(q.relative_to(p).as_posix() for q in p.rglob("*") if q.is_dir())

    restored = make_agent("node-b").restore()
    assert restored.path is not None
    assert dirs(restored.path) == dirs(path) == ["empty", "optimizer", "shards", "shards/rank-3"]
    assert tree(restored.path) == tree(path)
    # A copy on the node that lacks one is completed, not taken as the checkpoint.
    (restored.path / "empty").rmdir()
    again = make_agent("node-b").restore()
    assert again.downloaded_bytes == 0 and (restored.path / "empty").is_dir()


def test_wait_returns_for_a_step_published_and_since_removed_by_retention(
    make_agent: AgentFactory, tmp_path: Path
) -> None:
    agent = make_agent(keep_last=1)
    agent.restore()
    root = tmp_path / "node-a"
    for step in (1, 2):
        checkpoint.commit(write_checkpoint(root, f"step-{step}", {"m": b"%d" % step}), step=step)
    assert agent.scan() == [1, 2]
    assert [c.step for c in _protocol.local_checkpoints(root)] == [2]
    checkpoint.wait(1, timeout=5, root=root)
    # Kept across an agent restart on the node, and by retention of later steps.
    restarted = make_agent(keep_last=1)
    restarted.restore()
    latest = _protocol.read_root_file(root, _protocol.LATEST_NAME)
    assert latest is not None and latest["highest_published"] == 2
    checkpoint.wait(1, timeout=5, root=root)
    with pytest.raises(errors.InputError, match="no checkpoint with step 3"):
        checkpoint.wait(3, timeout=5, root=root)
