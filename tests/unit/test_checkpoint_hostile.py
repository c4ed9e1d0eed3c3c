"""The checkpoint agent against a hostile trainer and a hostile manifest.

Issue 13, rows 5 and 8. The trainer writes the checkpoint volume; the sidecar holds
credentials and the node's disk tier. The agent must never follow a link the trainer
planted (upload, hash, overwrite or echo what it points to), and a malformed manifest
in the store is refused with a message naming the entry while the agent keeps serving.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from shardcache_sidecar.checkpoint import Agent, CheckpointSettings, uploader

from shardcache.checkpoint import _protocol, layout

pytestmark = pytest.mark.unit

SECRET = b"AWS_SECRET_ACCESS_KEY=sidecar-only-7f3a9c\n"


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    """A file only the sidecar could read (its environment, the node's disk tier)."""
    path = tmp_path / "sidecar-only" / "environ"
    path.parent.mkdir()
    path.write_bytes(SECRET)
    return path


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "volume"
    path.mkdir()
    return path


@pytest.fixture
def store(tmp_path: Path) -> Path:
    path = tmp_path / "store"
    path.mkdir()
    return path


def agent(root: Path, store: Path, *, restore: str = "none") -> Agent:
    return Agent(CheckpointSettings(directory=root, uri=store.as_uri(), restore=restore))


def committed(root: Path, name: str, step: int) -> Path:
    directory = root / name
    directory.mkdir()
    (directory / "model.bin").write_bytes(b"weights" * 100)
    return directory


def commit(directory: Path, step: int) -> None:
    _protocol.write_marker(directory, _protocol.Marker(step=step))


def stored_bytes(store: Path) -> bytes:
    return b"".join(p.read_bytes() for p in store.rglob("*") if p.is_file())


@pytest.mark.parametrize("kind", ["file", "directory"])
def test_a_symlink_in_a_committed_directory_refuses_the_checkpoint(
    root: Path, store: Path, secret: Path, kind: str
) -> None:
    directory = committed(root, "step-1", 1)
    target = secret if kind == "file" else secret.parent
    (directory / "stolen").symlink_to(target)
    commit(directory, 1)
    assert agent(root, store).scan() == []
    status = _protocol.read_status(directory)
    assert status is not None and status.phase == "failed" and not status.retryable
    assert status.error is not None and "'stolen'" in status.error and "link" in status.error
    assert SECRET not in stored_bytes(store)


def test_a_symlinked_status_directory_is_not_written_through(
    root: Path, store: Path, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "sidecar-dir"
    elsewhere.mkdir()
    (root / _protocol.STATUS_DIR).symlink_to(elsewhere)
    directory = committed(root, "step-1", 1)
    commit(directory, 1)
    worker = agent(root, store)
    worker.scan()
    assert list(elsewhere.iterdir()) == []
    # The agent is still usable once the trainer removes the link (after its retry delay).
    (root / _protocol.STATUS_DIR).unlink()
    worker._retry_at.clear()
    assert worker.scan() == [1]


def test_a_symlinked_marker_is_refused_without_echoing_its_target(
    root: Path, store: Path, secret: Path
) -> None:
    directory = committed(root, "step-1", 1)
    (directory / _protocol.MARKER_NAME).symlink_to(secret)
    assert agent(root, store).scan() == []
    status = _protocol.read_status(directory)
    assert status is not None and status.phase == "failed"
    assert "symbolic link" in str(status.error)
    assert SECRET.decode().strip() not in json.dumps(status.to_json())


def test_a_symlinked_request_is_refused_and_the_answer_holds_no_content(
    root: Path, store: Path, secret: Path
) -> None:
    request = _protocol.request_path(root, "abc")
    request.symlink_to(secret)
    agent(root, store).serve_requests()
    answer = request.read_text()
    assert not request.is_symlink()
    assert "symbolic link" in answer
    assert "sidecar-only-7f3a9c" not in answer
    assert secret.read_bytes() == SECRET


def test_a_request_that_is_not_json_is_answered_without_its_content(
    root: Path, store: Path
) -> None:
    request = _protocol.request_path(root, "abc")
    request.write_text("password=hunter2")
    agent(root, store).serve_requests()
    assert "hunter2" not in request.read_text()


def _publish(root: Path, store: Path, step: int = 1) -> Path:
    directory = committed(root, f"step-{step}", step)
    commit(directory, step)
    assert agent(root, store).scan() == [step]
    return directory


def test_restore_never_reuses_or_writes_through_a_planted_link(
    tmp_path: Path, store: Path, secret: Path
) -> None:
    first = tmp_path / "first"
    first.mkdir()
    _publish(first, store)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    # The trainer of the next pod plants the restore target as a link to a sidecar file
    # that holds the right bytes' name: it must be neither reused nor overwritten.
    (fresh / "step-1").mkdir()
    (fresh / "step-1" / "model.bin").symlink_to(secret)
    result = agent(fresh, store, restore="latest").restore()
    assert result.step == 1 and result.reused_bytes == 0
    restored = fresh / "step-1" / "model.bin"
    assert not restored.is_symlink() and restored.read_bytes() == b"weights" * 100
    assert secret.read_bytes() == SECRET


def _hostile_manifest(store: Path, files: list[dict[str, object]], **extra: object) -> None:
    body = {
        "version": layout.LAYOUT_VERSION,
        "step": 7,
        "name": "step-7",
        "created_at": time.time(),
        "total_bytes": 0,
        "data_state": None,
        "files": files,
        **extra,
    }
    path = Path(layout.manifest_path(str(store), 7))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**body, "digest": layout._digest(body)}))


