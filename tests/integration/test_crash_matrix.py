"""The crash matrix, representative set: one SIGKILL at every named fault point, the
process restarted, the invariants checked (tests/support/crashes.py says which).

`make soak` runs the same episodes at randomized points and counts (>= 100 kills);
docs/faults.md reports its last run.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shardcache import faultpoints
from tests.support import crashes
from tests.support.s3server import S3Server

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("point", crashes.CHECKPOINT_POINTS)
def test_a_checkpoint_agent_killed_at_each_step_loses_and_exposes_nothing(
    point: str, s3_server: S3Server, s3_bucket: str, tmp_path: Path
) -> None:
    # The middle of each point's reaches: a kill with work both done and left.
    count = (crashes.CHECKPOINT_REACHES[point] + 1) // 2
    outcome = crashes.checkpoint_episode(s3_server, s3_bucket, tmp_path, point, count)
    assert outcome.checks


@pytest.mark.parametrize("point", ["checkpoint.latest", "checkpoint.status"])
def test_a_kill_around_the_pointer_on_the_last_commit_still_ends_with_latest_on_it(
    point: str, s3_server: S3Server, s3_bucket: str, tmp_path: Path
) -> None:
    """Nothing is published after the restart (its restore takes the last step from the
    node's own copy), so the agent must move a lagging pointer itself. The soak found
    this (seed 1768549564): `latest` stayed on step 2 with step 3 complete."""
    count = crashes.CHECKPOINT_REACHES[point]
    outcome = crashes.checkpoint_episode(s3_server, s3_bucket, tmp_path, point, count)
    assert "latest is the newest" in outcome.checks


@pytest.mark.parametrize("point", crashes.CACHE_POINTS)
def test_a_sidecar_killed_at_each_cache_step_serves_only_verified_rows(
    point: str, tmp_path: Path
) -> None:
    count = (crashes.CACHE_REACHES[point] + 1) // 2
    outcome = crashes.cache_episode(tmp_path, point, count)
    assert outcome.checks


def test_every_named_point_is_in_the_code_once_and_in_the_matrix() -> None:
    sources = [
        *(REPO / "shardcache").rglob("*.py"),
        *(REPO / "sidecar" / "shardcache_sidecar").rglob("*.py"),
    ]
    calls = re.compile(r'faultpoints\.reach\("([a-z.]+)"\)')
    found = [
        name
        for path in sources
        if path.name != "faultpoints.py"  # its docstring shows a call
        for name in calls.findall(path.read_text())
    ]
    assert sorted(found) == sorted(faultpoints.POINTS)
    assert sorted(crashes.CHECKPOINT_REACHES) == crashes.CHECKPOINT_POINTS
    assert sorted(crashes.CACHE_REACHES) == crashes.CACHE_POINTS


def test_an_unknown_point_is_refused_when_the_process_starts() -> None:
    with pytest.raises(ValueError, match="unknown point"):
        faultpoints._parse("cache.nowhere")
    with pytest.raises(ValueError, match=">= 1"):
        faultpoints._parse("cache.fetch:0")
    assert faultpoints._parse("cache.fetch:3") == ("cache.fetch", 3)
    assert faultpoints._parse(None) is None
