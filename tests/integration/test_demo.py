"""`shardcache demo` (the README's `make demo`, here without MinIO: a `file://` source)
runs the main job end to end: a sidecar process, a trainer through it, a cold and a
warm epoch with the same checksum, the memory tier on tmpfs as in a pod, and nothing
left behind."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from shardcache_sidecar import demo, launcher

from shardcache import manifests

pytestmark = pytest.mark.integration


def test_the_demo_reads_a_cold_and_a_warm_epoch_alike_and_leaves_nothing(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "shardcache", "demo", "--shards", "3", "--rows", "1500"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    epochs = re.findall(r"epoch (\d) \((cold|warm)\): 4,500 samples .*\(checksum (\d+)\)", out)
    assert [(e, kind) for e, kind, _ in epochs] == [("0", "cold"), ("1", "warm")], out
    assert epochs[0][2] == epochs[1][2] != "0"
    [(run_dir, why)] = re.findall(r"memory tier under (\S+) \((.*)\)", out)
    if why == "tmpfs, as in a pod":
        assert run_dir.startswith("/dev/shm/"), out
        assert 'shardcache_memory_tier_backing_info{filesystem="tmpfs"' in out
    else:  # `memory_backed_run_dir` found no room there (below)
        assert why == "no room on /dev/shm", out
    assert not Path(run_dir).exists(), "the demo left its run directory behind"


def test_the_memory_tier_goes_on_tmpfs_only_where_it_has_room_twice_over(tmp_path: Path) -> None:
    made = demo.memory_backed_run_dir(tmp_path, limit=1 << 20)
    assert made is not None and made.parent == tmp_path and made.is_dir()
    assert demo.memory_backed_run_dir(tmp_path, limit=1 << 60) is None
    assert demo.memory_backed_run_dir(tmp_path / "missing", limit=1) is None


def _demo(*args: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardcache", "demo", *args],
        capture_output=True,
        text=True,
        timeout=120,
        **kwargs,  # type: ignore[call-overload]
    )


@pytest.mark.parametrize("kind", ["missing", "not executable"])
def test_a_minio_path_that_is_not_an_executable_file_is_refused_not_replaced_by_file(
    kind: str, tmp_path: Path
) -> None:
    minio = tmp_path / "minio"
    if kind == "not executable":
        minio.write_text("#!/bin/sh\n")
    done = _demo("--minio", str(minio), "--shards", "1", "--rows", "10", cwd=tmp_path)
    found = "no such file" if kind == "missing" else "not an executable file"
    assert done.returncode == 2
    assert done.stderr == (
        f"shardcache demo: --minio {minio}: expected a MinIO binary, found {found}\n"
    )
    assert "file://" not in done.stdout


@pytest.mark.parametrize("flag", ["--shards", "--rows", "--batch-size", "--epochs"])
@pytest.mark.parametrize("value", ["0", "-3"])
def test_counts_below_one_are_refused_by_the_flag(flag: str, value: str, tmp_path: Path) -> None:
    done = _demo(f"{flag}={value}", cwd=tmp_path)
    assert done.returncode == 2
    assert f"argument {flag}: expected an integer >= 1, found {value}" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_sidecar_that_refuses_its_dataset_ends_the_wait_at_once_with_its_reason(
    tmp_path: Path,
) -> None:
    (tmp_path / "empty").mkdir()
    started = time.monotonic()
    with pytest.raises(SystemExit) as info:
        with launcher.sidecar((tmp_path / "empty").as_uri(), {}, tmp_path):
            pass
    assert time.monotonic() - started < 30  # not launcher.READY_TIMEOUT_S (120 s)
    assert str(info.value).startswith(
        f"the sidecar refuses to start: the dataset source is unusable: empty dataset at "
        f"'{(tmp_path / 'empty').as_uri()}'"
    )


def test_sigterm_stops_the_sidecar_and_removes_the_memory_tier_and_the_work_dir(
    tmp_path: Path,
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardcache", "demo", "--shards", "4", "--rows", "20000",
         "--epochs", "100000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own group: what it leaves running is findable
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("sidecar ready"):
                break
        [(run_dir, _)] = re.findall(r"memory tier under (\S+) \((.*)\)", "".join(lines))
        assert Path(run_dir).exists() and list(tmp_path.glob("shardcache-demo-*"))
        proc.terminate()
        assert proc.wait(60) == 128 + signal.SIGTERM
        left = subprocess.run(
            ["ps", "-o", "pid=,cmd=", "-s", str(proc.pid)], capture_output=True, text=True
        ).stdout.strip()
        assert left == "", f"left running: {left}"
        assert not Path(run_dir).exists(), "the memory tier was left behind"
        assert list(tmp_path.glob("shardcache-demo-*")) == [], "the work dir was left behind"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def test_the_generated_dataset_has_one_digest_whatever_the_run(tmp_path: Path) -> None:
    # docs/debugging.md's outputs are a function of the digest (the plan is).
    digests = set()
    for run in ("a", "b"):
        root = (tmp_path / run).as_uri()
        launcher.generate(root, {}, 2, 300)
        time.sleep(0.01)  # another write time, were it the identity
        digests.add(manifests.resolve(root).digest)
    assert len(digests) == 1
