"""`shardcache demo` (the README's `make demo`, here without MinIO: a `file://` source)
runs the main job end to end: a sidecar process, a trainer through it, a cold and a
warm epoch with the same checksum, the memory tier on tmpfs as in a pod, and nothing
left behind."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from shardcache_sidecar import demo

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
