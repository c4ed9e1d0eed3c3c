"""`shardcache lineage`'s argument checks and what it says of checkpoints it cannot
follow, without a run to follow."""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from shardcache import cli, errors
from shardcache.checkpoint import layout
from shardcache.lineage import published
from tests.support import datasets

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("limit", ["0", "-1"])
def test_a_where_limit_below_one_is_refused_before_anything_is_read(
    limit: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Neither the dataset nor the checkpoints exist: the check comes first.
    status = cli.main(
        ["lineage", (tmp_path / "ds").as_uri(), "--checkpoint-uri", (tmp_path / "ck").as_uri(),
         "--where", "uid == 3", "--limit", limit]
    )  # fmt: skip
    out = capsys.readouterr()
    assert status == 2
    assert out.err == f"shardcache lineage: --limit must be >= 1, got {limit}\n"
    assert out.out == ""


def test_a_checkpoint_carrying_a_mixtures_state_is_named_as_one(tmp_path: Path) -> None:
    mixed = {"version": 1, "kind": "mixture", "seed": 0, "step": 6, "batch_size": 4,
             "weights": [[0, {"a": 1.0, "b": 1.0}]], "sources": {"a": {}, "b": {}}}  # fmt: skip
    manifest = layout.CheckpointManifest(
        step=6, name="step-6", files=(), data_state=mixed, created_at=time.time()
    )
    fs = pafs.LocalFileSystem()
    layout.write_json(fs, layout.manifest_path(str(tmp_path), 6), manifest.to_json())
    with pytest.raises(errors.InputError) as info:
        published.chains(fs, str(tmp_path))
    message = str(info.value)
    assert "checkpoint step 6 carries a mixture's data state" in message
    assert "sources ['a', 'b']" in message and "lacks" not in message


@pytest.mark.parametrize(
    "args",
    [
        ["skip", "--step", "1", "--batches", "1", "--checkpoint-uri"],
        ["lineage", "file:///ds", "--where", "uid == 1", "--checkpoint-uri"],
        ["diff", "file:///ds", "--a-checkpoint-uri"],
        ["web", "file:///ds", "--checkpoint-uri"],
    ],
    ids=["skip", "lineage", "diff", "web"],
)
def test_a_mistyped_checkpoint_uri_is_refused_not_read_as_a_local_directory(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # s3//ckpt/run was the empty directory ./s3/ckpt/run: "step 1 is not published".
    with pytest.raises(SystemExit) as info:
        cli.main([*args, "s3//ckpt/run"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "checkpoint-uri: expected a URI scheme://path such as s3://bucket/prefix" in err
    assert "found 's3//ckpt/run': the scheme is not followed by '://'" in err


@pytest.mark.parametrize(
    "args",
    [
        ["skip", "--step", "1", "--batches", "1", "--checkpoint-uri"],
        ["lineage", "file:///ds", "--where", "uid == 1", "--checkpoint-uri"],
        ["diff", "file:///ds", "--a-checkpoint-uri"],
        ["web", "file:///ds", "--checkpoint-uri"],
    ],
    ids=["skip", "lineage", "diff", "web"],
)
def test_a_bare_local_checkpoint_path_is_refused_naming_its_file_uri(
    args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Every other URI setting needs scheme:// ($SHARDCACHE_CHECKPOINT_URI included): a
    # path taken here but refused there is a value that cannot be pasted across.
    with pytest.raises(SystemExit) as info:
        cli.main([*args, str(tmp_path)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "checkpoint-uri: expected a URI scheme://path such as s3://bucket/prefix" in err
    assert f"found '{tmp_path}', a local path: write it file://{tmp_path}" in err


def test_a_file_uri_checkpoint_store_is_taken(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = cli.main(
        ["skip", "--checkpoint-uri", tmp_path.as_uri(), "--step", "1", "--batches", "1"]
    )
    assert status == 2
    assert "checkpoint step 1 is not published (published steps: none)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("given", "named"),
    [
        (["--batch-size", "0"], "--batch-size"),
        (["--b-batch-size", "0"], "--b-batch-size"),
        (["--world-size", "0"], "--world-size"),
        (["--a-shuffle", "rows"], "--a-shuffle"),
        (["--shuffle", "rows"], "--shuffle"),
    ],
)
def test_diff_names_the_option_the_user_typed(
    given: list[str], named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    uri, _ = datasets.write_local(tmp_path / "ds", [10])
    status = cli.main(["diff", uri, *given])
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith(f"shardcache diff: {named} ") or err.startswith(
        f"shardcache diff: {named}: "
    )


def test_skip_says_a_range_past_the_epochs_end_is_cut_there() -> None:
    from shardcache.lineage import skip

    data = {
        "dry_run": True,
        "step": 200,
        "batches": 1_000_000_000,
        "ranks": [{"rank": None, "prefix": "/ck", "set_aside": [],
                   "skip": {"epoch": 0, "start": 6400, "stop": 32_000_006_400}}],
    }  # fmt: skip
    line = skip.text(data).splitlines()[1]
    assert (
        line == "  /ck: epoch 0 positions [6400, 32000006400) skipped, those before the epoch's end"
    )
