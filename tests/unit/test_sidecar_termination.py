"""What a sidecar writes to its termination message, and where it may write it."""

from __future__ import annotations

from pathlib import Path

import pytest
from shardcache_sidecar import configuration, termination
from shardcache_sidecar.server import lifecycle, replies, running

from shardcache.contract import protocol

pytestmark = pytest.mark.unit


def sidecar(tmp_path: Path) -> lifecycle.Sidecar:
    settings = configuration.from_env(
        {}, overrides={"source_uri": "file:///data", "run_dir": str(tmp_path / "run")}
    )
    return lifecycle.Sidecar(settings)


def test_unusable_tiers_and_refusals_are_exit_reasons_and_serving_is_not(tmp_path: Path) -> None:
    made = sidecar(tmp_path)
    assert running.exit_reason(made) is None  # still starting: nothing to say
    made.tier_problems = {"disk": "the disk tier /d is not usable: ..."}
    assert running.exit_reason(made) == (
        "the sidecar could not start: the disk tier /d is not usable: ..."
    )
    made.tier_problems = {}
    made.problem = replies.Problem(
        409, protocol.KIND_INPUT, "digest_mismatch", "the pinned digest differs"
    )
    assert running.exit_reason(made) == "the sidecar refused to serve: the pinned digest differs"
    made.problem = None
    assert running.exit_reason(made) is None


def test_a_message_replaces_the_file_and_is_held_to_the_kubelets_limit(tmp_path: Path) -> None:
    path = tmp_path / "termination-log"
    path.write_text("an older message, longer than the new one")
    assert termination.write(path, "why")
    assert path.read_text() == "why"
    assert termination.write(path, "é" * 5000)
    data = path.read_bytes()
    assert len(data) <= termination.LIMIT_BYTES and data.endswith(b" [...]")
    data.decode()  # cut at a character boundary


def test_a_missing_file_is_not_created_and_the_default_is_the_kubelets(tmp_path: Path) -> None:
    assert not termination.write(tmp_path / "absent", "why")
    assert not (tmp_path / "absent").exists()
    assert termination.path_from({}) == Path("/dev/termination-log")
    env = {"SHARDCACHE_TERMINATION_MESSAGE_PATH": str(tmp_path / "t")}
    assert termination.path_from(env) == tmp_path / "t"
