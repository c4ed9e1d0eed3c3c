"""The `shardcache` command's own behaviour, apart from its subcommands."""

from __future__ import annotations

import argparse

import pytest

from shardcache import cli

pytestmark = pytest.mark.unit


def parser_running(func: object) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardcache")
    parser.set_defaults(func=func)
    return parser


def test_a_broken_pipe_that_is_not_stdout_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # A subcommand's socket to a peer that went away is a real failure: only a closed
    # stdout (`| head`) ends the command quietly.
    def talk_to_a_gone_peer(_: argparse.Namespace) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli, "build_parser", lambda: parser_running(talk_to_a_gone_peer))
    with pytest.raises(BrokenPipeError):
        cli.main([])


def test_the_subcommand_status_is_the_exit_status(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "build_parser", lambda: parser_running(lambda _: 3))
    assert cli.main([]) == 3


def test_every_registered_subcommand_is_listed() -> None:
    help_text = cli.build_parser().format_help()
    for name in ("inspect", "sidecar", "operator", "inject", "demo", "web"):
        assert name in help_text
