"""The checkpoint agent stops promptly when told to while its start-up restore is still
retrying an unreachable store: nothing was restored, so nothing waits for it, and the
standalone agent (`python -m shardcache_sidecar.checkpoint`) exits on SIGTERM/Ctrl-C
instead of sitting out the minute of the restore's retry budget."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from shardcache_sidecar.checkpoint import Agent, CheckpointSettings

from shardcache import contract

pytestmark = pytest.mark.integration

#: A store nothing listens on: every request is refused at once, which the restore
#: retries as a transient error for its whole budget (60 s by default).
UNREACHABLE = {
    "AWS_ENDPOINT_URL": "http://127.0.0.1:1",
    "AWS_ACCESS_KEY_ID": "a",
    "AWS_SECRET_ACCESS_KEY": "b",
    "AWS_REGION": "us-east-1",
}


def test_stopping_the_agent_ends_its_start_up_restore_retries(tmp_path: Path) -> None:
    settings = CheckpointSettings(directory=tmp_path / "ckpt", uri="s3://b/run")
    (tmp_path / "ckpt").mkdir()
    agent = Agent(settings, storage_options=UNREACHABLE)
    agent.start()
    time.sleep(1.0)  # well into the retries: the first try failed at once
    assert agent.readiness()[0] is False
    started = time.monotonic()
    agent.stop(timeout=30)
    assert time.monotonic() - started < 5.0
    assert not agent.wait_ready(0)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_the_standalone_agent_exits_on_a_signal_while_the_restore_retries(
    tmp_path: Path, sig: signal.Signals
) -> None:
    (tmp_path / "ckpt").mkdir()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("SHARDCACHE_")},
        **UNREACHABLE,
        contract.ENV_CHECKPOINT_URI: "s3://b/run",
        contract.ENV_CHECKPOINT_DIR: str(tmp_path / "ckpt"),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardcache_sidecar.checkpoint"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(3.0)
        assert proc.poll() is None, proc.communicate()
        started = time.monotonic()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=15)
        assert time.monotonic() - started < 10.0
        assert proc.returncode == 0, err
        assert "checkpoint restore stopped" in err
        assert "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
