"""`shardcache web`: a port out of range, a plan option no page could use and a cache
directory it cannot create are refused at start, in one line with exit status 2 (not a
traceback, nor an error on every request)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardcache import cli

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("port", "found"),
    [("99999", "an integer 0-65535, found 99999"), ("-1", "an integer 0-65535, found -1")],
)
def test_a_port_outside_0_to_65535_is_refused_by_the_flag(
    port: str, found: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["web", tmp_path.as_uri(), f"--port={port}"])
    assert info.value.code == 2
    assert f"argument --port: expected {found}" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--batch-size", "--world-size", "--block-size", "--window"])
def test_a_plan_option_below_one_is_refused_before_serving(
    flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = cli.main(["web", tmp_path.as_uri(), flag, "0"])
    assert status == 2
    assert capsys.readouterr().err == f"shardcache web: {flag} must be >= 1, got 0\n"


def test_a_cache_directory_it_cannot_create_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("")
    cache = tmp_path / "file" / "cache"
    status = cli.main(["web", tmp_path.as_uri(), "--cache-dir", str(cache)])
    assert status == 2
    assert capsys.readouterr().err == (
        f"shardcache web: --cache-dir {cache}: cannot create it: Not a directory\n"
    )
