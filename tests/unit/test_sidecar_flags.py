"""`shardcache sidecar`'s flags: a bad value is refused by the flag's own parser (the
flag named, what it expects, exit 2), and `--help` shows each default and range."""

from __future__ import annotations

import argparse

import pytest
from shardcache_sidecar import cli

pytestmark = pytest.mark.unit


def sidecar_parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="shardcache")
    cli.register(top.add_subparsers(dest="command"))
    return top


def refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        sidecar_parser().parse_args(["sidecar", *argv])
    assert info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--log-level", "LOUD"], "argument --log-level: expected LEVEL or"),
        (["--log-level", "INFO,shardcache=LOUD"], "found 'LOUD' in 'INFO,shardcache=LOUD'"),
        (["--handoff-timeout", "nan"], "argument --handoff-timeout: expected finite seconds > 0"),
        (["--acquire-timeout", "nan"], "argument --acquire-timeout: expected finite seconds > 0"),
        (["--acquire-timeout", "inf"], "expected finite seconds > 0, found inf"),
        (["--source-retry-seconds", "nan"], "argument --source-retry-seconds: expected finite"),
        (["--source-retry-seconds", "inf"], "seconds >= 0 (0: no retries), found inf"),
        (["--control-threads", "0"], "argument --control-threads: expected an integer >= 1"),
        (["--mount", "../escaped"], "argument --mount: expected a DatasetMount name"),
        (["--mount", "a/b"], "found 'a/b'"),
        (["--shuffle", "ture"], "argument --shuffle: expected true or false"),
    ],
)
def test_a_bad_flag_is_refused_naming_the_flag_and_what_it_expects(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = refusal(argv, capsys)
    assert "shardcache sidecar: error: " in err
    assert message in err


@pytest.mark.parametrize(
    ("argv", "shuffle"),
    [
        ([], None),
        (["--shuffle"], True),
        (["--shuffle", "false"], False),
        (["--shuffle", "yes"], True),
        (["--no-shuffle"], False),
    ],
)
def test_a_boolean_flag_takes_a_value_or_none(argv: list[str], shuffle: bool | None) -> None:
    args = sidecar_parser().parse_args(["sidecar", *argv])
    assert args.shuffle is shuffle


def test_zero_seconds_of_source_retries_means_none() -> None:
    args = sidecar_parser().parse_args(["sidecar", "--source-retry-seconds", "0"])
    assert args.source_retry_seconds == 0.0


def test_help_shows_each_default_and_range(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        sidecar_parser().parse_args(["sidecar", "--help"])
    # argparse wraps lines; compare the words.
    text = " ".join(capsys.readouterr().out.split())
    for shown in (
        "default 2147483648 (2Gi)",  # --memory-limit
        "default 53687091200 (50Gi)",  # --disk-limit
        "default /var/cache/shardcache",  # --disk-dir
        "default 8470; range 0-65535",  # --metrics-port
        "default 8490; range 0-65535",  # --ui-port
        "default 4; range 0-1024",  # --prefetch-depth
        "default INFO",  # --log-level
        "default true",  # --shuffle
        "(default 600)",  # --acquire-timeout
        "(default 32; at least 1)",  # --control-threads
    ):
        assert shown in text, shown
