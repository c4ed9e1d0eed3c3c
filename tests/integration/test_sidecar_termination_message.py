"""Why a sidecar exits, in its container's termination message (`kubectl describe pod`).

A sidecar whose tier directories were unusable showed only the kubelet's startup-probe
503s in `describe`: the reason sat in /readyz and the log. Now the reason it never
served, and any refusal at start (bad settings, a port in use), is written to the file
$SHARDCACHE_TERMINATION_MESSAGE_PATH names (the kubelet's /dev/termination-log), only
when that file exists. And a refused start leaves no directories behind.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from shardcache_sidecar import configuration
from shardcache_sidecar.server import running

from shardcache import errors
from tests.support import datasets
from tests.support.sidecar import SidecarProcess

pytestmark = pytest.mark.integration

ENV = "SHARDCACHE_TERMINATION_MESSAGE_PATH"


@pytest.fixture
def dataset(tmp_path: Path) -> str:
    root = tmp_path / "ds"
    datasets.write_dataset(pafs.LocalFileSystem(), str(root), [100, 100])
    return f"file://{root}"


@pytest.fixture
def message_file(tmp_path: Path) -> Path:
    """An empty file, as the kubelet makes one in every container."""
    path = tmp_path / "termination-log"
    path.write_text("")
    return path


@pytest.fixture
def held_port() -> Iterator[int]:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


def start(
    dataset: str, workdir: Path, *args: str, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SHARDCACHE_")}
    command = [
        sys.executable, "-m", "shardcache", "sidecar", "--source", dataset,
        "--run-dir", str(workdir / "run"), "--disk-dir", str(workdir / "disk"),
        "--metrics-host", "127.0.0.1", "--metrics-port", "0", "--ui-port", "0",
        "--log-format", "text", *args,
    ]  # fmt: skip
    return subprocess.run(command, env={**base, **env}, capture_output=True, text=True, timeout=60)


def test_a_bad_setting_is_the_termination_message(
    dataset: str, tmp_path: Path, message_file: Path
) -> None:
    result = start(dataset, tmp_path, env={ENV: str(message_file), "SHARDCACHE_LOG_LEVEL": "LOUD"})
    assert result.returncode == 2, result.stderr
    message = message_file.read_text()
    assert message.startswith("shardcache sidecar: $SHARDCACHE_LOG_LEVEL: expected LEVEL")
    assert "'LOUD'" in message or "LOUD" in message


def test_a_port_in_use_is_the_termination_message_and_leaves_no_directories(
    dataset: str, tmp_path: Path, message_file: Path, held_port: int
) -> None:
    result = start(
        dataset, tmp_path, "--metrics-port", str(held_port), env={ENV: str(message_file)}
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    message = message_file.read_text()
    assert f"cannot listen on 127.0.0.1:{held_port} (--metrics-port" in message, message
    # The run directory, the socket's and the memory tier's were made for this start
    # only: taken back with it.
    assert not (tmp_path / "run").exists(), sorted(p for p in (tmp_path / "run").rglob("*"))


def test_a_refused_start_keeps_a_run_directory_that_was_there(
    dataset: str, tmp_path: Path, held_port: int
) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "keep").write_text("someone's")
    result = start(dataset, tmp_path, "--metrics-port", str(held_port), env={})
    assert result.returncode == 2, result.stderr
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["keep"]


def test_a_termination_message_path_that_does_not_exist_is_not_created(
    dataset: str, tmp_path: Path
) -> None:
    missing = tmp_path / "no-such-dir-made" / "termination-log"
    absent = tmp_path / "termination-log"
    for path in (missing, absent):
        result = start(dataset, tmp_path, env={ENV: str(path), "SHARDCACHE_LOG_LEVEL": "LOUD"})
        assert result.returncode == 2
        assert "Traceback" not in result.stderr, result.stderr
        assert len([line for line in result.stderr.splitlines() if line.strip()]) == 1
        assert not path.exists()


def test_unusable_tier_directories_are_the_termination_message_when_the_sidecar_is_stopped(
    dataset: str, tmp_path: Path, message_file: Path
) -> None:
    """As when the kubelet gives up on the startup probe: SIGTERM while not ready."""
    (tmp_path / "not-a-directory").write_text("a file where the node directory's parent is")
    (tmp_path / "work").mkdir()
    proc = SidecarProcess(dataset, workdir=tmp_path / "work", env={ENV: str(message_file)})
    proc.disk_dir = tmp_path / "not-a-directory" / "disk"
    try:
        proc.start()
        deadline = time.monotonic() + 30
        reason = ""
        while "not usable" not in reason and time.monotonic() < deadline:
            _, body = proc.http_get("/readyz")
            reason = {c["name"]: c for c in body["checks"]}["tiers"]["reason"]
            time.sleep(0.1)
        assert "not usable" in reason, reason
        assert message_file.read_text() == ""  # nothing yet: it may still heal
        assert proc.stop() == 0
    finally:
        proc.cleanup()
    message = message_file.read_text()
    assert message.startswith("the sidecar could not start: the disk tier "), message
    assert f"{proc.disk_dir} is not usable" in message
    assert "this process runs as uid" in message


async def test_serving_a_memory_tier_that_cannot_be_made_is_refused_with_the_tier_checks_text(
    dataset: str, tmp_path: Path, held_port: int
) -> None:
    """`server.serve` without the CLI (which made the directories first) used to raise
    a bare OSError here; and a refusal after the directories took none of them back."""
    (tmp_path / "file").write_text("a file where the memory tier's parent belongs")
    settings = configuration.from_env(
        {},
        overrides={
            "source_uri": dataset,
            "run_dir": str(tmp_path / "run"),
            "disk_dir": str(tmp_path / "disk"),
            "memory_dir": str(tmp_path / "file" / "mem"),
            "metrics_host": "127.0.0.1",
            "metrics_port": 0,
            "ui_port": 0,
        },
    )
    with pytest.raises(errors.InputError) as raised:
        await running.serve(settings, asyncio.Event())
    text = str(raised.value)
    assert f"cannot create the memory tier '{tmp_path / 'file' / 'mem'}'" in text, text
    assert "(NotADirectoryError" in text and "this process runs as uid" in text, text
    assert not (tmp_path / "run").exists()  # the socket's directory, taken back

    settings = configuration.from_env(
        {},
        overrides={
            "source_uri": dataset,
            "run_dir": str(tmp_path / "run"),
            "disk_dir": str(tmp_path / "disk"),
            "metrics_host": "127.0.0.1",
            "metrics_port": held_port,
            "ui_port": 0,
        },
    )
    with pytest.raises(errors.InputError, match="cannot listen on"):
        await running.serve(settings, asyncio.Event())
    assert not (tmp_path / "run").exists()
