"""`shardcache inspect` as a real process, checked against what `Dataset` yields."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from PIL import Image

import shardcache
from tests.support import inspect_data

pytestmark = pytest.mark.integration

WORLD, SEED, BATCH, BLOCK = 3, 11, 8, 16


@pytest.fixture(scope="module")
def dataset_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = inspect_data.write(tmp_path_factory.mktemp("inspect") / "ds")
    return root.as_uri()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


def inspect(uri: str, cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardcache", "inspect", uri, "--cache-dir", str(cache), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def plan_args(**overrides: int) -> list[str]:
    values = {"world-size": WORLD, "seed": SEED, "batch-size": BATCH, "block-size": BLOCK}
    values.update({k.replace("_", "-"): v for k, v in overrides.items()})
    return [a for k, v in values.items() for a in (f"--{k}", str(v))]


def reader_batches(
    uri: str, cache: Path, *, rank: int, epoch: int, **options: Any
) -> list[pa.RecordBatch]:
    with shardcache.open(
        uri, cache_dir=cache, seed=SEED, rank=rank, world_size=WORLD, block_size=BLOCK, **options
    ) as ds:
        ds.set_epoch(epoch)
        return [b for b in ds.batches(BATCH)]


@pytest.mark.parametrize(
    "rank,epoch,step",
    [(0, 0, 0), (1, 0, 3), (2, 1, 5), (1, 2, -1)],  # -1: the last, partial batch
)
def test_json_output_equals_what_the_reader_yields(
    dataset_uri: str, cache_dir: Path, rank: int, epoch: int, step: int
) -> None:
    batches = reader_batches(dataset_uri, cache_dir, rank=rank, epoch=epoch)
    step = step % len(batches)
    expected = batches[step].to_pylist()
    if step == len(batches) - 1:
        assert len(expected) < BATCH, "the data must end this rank's epoch on a partial batch"
    proc = inspect(
        dataset_uri,
        cache_dir,
        "--json",
        "--rank",
        str(rank),
        "--epoch",
        str(epoch),
        "--step",
        str(step),
        *plan_args(),
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["steps"] == len(batches)
    samples = data["samples"]
    assert len(samples) == len(expected)
    for sample, row in zip(samples, expected, strict=True):
        values: dict[str, Any] = sample["values"]
        # uid is the global index by construction: provenance is checked against data.
        assert sample["provenance"]["index"] == row["uid"] == values["uid"]["value"]
        shard = sample["provenance"]["shard_index"]
        assert sample["provenance"]["shard"] == f"part-{shard:05d}.parquet"
        assert values["text"] == {
            "kind": "text",
            "value": row["text"],
            "length": len(row["text"]),
            "truncated": False,
        }
        assert values["tokens"]["ids"] == row["tokens"]
        assert values["turns"]["rows"] == [[t["role"], t["content"]] for t in row["turns"]]
        if row["image"] is None:
            assert values["image"] == {"kind": "null"}
        else:
            with Image.open(io.BytesIO(row["image"])) as img:
                assert (values["image"]["width"], values["image"]["height"]) == img.size
                assert values["image"]["format"] == img.format.lower()
            assert values["image"]["bytes"] == len(row["image"])


def test_text_output_shows_provenance_and_decoded_tokens(
    dataset_uri: str, cache_dir: Path, tmp_path: Path
) -> None:
    tok = inspect_data.write_tokenizer(tmp_path / "tokenizer.json")
    batch = reader_batches(dataset_uri, cache_dir, rank=2, epoch=0)[1].to_pylist()
    proc = inspect(
        dataset_uri, cache_dir, "--rank", "2", "--step", "1", "--tokenizer", str(tok), *plan_args()
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "epoch 0 · rank 2/3 · step 1 of" in out
    for slot, row in enumerate(batch):
        assert f"[{slot}] index {row['uid']} · shard part-" in out
        assert f'decoded: "{row["text"][:200]}"' in out


def test_where_finds_the_epoch_rank_and_step_of_a_sample(dataset_uri: str, cache_dir: Path) -> None:
    proc = inspect(
        dataset_uri, cache_dir, "--json", "--where", "uid == 123", "--epochs", "3", *plan_args()
    )
    assert proc.returncode == 0, proc.stderr
    sightings = json.loads(proc.stdout)["sightings"]
    assert [s["epoch"] for s in sightings] == [0, 1, 2]
    for s in sightings:
        batches = reader_batches(dataset_uri, cache_dir, rank=s["rank"], epoch=s["epoch"])
        assert batches[s["step"]].column("uid")[s["slot"]].as_py() == 123


#: A sample-mode window that spans shards and that no batch divides.
WINDOW = 45


@pytest.mark.parametrize(("rank", "epoch"), [(0, 0), (2, 1)])
def test_a_sample_mode_run_is_inspected_as_its_gathered_batches(
    dataset_uri: str, cache_dir: Path, rank: int, epoch: int
) -> None:
    batches = reader_batches(
        dataset_uri, cache_dir, rank=rank, epoch=epoch, shuffle="sample", window=WINDOW
    )
    sample_args = ["--granularity", "sample", "--window", str(WINDOW), *plan_args()]
    for step in (0, len(batches) // 2, len(batches) - 1):
        proc = inspect(
            dataset_uri, cache_dir, "--json", "--rank", str(rank), "--epoch", str(epoch),
            "--step", str(step), *sample_args,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        data = json.loads(proc.stdout)
        assert data["steps"] == len(batches)
        got = [s["provenance"]["index"] for s in data["samples"]]
        assert got == batches[step].column("uid").to_pylist()
    uid = batches[-1].column("uid")[0].as_py()
    proc = inspect(dataset_uri, cache_dir, "--json", "--where", f"uid == {uid}", "--epoch",
                   str(epoch), *sample_args)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    [seen] = json.loads(proc.stdout)["sightings"]
    assert (seen["rank"], seen["step"], seen["slot"]) == (rank, len(batches) - 1, 0)


def test_where_with_no_match_exits_nonzero(dataset_uri: str, cache_dir: Path) -> None:
    proc = inspect(dataset_uri, cache_dir, "--where", "uid == 100000", *plan_args())
    assert proc.returncode == 1
    assert "0 sample(s) match" in proc.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--step", "1000"],
            "step 1000 is past the end of epoch 0 for rank 0: expected 0 <= step <",
        ),
        (["--rank", "3"], "rank 3 is out of range: expected 0 <= rank < world size 3"),
        (["--columns", "uid,nope"], "unknown column(s) ['nope']: the dataset has ['uid', 'text'"),
        (["--where", "uid = 3"], "cannot parse --where 'uid = 3'"),
        (["--where", "nope == 3"], "unknown column(s) ['nope'] in --where"),
        (["--batch-size", "0"], "batch size must be >= 1, got 0"),
        (["--where", "uid == 3", "--limit", "0"], "--limit must be >= 1, got 0"),
        (["--where", "uid == 3", "--limit", "-1"], "--limit must be >= 1, got -1"),
    ],
)
def test_bad_arguments_give_a_clear_error_and_a_nonzero_exit(
    dataset_uri: str, cache_dir: Path, args: list[str], message: str
) -> None:
    proc = inspect(dataset_uri, cache_dir, *plan_args(), *args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr


def test_output_into_a_pipe_closed_early_ends_quietly_like_head_expects(
    dataset_uri: str, cache_dir: Path
) -> None:
    # `shardcache inspect ... --json | head -1`: the whole epoch as one step is some
    # 270 KB, well past what a pipe buffers (64 KiB), so the writer is still writing
    # when its reader goes away.
    with subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shardcache",
            "inspect",
            dataset_uri,
            "--cache-dir",
            str(cache_dir),
            "--json",
            "--batch-size",
            "200",
            "--max-chars",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.readline() == b"{\n"
        proc.stdout.close()
        stderr = proc.stderr.read().decode()
        proc.wait(timeout=120)
    assert stderr == ""
    # As a shell reports a process that SIGPIPE ended (128 + 13).
    assert proc.returncode == 141


def test_missing_dataset_is_a_clear_error(tmp_path: Path, cache_dir: Path) -> None:
    proc = inspect((tmp_path / "nothing").as_uri(), cache_dir)
    assert proc.returncode == 2
    assert "nothing found at" in proc.stderr


def test_inspecting_does_not_steer_the_prefetcher(dataset_uri: str, tmp_path: Path) -> None:
    from shardcache.inspect import session

    insp = session.open_uri(dataset_uri, cache_dir=str(tmp_path / "cache"))
    try:
        insp.rows.read(2)
        node = insp.rows._provider.node  # type: ignore[attr-defined]
        (reader,) = node.reader_ids()
        assert node.upcoming(reader, 10) == []
    finally:
        insp.close()


# --- a run's data states (--data-state) ---------------------------------------------

#: `shardcache.open`'s shuffle and the inspector's options for each mode.
MODES: dict[str, tuple[dict[str, Any], list[str]]] = {
    "block": ({}, []),
    "sample": (
        {"shuffle": "sample", "window": WINDOW},
        ["--granularity", "sample", "--window", str(WINDOW)],
    ),
    "off": ({"shuffle": False}, ["--no-shuffle"]),
}


def uids(batch: pa.RecordBatch) -> list[int]:
    got: list[int] = batch.column("uid").to_pylist()
    return got


def resumed_run(
    uri: str, cache: Path, out: Path, options: dict[str, Any]
) -> tuple[list[Path], dict[int, list[list[int]]], set[int]]:
    """Epoch 0 of a 3-rank run: each rank reads 3 batches (rank 1 skips 1 after its
    first); then 2 ranks resume from all three states (an elastic resume) and read the
    epoch out, new rank 0 skipping 2 batches after its third. Each new rank's state
    file at the end, the batches each was handed, and the uids the old ranks read."""
    old, consumed = [], set()
    for rank in range(WORLD):
        with shardcache.open(
            uri, cache_dir=cache, seed=SEED, rank=rank, world_size=WORLD, block_size=BLOCK,
            **options,
        ) as ds:  # fmt: skip
            batches = ds.batches(BATCH)
            for i in range(3):
                consumed.update(uids(next(batches)))
                if rank == 1 and i == 0:
                    ds.skip_batches(1)
            old.append(ds.state_dict())
            batches.close()
    paths, handed = [], {}
    for rank in range(2):
        with shardcache.open(
            uri, cache_dir=cache, seed=SEED, rank=rank, world_size=2, block_size=BLOCK,
            **options,
        ) as ds:  # fmt: skip
            ds.load_state_dict(old)
            got: list[list[int]] = []
            for batch in ds.batches(BATCH):
                got.append(uids(batch))
                if rank == 0 and len(got) == 3:
                    ds.skip_batches(2)
            handed[rank] = got
            paths.append(out / f"state-{rank}.json")
            paths[-1].write_text(json.dumps(ds.state_dict()))
    return paths, handed, consumed


@pytest.mark.parametrize("mode", MODES)
def test_data_states_of_an_elastic_resume_show_what_the_resumed_ranks_read(
    dataset_uri: str, cache_dir: Path, tmp_path: Path, mode: str
) -> None:
    options, mode_args = MODES[mode]
    paths, handed, consumed = resumed_run(dataset_uri, cache_dir, tmp_path, options)
    state_args = [a for p in paths for a in ("--data-state", str(p))]
    args = [*plan_args(world_size=2), *mode_args, *state_args, "--columns", "uid"]
    for rank, step in [(0, 0), (0, 3), (1, len(handed[1]) - 1)]:
        proc = inspect(dataset_uri, cache_dir, "--json", "--rank", str(rank), "--step",
                       str(step), *args)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        data = json.loads(proc.stdout)
        got = [s["values"]["uid"]["value"] for s in data["samples"]]
        assert (got, data["steps"]) == (handed[rank][step], len(handed[rank])), (rank, step)
    proc = inspect(dataset_uri, cache_dir, "--json", "--where", "uid >= 0", "--limit", "1000",
                   *args)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)["sightings"]
    read = {
        (s["rank"], s["step"], s["slot"]): s["index"]
        for s in found
        if not (s["skipped"] or s["before_resize"])
    }
    assert {
        (rank, step, slot): uid
        for rank, batches in handed.items()
        for step, batch in enumerate(batches)
        for slot, uid in enumerate(batch)
    } == read
    before = {s["index"] for s in found if s["before_resize"]}
    skipped = {s["index"] for s in found if s["skipped"]}
    # Before the resize: what the old ranks read, and the batch old rank 1 skipped.
    assert consumed <= before and len(before - consumed) == BATCH
    assert len(skipped) == 2 * BATCH  # new rank 0's 2 batches
    assert len(before) + len(skipped) + len(read) == len(found) == sum(inspect_data.SHARD_ROWS)


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--world-size", "2"], "world_size: state has 3, the inspector has 2"),
        (["--seed", "12"], f"seed: state has {SEED}, the inspector has 12"),
        (["--no-shuffle"], "shuffle: state has True, the inspector has False"),
        (["--granularity", "sample"], "granularity: state has 'block', the inspector has 'sample'"),
    ],
)
def test_a_data_state_of_another_plan_is_refused_naming_both_values(
    dataset_uri: str, cache_dir: Path, tmp_path: Path, args: list[str], named: str
) -> None:
    with shardcache.open(
        dataset_uri, cache_dir=cache_dir, seed=SEED, rank=0, world_size=WORLD, block_size=BLOCK
    ) as ds:
        ds.skip_batches(1, batch_size=BATCH)
        (tmp_path / "state.json").write_text(json.dumps(ds.state_dict()))
    proc = inspect(dataset_uri, cache_dir, *plan_args(), *args, "--data-state",
                   str(tmp_path / "state.json"))  # fmt: skip
    assert proc.returncode == 2, proc.stdout
    assert named in proc.stderr and "state.json" in proc.stderr
    assert proc.stdout == ""


def test_a_data_state_of_another_dataset_is_refused_naming_both_digests(
    dataset_uri: str, cache_dir: Path, tmp_path: Path
) -> None:
    other = inspect_data.write(tmp_path / "other", (30, 30)).as_uri()
    with shardcache.open(
        other, cache_dir=cache_dir, seed=SEED, rank=0, world_size=WORLD, block_size=BLOCK
    ) as ds:
        ds.skip_batches(1, batch_size=BATCH)
        (tmp_path / "state.json").write_text(json.dumps(ds.state_dict()))
        theirs = ds.manifest.digest
    proc = inspect(dataset_uri, cache_dir, *plan_args(), "--data-state",
                   str(tmp_path / "state.json"))  # fmt: skip
    assert proc.returncode == 2, proc.stdout
    assert f"digest: state has '{theirs}', the inspector has 'sha256:" in proc.stderr


def test_a_mixtures_state_is_refused_pointing_at_its_sources_states(
    dataset_uri: str, cache_dir: Path, tmp_path: Path
) -> None:
    a = shardcache.open(dataset_uri, cache_dir=cache_dir, seed=SEED, block_size=BLOCK)
    b = shardcache.open(dataset_uri, cache_dir=cache_dir, seed=SEED + 1, block_size=BLOCK)
    with shardcache.mix({"web": a, "code": b}, weights={"web": 1, "code": 1}, seed=0) as mixed:
        batches = mixed.batches(BATCH)
        next(batches)
        state = mixed.state_dict()
        batches.close()
    (tmp_path / "mix.json").write_text(json.dumps(state))
    proc = inspect(dataset_uri, cache_dir, "--seed", str(SEED), "--block-size", str(BLOCK),
                   "--data-state", str(tmp_path / "mix.json"))  # fmt: skip
    assert proc.returncode == 2, proc.stdout
    assert "this is a mixture's state (shardcache.mix, sources ['code', 'web'])" in proc.stderr
    assert "state['sources']['code']" in proc.stderr and "lacks" not in proc.stderr