SHA = "0" * 64


@pytest.mark.parametrize(
    ("files", "named"),
    [
        ([{"path": "a\x00b", "size": 1, "sha256": SHA}], "NUL"),
        ([{"path": "model.bin", "size": -5, "sha256": SHA}], "'model.bin': size -5"),
        (
            [
                {"path": "a", "size": 1, "sha256": SHA},
                {"path": "a/b", "size": 1, "sha256": SHA},
            ],
            "'a' is listed as a file and as the directory of 'a/b'",
        ),
        ([{"path": "x", "size": 1, "sha256": "zz"}], "'x': sha256"),
    ],
)
def test_malformed_manifest_is_refused_naming_the_entry_and_the_agent_keeps_serving(
    root: Path, store: Path, files: list[dict[str, object]], named: str
) -> None:
    _hostile_manifest(store, files)
    said: list[tuple[bool, str]] = []
    worker = Agent(
        CheckpointSettings(directory=root, uri=store.as_uri(), restore="7", poll_interval=0.01),
        on_readiness=lambda ready, why: said.append((ready, why)),
    )
    worker.start()
    try:
        deadline = time.monotonic() + 10
        while worker.readiness()[1] == "restoring the checkpoint" and time.monotonic() < deadline:
            time.sleep(0.01)
        ready, why = worker.readiness()
        assert not ready
        assert named in why
        # Still serving: a commit made now is published.
        directory = committed(root, "step-8", 8)
        commit(directory, 8)
        while time.monotonic() < deadline:
            status = _protocol.read_status(directory)
            if status is not None and status.phase == "uploaded":
                break
            time.sleep(0.01)
        else:
            pytest.fail("the agent stopped serving after the malformed manifest")
        assert worker._thread is not None and worker._thread.is_alive()
    finally:
        worker.stop(timeout=10)
    assert said and said[-1][0] is False
    assert os.path.exists(root)


def test_a_marker_that_is_a_directory_fails_that_checkpoint_and_the_others_upload(
    root: Path, store: Path
) -> None:
    scratch = committed(root, "scratch", 0)
    (scratch / _protocol.MARKER_NAME).mkdir()
    directory = committed(root, "step-1", 1)
    commit(directory, 1)
    assert agent(root, store).scan() == [1]
    status = _protocol.read_status(scratch)
    assert status is not None and status.phase == "failed" and not status.retryable
    assert f"{scratch / _protocol.MARKER_NAME}: expected a regular file" in str(status.error)


def test_a_status_file_that_is_a_directory_does_not_stop_the_other_uploads(
    root: Path, store: Path
) -> None:
    blocked = committed(root, "step-1", 1)
    commit(blocked, 1)
    _protocol.status_path(blocked).mkdir(parents=True)
    directory = committed(root, "step-2", 2)
    commit(directory, 2)
    worker = agent(root, store)
    assert worker.scan() == [2]
    # Uploaded once the trainer removes what it put in the status file's place.
    _protocol.status_path(blocked).rmdir()
    worker._retry_at.clear()
    assert worker.scan() == [1]


