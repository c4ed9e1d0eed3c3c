"""A tiny run of `bench/gpu_device.sh` (`make bench-gpu` as the GPU machine runs it), so
the one prepared command does not rot: on a machine without CUDA it must still run end
to end, print the CPU side against its budget, and end with the documented RESULT line.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
CPU_SIDE = re.compile(
    r"^CPU side \(thread CPU time, no bytes copied\), rows=(\d+): reader (\d+) us/batch, "
    r"windows (\d+) us/batch .* per-batch path (\d+) us/batch; budget for 0\.8 of "
    r"[\d.]+ GB/s: (\d+) us/batch$",
    re.MULTILINE,
)


def test_the_prepared_gpu_command_runs_without_cuda_and_ends_with_result(tmp_path: Path) -> None:
    env = dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=sys.executable)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    args = ["--size", "16MiB", "--shards", "2", "--rows", "2048,4096", "--ranks", "1"]
    args += ["--passes", "1", "--root", str(tmp_path / "work")]
    done = subprocess.run(
        ["bash", "bench/gpu_device.sh", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert done.stdout.strip().splitlines()[-1] == (
        "RESULT gpu_feed_ratio=n/a tokens_per_s=n/a path=windows"
    )
    probes = CPU_SIDE.findall(done.stdout)
    assert [rows for rows, *_ in probes] == ["2048", "4096"], output[-4000:]
    for _, reader, windows, per_batch, budget in probes:
        assert int(reader) > 0 and int(windows) > 0 and int(per_batch) > 0 and int(budget) > 0
    # Sample mode's host side at the first batch size: the deferring reader, and the
    # device-gather path with its ops on the meta device, every batch gathered there.
    assert re.search(
        r"^CPU side, sample mode .*rows=2048: reader \(gather deferred\) \d+ us/batch, "
        r"device-gather path \(ops on the meta device\) \d+ us/batch",
        done.stdout,
        re.M,
    ), output[-4000:]
    report = json.loads((tmp_path / "out" / "bench-gpu.json").read_text())
    assert report["cpu_side"][0]["sample_gathered"] > 0
    # Without CUDA the block-mode paths are not verified (True: not failed); the sample
    # paths are, through the window path on the CPU.
    assert report["verified"] == {
        "windows": True,
        "torch-copies": True,
        "per-batch": True,
        "staged": True,
        "ordered": True,
        "sample-device": True,
        "sample-cpu-gather": True,
    }
    assert "VERIFY ok sample-device" in done.stdout, output[-4000:]
    assert "VERIFY ok sample-cpu-gather" in done.stdout, output[-4000:]
    assert [r["path"] for r in report["runs"]] == [
        "windows",
        "windows",
        "sample-device",
        "sample-cpu-gather",
    ]
    device, cpu_gather = report["runs"][2], report["runs"][3]
    assert device["device_gathered"] > 0 and device["cpu_gathered"] == 0
    assert 0 < device["gather_windows"] < device["device_gathered"]
    assert cpu_gather["device_gathered"] == cpu_gather["gather_windows"] == 0
    assert not device["fallback"] and not cpu_gather["fallback"]
    assert re.search(r"^SAMPLE K=1 rows=2048: sample-device .*x\) \(no CUDA", done.stdout, re.M)
    # Every run prints its steady rate (the median of passes 2-N, or pass N) and, where
    # the prefetcher copied, copies a batch and bytes copied over bytes handed over.
    assert re.search(
        r"^K=1 rows=2048 windows\s+steady \(pass 1\): [\d.]+ Gtokens/s", done.stdout, re.M
    )
    counts = re.search(
        r"^K=1 rows=2048 sample-device steady .*\n  copies a batch ([\d.]+) .*bytes copied / "
        r"used ([\d.]+)$",
        done.stdout,
        re.M,
    )
    assert counts is not None, output[-4000:]
    assert float(counts.group(1)) > 1 and float(counts.group(2)) >= 1
    assert (tmp_path / "out" / "bench-gpu.txt").read_text().strip().endswith("path=windows")
