"""`shardcache inspect` as a real process over data that used to break it: escape
sequences in values and names, nanosecond times, 64-bit ids, a column named twice,
and a run's data state whose batch size the command must use."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import shardcache
from tests.support import inspect_data

pytestmark = pytest.mark.integration

ESC = "\x1b"
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def inspect(uri: str, cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardcache", "inspect", uri, "--cache-dir", str(cache), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    base = tmp_path_factory.mktemp("hostile")
    root = base / "ds"
    root.mkdir()
    table = pa.table(
        {
            "uid": [0, 1],
            "id": pa.array([2**64 - 1, 2**63 + 5], pa.uint64()),
            f"col{ESC}[8m": ["a\x9b", "b"],
            "turns": pa.array(
                [[{"role": f"user{ESC}[1A", "content": f"hi {ESC}[2J{ESC}]52;c;cm0K\x07"}]] * 2
            ),
            "meta": pa.array([{f"k{ESC}[31m": "\u202eexe"}] * 2),
            "ts": pa.array([1_700_000_000_123_456_789, 1], pa.timestamp("ns")),
            "took": pa.array([5, 6], pa.duration("ns")),
        }
    )
    pq.write_table(table, root / f"part{ESC}[2K.parquet")
    return root.as_uri(), base / "cache"


@pytest.mark.parametrize("form", [[], ["--json"]])
def test_output_holds_no_control_character_from_the_data(
    hostile: tuple[str, Path], form: list[str]
) -> None:
    proc = inspect(*hostile, "--batch-size", "2", "--no-shuffle", *form)
    assert proc.returncode == 0, proc.stderr
    assert not CONTROL.search(proc.stdout), proc.stdout
    assert "\\u001b" in proc.stdout
    if form:
        # The same JSON: escaped, not dropped.
        sample = json.loads(proc.stdout)["samples"][0]["values"]
        assert sample[f"col{ESC}[8m"]["value"] == "a\x9b"


def test_nanosecond_times_print_exactly(hostile: tuple[str, Path]) -> None:
    proc = inspect(*hostile, "--batch-size", "2", "--no-shuffle", "--columns", "ts,took", "--json")
    assert proc.returncode == 0, proc.stderr
    values = json.loads(proc.stdout)["samples"][0]["values"]
    assert values["ts"]["value"] == "2023-11-14T22:13:20.123456789"
    assert values["took"]["value"] == "5 ns"


def test_a_uint64_id_above_2_63_is_found(hostile: tuple[str, Path]) -> None:
    proc = inspect(*hostile, "--where", f"id == {2**64 - 1}", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["matches"] == 1
    proc = inspect(*hostile, "--where", "uid == 99999999999999999999")
    assert proc.returncode == 2
    assert "99999999999999999999 is out of range for column 'uid' (int64)" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_column_named_twice_is_shown_once(hostile: tuple[str, Path]) -> None:
    proc = inspect(*hostile, "--columns", "uid,uid", "--json")
    assert proc.returncode == 0, proc.stderr
    assert [c["name"] for c in json.loads(proc.stdout)["columns"]] == ["uid"]


def test_a_data_states_batch_size_is_the_steps_unless_contradicted(tmp_path: Path) -> None:
    uri = inspect_data.write(tmp_path / "ds").as_uri()
    cache = tmp_path / "cache"
    with shardcache.open(uri, cache_dir=cache, seed=2, block_size=16) as ds:
        handed = []
        for batch in ds.batches(7):
            handed.append(batch.column("uid").to_pylist())
            if len(handed) == 1:
                ds.skip_batches(2)
            if len(handed) == 4:
                break
        state = ds.state_dict()
    path = tmp_path / "state.json"
    path.write_text(json.dumps(state))
    plan = ["--seed", "2", "--block-size", "16", "--data-state", str(path), "--columns", "uid"]
    for step in (0, 1, 3):
        proc = inspect(uri, cache, *plan, "--step", str(step), "--json")
        assert proc.returncode == 0, proc.stderr
        got = [s["values"]["uid"]["value"] for s in json.loads(proc.stdout)["samples"]]
        assert got == handed[step], f"step {step}"
    proc = inspect(uri, cache, *plan, "--batch-size", "8")
    assert proc.returncode == 2
    assert "batch_size: state has 7, the inspector has 8" in proc.stderr
    assert inspect(uri, cache, *plan, "--batch-size", "7").returncode == 0