def test_protocol_files_nested_too_deeply_are_refused_and_the_agent_keeps_serving(
    root: Path, store: Path
) -> None:
    deep = "[" * 100_000
    scratch = committed(root, "scratch", 0)
    (scratch / _protocol.MARKER_NAME).write_text(deep)
    request = _protocol.request_path(root, "abc")
    request.write_text(deep)
    directory = committed(root, "step-1", 1)
    commit(directory, 1)
    _protocol.status_path(directory).parent.mkdir()
    _protocol.status_path(directory).write_text(deep)
    worker = agent(root, store)
    worker.serve_requests()
    assert worker.scan() == [1]
    status = _protocol.read_status(scratch)
    assert status is not None and status.phase == "failed" and "expected JSON" in str(status.error)
    assert json.loads(request.read_text())["phase"] == "failed"


def test_a_file_name_that_is_not_utf8_refuses_that_checkpoint_and_the_later_ones_upload(
    root: Path, store: Path
) -> None:
    directory = committed(root, "step-1", 1)
    with open(os.path.join(os.fsencode(directory), b"tokenizer-\xe9.json"), "wb") as f:
        f.write(b"{}")
    commit(directory, 1)
    later = committed(root, "step-2", 2)
    commit(later, 2)
    assert agent(root, store).scan() == [2]
    status = _protocol.read_status(directory)
    assert status is not None and status.phase == "failed" and not status.retryable
    assert "b'tokenizer-\\xe9.json'" in str(status.error) and "not UTF-8" in str(status.error)
    assert not list(store.glob("**/step-000000000001/**/*"))


def test_an_unexpected_error_in_one_checkpoint_is_recorded_and_the_others_upload(
    root: Path, store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = committed(root, "step-1", 1)
    commit(broken, 1)
    commit(committed(root, "step-2", 2), 2)
    real = uploader.upload

    def upload(fs: object, prefix: str, directory: Path, *args: object, **kw: object) -> object:
        if directory == broken:
            raise RuntimeError("a bug no check foresaw")
        return real(fs, prefix, directory, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(uploader, "upload", upload)
    worker = agent(root, store)
    assert worker.scan() == [2]
    status = _protocol.read_status(broken)
    assert status is not None and status.phase == "failed" and status.retryable
    assert "a bug no check foresaw" in str(status.error)
    # Retried later, like a store outage: once the fault is gone it is published.
    monkeypatch.setattr(uploader, "upload", real)
    worker._retry_at.clear()
    assert worker.scan() == [1]


def test_a_marker_in_digits_other_than_ascii_fails_that_checkpoint_and_the_others_upload(
    root: Path, store: Path
) -> None:
    scratch = committed(root, "step-0", 0)
    (scratch / _protocol.MARKER_NAME).write_text("²\n")
    commit(committed(root, "step-1", 1), 1)
    assert agent(root, store).scan() == [1]
    status = _protocol.read_status(scratch)
    assert status is not None and status.phase == "failed" and not status.retryable
    assert "expected JSON" in str(status.error)


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"dirs": ["a\x00b"]}, "dirs[0]"),
        ({"dirs": ["../up"]}, "escapes"),
        ({"dirs": ["model.bin"]}, "'model.bin' is listed as a file and as the directory"),
        ({"dirs": "opt"}, "expected 'dirs' to be a list"),
        ({"minor": -1}, "expected 'minor' to be an integer >= 0"),
    ],
)
def test_malformed_empty_directories_in_a_manifest_are_refused_naming_the_entry(
    store: Path, extra: dict[str, object], named: str
) -> None:
    files = [{"path": "model.bin", "size": 1, "sha256": SHA}]
    _hostile_manifest(store, files, **extra)
    raw = layout.read_json(pafs.LocalFileSystem(), layout.manifest_path(str(store), 7))
    with pytest.raises(layout.CorruptCheckpointError, match=re.escape(named)):
        layout.CheckpointManifest.from_json(raw, where="m")


def test_a_manifest_path_that_no_file_name_can_hold_is_refused(store: Path) -> None:
    _hostile_manifest(store, [{"path": "\ud800", "size": 1, "sha256": SHA}])
    raw = layout.read_json(pafs.LocalFileSystem(), layout.manifest_path(str(store), 7))
    with pytest.raises(layout.CorruptCheckpointError, match="not UTF-8"):
        layout.CheckpointManifest.from_json(raw, where="m")
