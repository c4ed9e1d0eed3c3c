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
