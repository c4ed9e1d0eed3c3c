"""`shardcache sidecar` refuses what it cannot start with the way it refuses a bad
setting: exit 2 and one line that names the value, the flag and variable that set it
and what was expected or what the system said. Never a traceback."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from tests.support import datasets

pytestmark = pytest.mark.integration


@pytest.fixture
def dataset(tmp_path: Path) -> str:
    root = tmp_path / "ds"
    datasets.write_dataset(pafs.LocalFileSystem(), str(root), [100, 100])
    return f"file://{root}"


@pytest.fixture
def held_port() -> Iterator[int]:
    """A loopback port another process listens on (a second sidecar, say)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


def start(
    dataset: str,
    workdir: Path,
    *args: str,
    env: dict[str, str] | None = None,
    user: list[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SHARDCACHE_")}
    command = [
        *(user or []),
        sys.executable,
        "-m",
        "shardcache",
        "sidecar",
        "--source",
        dataset,
        "--run-dir",
        str(workdir / "run"),
        "--disk-dir",
        str(workdir / "disk"),
        "--metrics-host",
        "127.0.0.1",
        "--metrics-port",
        "0",
        "--ui-port",
        "0",
        "--log-format",
        "text",
        *args,
    ]
    return subprocess.run(
        command, env={**base, **(env or {})}, capture_output=True, text=True, timeout=60
    )


def refused(result: subprocess.CompletedProcess[str]) -> str:
    """The one line of a refusal (exit 2, no traceback)."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize("level", ["LOUD", "INFO,shardcache=LOUD", "INFO,nonsense"])
def test_a_bad_log_level_in_the_environment_is_refused(
    dataset: str, tmp_path: Path, level: str
) -> None:
    line = refused(start(dataset, tmp_path, env={"SHARDCACHE_LOG_LEVEL": level}))
    assert line.startswith("shardcache sidecar: $SHARDCACHE_LOG_LEVEL: expected LEVEL or")
    assert level.rsplit("=", 1)[-1].split(",")[-1] in line


def test_a_bad_log_level_flag_is_refused(dataset: str, tmp_path: Path) -> None:
    result = start(dataset, tmp_path, "--log-level", "LOUD")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "shardcache sidecar: error: argument --log-level: expected LEVEL" in result.stderr
    assert "found 'LOUD'" in result.stderr


def test_a_metrics_port_in_use_is_refused_naming_it(
    dataset: str, tmp_path: Path, held_port: int
) -> None:
    line = refused(start(dataset, tmp_path, "--metrics-port", str(held_port)))
    assert (
        f"cannot listen on 127.0.0.1:{held_port} (--metrics-port / $SHARDCACHE_METRICS_PORT): "
        "Address already in use"
    ) in line


def test_an_inspector_port_in_use_is_refused_naming_it(
    dataset: str, tmp_path: Path, held_port: int
) -> None:
    line = refused(start(dataset, tmp_path, "--ui-port", str(held_port)))
    assert f"cannot listen on 127.0.0.1:{held_port} (--ui-port / $SHARDCACHE_UI_PORT)" in line


def test_a_metrics_host_that_does_not_resolve_is_refused_naming_it(
    dataset: str, tmp_path: Path
) -> None:
    line = refused(start(dataset, tmp_path, "--metrics-host", "no-such-host.invalid"))
    assert (
        "cannot listen on no-such-host.invalid:0 (--metrics-host / $SHARDCACHE_METRICS_HOST)"
        in line
    )


def test_a_run_directory_that_cannot_be_made_is_refused_naming_it(
    dataset: str, tmp_path: Path
) -> None:
    (tmp_path / "run").write_text("a file where the run directory belongs")
    line = refused(start(dataset, tmp_path))
    assert line.startswith("shardcache sidecar: cannot create the control socket's directory")
    assert f"'{tmp_path / 'run' / 'default'}'" in line
    assert "--run-dir / $SHARDCACHE_RUN_DIR" in line


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv"
)
def test_a_run_directory_the_user_cannot_write_is_refused_naming_it(
    dataset: str, tmp_path: Path
) -> None:
    # As a non-root sidecar finds a run directory made for another user. (The refusal
    # comes before the source or the disk tier is touched.)
    (tmp_path / "run").mkdir(mode=0o755)
    (tmp_path / "disk").mkdir()
    os.chown(tmp_path / "disk", 65534, 65534)
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    line = refused(start(dataset, tmp_path, user=nobody))
    assert f"'{tmp_path / 'run' / 'default'}'" in line
    # As clear as the tier check's own text: the error, the user, what is there.
    assert "(PermissionError: Permission denied)" in line
    assert "this process runs as uid 65534, gid 65534" in line
    assert "owned by uid 0, gid 0" in line
