"""A tiny run of `make bench-peers`'s harness, so the benchmark does not rot.

Only the torch-free loaders run here: shardcache embedded, shardcache through a real
sidecar process (memory tier on tmpfs, and on the local disk), plain pyarrow, and the
in-memory ceiling. MosaicML Streaming, LitData and the torch
DataLoader are not part of this smoke run: they need the `bench` extra (torch with its
CUDA runtime wheels, about 6 GiB installed and a new download for every fresh
environment), which `make test` does not install; docs/benchmarks.md records the cost.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TORCH_FREE = [
    "shardcache-sidecar-sample",
    "shardcache-sidecar",
    "shardcache-sidecar-disk",
    "shardcache-embedded-sample",
    "shardcache-embedded",
    "pyarrow",
    "in-memory-ceiling",
]


def _harness(
    tmp_path: Path, *extra: str, env: dict[str, str] | None = None
) -> tuple[int, str, dict[str, Any]]:
    out = tmp_path / "results.json"
    cmd = [
        sys.executable, "-m", "bench.peers.harness",
        "--size", "4MiB", "--file-size", "1MiB", "--batch-size", "64",
        "--root", str(tmp_path / "work"), "--loaders", "torch-free",
        "--json", str(out), *extra,
    ]  # fmt: skip
    done = subprocess.run(
        cmd,
        cwd=REPO,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=240,
    )
    results = json.loads(out.read_text()) if out.exists() else {}
    return done.returncode, done.stdout + done.stderr, results


def test_every_torch_free_loader_delivers_each_sample_once_and_result_is_last(
    tmp_path: Path,
) -> None:
    code, output, results = _harness(tmp_path, "--docs", str(tmp_path / "bench.md"))
    assert code == 0, output
    rows = {r["loader"]: r for r in results["rows"]}
    assert list(rows) == TORCH_FREE
    for name, row in rows.items():
        assert row["status"] == "ok", (name, row.get("failure"))
        assert row["cold_tps"] > 0 and row["warm_tps"] > 0
        assert row["peak_rss"] > 0 and row["peak_pss"] > 0
    # Every shardcache row resumes from saved state mid-epoch; pyarrow cannot.
    assert rows["shardcache-sidecar-sample"]["resume_ms"] is not None
    assert rows["shardcache-embedded-sample"]["resume_ms"] is not None
    assert rows["shardcache-sidecar"]["resume_ms"] is not None
    assert rows["shardcache-sidecar-disk"]["resume_ms"] is not None
    # Both sidecar rows had a memory tier, wherever it lived (tmpfs or the disk).
    assert rows["shardcache-sidecar"]["tier_bytes"] > 0
    assert rows["shardcache-sidecar-disk"]["tier_bytes"] > 0
    assert rows["shardcache-embedded"]["resume_ms"] is not None
    assert rows["pyarrow"]["resume_ms"] is None
    assert rows["in-memory-ceiling"]["resume_ms"] is None
    last = output.strip().splitlines()[-1]
    assert re.fullmatch(r"RESULT vs_mosaic=n/a vs_litdata=n/a vs_pyarrow=\d+\.\d\d", last), last
    doc = (tmp_path / "bench.md").read_text()
    assert "| shardcache-sidecar | block (4,096-row runs) |" in doc and last in doc
    assert "| shardcache-sidecar-sample | sample (65,536-row windows) |" in doc


def test_a_loader_that_loses_a_batch_is_reported_failed_not_measured(tmp_path: Path) -> None:
    code, output, results = _harness(tmp_path, env={"BENCH_PEERS_DROP_DELIVERY": "3"})
    assert code == 1, output
    for row in results["rows"]:
        assert row["status"] == "FAILED"
        assert "cold pass: samples: expected" in row["failure"]
        assert "cold_tps" not in row
    assert output.strip().splitlines()[-1] == (
        "RESULT vs_mosaic=n/a vs_litdata=n/a vs_pyarrow=FAILED"
    )
