"""Every dataset command takes `--cache-dir`, so a command line carries over from one
to another: `shardcache diff` refused it ("unrecognized arguments"), though the
debugging walk-through (docs/debugging.md) runs `inspect`, `lineage` and `diff` over
one dataset and cache. diff reads no shard data, so nothing is made there."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardcache import cli
from tests.support import datasets

pytestmark = pytest.mark.unit


def test_diff_takes_the_cache_dir_the_other_commands_take(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    uri, _ = datasets.write_local(tmp_path / "ds", [20, 20])
    cache = tmp_path / "cache"
    status = cli.main(["diff", uri, "--cache-dir", str(cache), "--batch-size", "4"])
    assert status == 0, capsys.readouterr().err
    assert not cache.exists()  # nothing read through a cache
    status = cli.main(
        ["diff", uri, "--cache-dir", str(cache), "--a-batch-size", "4", "--b-batch-size", "5"]
    )
    assert status == 1, capsys.readouterr().err
