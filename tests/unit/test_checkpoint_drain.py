"""The agent's drain after a stop is bounded by its `drain_timeout`
($SHARDCACHE_CHECKPOINT_DRAIN_SECONDS): past it, `drain()` says False and logs each
committed step it did not upload, rather than waiting on a stuck upload forever."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
from shardcache_sidecar.checkpoint import agent, agent_config

from shardcache import checkpoint, contract, errors
from shardcache.checkpoint import _protocol
from shardcache.contract import variables

pytestmark = pytest.mark.unit


def _settings(tmp_path: Path, **env: str) -> agent_config.CheckpointSettings:
    settings = agent_config.CheckpointSettings.from_env(
        {
            contract.ENV_CHECKPOINT_URI: (tmp_path / "store").as_uri(),
            contract.ENV_CHECKPOINT_DIR: str(tmp_path / "ckpt"),
            **env,
        }
    )
    assert settings is not None
    return settings


def _commit(root: Path, step: int, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = root / f"step-{step}"
    path.mkdir(parents=True)
    (path / "model.bin").write_bytes(b"w" * 64)
    monkeypatch.setenv(contract.ENV_CHECKPOINT_DIR, str(root))
    checkpoint.commit(path, step=step)
    return path


def test_the_drain_bound_is_a_contract_setting_below_the_default_grace_period(
    tmp_path: Path,
) -> None:
    assert _settings(tmp_path).drain_timeout == variables.CHECKPOINT_DRAIN.default
    assert variables.CHECKPOINT_DRAIN.required_default < 30  # Kubernetes' default grace
    settings = _settings(tmp_path, **{contract.ENV_CHECKPOINT_DRAIN: "7.5"})
    assert settings.drain_timeout == 7.5


@pytest.mark.parametrize("text", ["inf", "nan", "0", "-1"])
def test_a_drain_bound_that_never_ends_or_never_starts_is_refused(
    tmp_path: Path, text: str
) -> None:
    with pytest.raises(
        errors.InputError, match=r"^\$SHARDCACHE_CHECKPOINT_DRAIN_SECONDS: expected finite seconds"
    ):
        _settings(tmp_path, **{contract.ENV_CHECKPOINT_DRAIN: text})


def test_unpublished_lists_committed_steps_not_uploaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ckpt"
    done = _commit(root, 3, monkeypatch)
    waiting = _commit(root, 5, monkeypatch)
    (root / "scratch").mkdir()  # no marker: still being written
    _protocol.write_status(done, _protocol.Status("uploaded", 3))
    running = agent.Agent(_settings(tmp_path))
    assert running.unpublished() == [(5, waiting)]


def test_a_drain_stuck_past_its_bound_returns_false_naming_what_was_not_uploaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    running = agent.Agent(_settings(tmp_path, **{contract.ENV_CHECKPOINT_DRAIN: "0.3"}))
    stuck = threading.Event()
    release = threading.Event()

    def scan() -> list[int]:  # an upload that never returns, as on a silent store
        stuck.set()
        release.wait(30)
        return []

    monkeypatch.setattr(running, "scan", scan)
    running.start()
    try:
        assert stuck.wait(10)
        waiting = _commit(root, 9, monkeypatch)
        with caplog.at_level(logging.ERROR, logger=agent.__name__):
            assert running.drain() is False
        assert (
            f"checkpoint agent: drain cut off after 0.3s ({contract.ENV_CHECKPOINT_DRAIN}); "
            f"not uploaded: step 9 in {waiting}"
        ) in caplog.messages
    finally:
        release.set()
    assert running.stop(10) is True


def test_a_drain_that_finishes_returns_true(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    running = agent.Agent(_settings(tmp_path))
    running.start()
    assert running.drain() is True
