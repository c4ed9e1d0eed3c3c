"""`shardcache inspect` says where a step's batch size came from: step N is batch N of
it, so one assumed (nothing said the run's) is said in the output, text and JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import shardcache
from tests.support import inspect_data

pytestmark = pytest.mark.integration


def inspect(uri: str, cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "shardcache", "inspect", uri, "--cache-dir", str(cache), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode in (0, 1), proc.stderr
    return proc


def test_a_batch_size_nothing_gave_is_said_to_be_assumed_and_a_given_one_is_not(
    tmp_path: Path,
) -> None:
    uri = inspect_data.write(tmp_path / "ds").as_uri()
    cache = tmp_path / "cache"
    plan = ["--seed", "2", "--block-size", "16", "--columns", "uid"]
    with shardcache.open(uri, cache_dir=cache, seed=2, block_size=16) as ds:
        next(iter(ds.batches(7)))
        state = ds.state_dict()
    with_size = tmp_path / "state.json"
    with_size.write_text(json.dumps(state))
    assert state.get("batch_size") == 7, state
    # An older state records no batch size: nothing says the run's.
    without = tmp_path / "old-state.json"
    without.write_text(json.dumps({k: v for k, v in state.items() if k != "batch_size"}))

    text = inspect(uri, cache, *plan).stdout
    assert "batch size 32 is assumed (the default)" in text, text
    assert "--batch-size" in text and "--data-state" in text
    data = json.loads(inspect(uri, cache, *plan, "--json").stdout)
    assert data["batch_size_from"] == "assumed"
    assert data["query"]["batch_size"] == 32
    where = inspect(uri, cache, *plan, "--where", "uid == 3")
    assert "batch size 32 is assumed" in where.stdout, where.stdout
    assert (
        json.loads(inspect(uri, cache, *plan, "--where", "uid == 3", "--json").stdout)[
            "batch_size_from"
        ]
        == "assumed"
    )
    old = inspect(uri, cache, *plan, "--data-state", str(without))
    assert "batch size 32 is assumed" in old.stdout, old.stdout

    given = inspect(uri, cache, *plan, "--batch-size", "7")
    assert "assumed" not in given.stdout and "batch size 7" in given.stdout
    data = json.loads(inspect(uri, cache, *plan, "--batch-size", "7", "--json").stdout)
    assert data["batch_size_from"] == "--batch-size"
    recorded = inspect(uri, cache, *plan, "--data-state", str(with_size))
    assert "assumed" not in recorded.stdout and "batch size 7" in recorded.stdout
    data = json.loads(inspect(uri, cache, *plan, "--data-state", str(with_size), "--json").stdout)
    assert data["batch_size_from"] == "--data-state"
    assert data["query"]["batch_size"] == 7
