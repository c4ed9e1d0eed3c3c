"""The sidecar's interpreter hands the GIL back to its event loop soon."""

from __future__ import annotations

import argparse
import os
import sys

import pytest
from shardcache_sidecar import cli

pytestmark = pytest.mark.unit


def test_the_sidecar_sets_a_short_switch_interval_before_anything_else(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    set_to: list[float] = []
    monkeypatch.setattr(sys, "setswitchinterval", set_to.append)
    for name in list(os.environ):
        if name.startswith("SHARDCACHE_"):
            monkeypatch.delenv(name)
    # No source configured: the run stops at its settings, after the interpreter's.
    assert cli.run(argparse.Namespace(command="sidecar", func=None)) == 2
    assert "shardcache sidecar:" in capsys.readouterr().err
    assert set_to == [cli.SWITCH_INTERVAL_S]
    assert cli.SWITCH_INTERVAL_S < 0.005  # below CPython's default, which it is for
