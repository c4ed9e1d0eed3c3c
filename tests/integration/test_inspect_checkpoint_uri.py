"""`shardcache inspect --checkpoint-uri` follows a published run as `shardcache web
--checkpoint-uri` does: a step is what each rank was handed (its skips honoured), at
the batch size the run's data states record. `inspect` had no such option: a run's
states had to be fetched by hand, one `--data-state` file per rank.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import inspect_data, web_inspector

pytestmark = pytest.mark.integration

WORLD, SEED, BATCH, BLOCK = 2, 5, 6, 16


def inspect(uri: str, cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardcache", "inspect", uri, "--cache-dir", str(cache), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[str, Path, Path, dict[int, list[list[int]]]]:
    base = tmp_path_factory.mktemp("inspect-ckpt")
    uri = inspect_data.write(base / "ds").as_uri()
    cache, store = base / "cache", base / "store"
    handed = web_inspector.record_run(
        uri, cache=cache, store=store, world_size=WORLD, batch_size=BATCH,
        seed=SEED, block_size=BLOCK,
    )  # fmt: skip
    return uri, cache, store, handed


def plan() -> list[str]:
    return ["--world-size", str(WORLD), "--seed", str(SEED), "--block-size", str(BLOCK)]


def step_uids(proc: subprocess.CompletedProcess[str]) -> tuple[list[int], dict[str, object]]:
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    return [int(s["values"]["uid"]["value"]) for s in data["samples"]], data


def test_steps_follow_the_published_run_at_its_batch_size_with_its_skips(
    run: tuple[str, Path, Path, dict[int, list[list[int]]]],
) -> None:
    uri, cache, store, handed = run
    # The step after the skip: the run's step N is the Nth batch it was handed.
    step = web_inspector.SKIP_AFTER
    for rank in range(WORLD):
        proc = inspect(
            uri, cache, *plan(), "--rank", str(rank), "--step", str(step), "--json",
            "--columns", "uid", "--checkpoint-uri", store.as_uri(),
        )  # fmt: skip
        uids, data = step_uids(proc)
        assert uids == handed[rank][step], (rank, uids, handed[rank][step])
        assert data["batch_size_from"] == "--checkpoint-uri"
        assert data["query"]["batch_size"] == BATCH  # type: ignore[index]
    # Without the run, the plan's step at an assumed batch size: other samples.
    uids, data = step_uids(
        inspect(uri, cache, *plan(), "--step", str(step), "--json", "--columns", "uid")
    )
    assert data["batch_size_from"] == "assumed"
    assert uids != handed[0][step]


def test_a_plan_the_run_never_read_says_so_and_follows_the_plan(
    run: tuple[str, Path, Path, dict[int, list[list[int]]]],
) -> None:
    uri, cache, store, _ = run
    proc = inspect(
        uri, cache, "--world-size", "3", "--seed", str(SEED), "--block-size", str(BLOCK),
        "--json", "--columns", "uid", "--checkpoint-uri", store.as_uri(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "no data state of the plan given" in proc.stderr, proc.stderr
    assert json.loads(proc.stdout)["batch_size_from"] == "assumed"


def test_data_state_files_and_a_checkpoint_uri_together_are_refused(
    run: tuple[str, Path, Path, dict[int, list[list[int]]]], tmp_path: Path
) -> None:
    uri, cache, store, _ = run
    state = tmp_path / "state.json"
    state.write_text("{}")
    proc = inspect(
        uri, cache, *plan(), "--data-state", str(state), "--checkpoint-uri", store.as_uri()
    )
    assert proc.returncode == 2
    assert "expected --data-state files or --checkpoint-uri" in proc.stderr, proc.stderr
    bare = inspect(uri, cache, *plan(), "--checkpoint-uri", str(store))
    assert bare.returncode == 2 and "--checkpoint-uri" in bare.stderr, bare.stderr
