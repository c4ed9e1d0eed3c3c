"""`Limits.bound()` (the disk limit a status and every metrics scrape report) listed
`.limits/` and tried a lock per declaration at each call: it now answers from its last
look for up to `BOUND_TTL_SECONDS` while the directory is unchanged, and looks again
at once when a declaration is made or removed."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from shardcache.node.tiers import _limits

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def looks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The directories `.limits/` was listed in (each a full look)."""
    seen: list[str] = []
    real = os.listdir

    def listdir(path: os.PathLike[str] | str) -> list[str]:
        seen.append(str(path))
        return real(path)

    monkeypatch.setattr(_limits.os, "listdir", listdir)
    return seen


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(time, "monotonic", c)
    return c


def test_bound_answers_from_its_last_look_for_about_a_second(
    tmp_path: Path, looks: list[str], clock: Clock
) -> None:
    big = _limits.Limits(tmp_path, 1000)
    assert big.effective() == 1000  # declares
    small = _limits.Limits(tmp_path, 300)
    looks.clear()
    assert [small.bound() for _ in range(50)] == [1000] * 50
    assert len(looks) == 1
    clock.now += _limits.BOUND_TTL_SECONDS
    assert small.bound() == 1000
    assert len(looks) == 2


def test_a_declaration_made_or_removed_is_seen_at_once(
    tmp_path: Path, looks: list[str], clock: Clock
) -> None:
    small = _limits.Limits(tmp_path, 300)
    assert small.effective() == 300
    assert small.bound() == 300
    big = _limits.Limits(tmp_path, 1000)
    big.effective()
    assert small.bound() == 1000  # same clock: the directory changed
    del big  # its finalizer removes its declaration
    assert small.bound() == 300
