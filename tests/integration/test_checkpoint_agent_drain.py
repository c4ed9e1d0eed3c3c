"""The standalone checkpoint agent's drain after SIGTERM is bounded
($SHARDCACHE_CHECKPOINT_DRAIN_SECONDS): an upload stuck on a store that accepts the
connection and never answers does not keep the process alive past the pod's grace
period. It logs the steps it did not upload and exits 1; the markers stay for the next
agent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardcache import checkpoint, contract
from tests.support.stalling import stalling_endpoint

pytestmark = pytest.mark.integration


def test_a_stuck_upload_ends_the_drain_at_its_bound_naming_what_was_not_uploaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ckpt"
    (root / "step-7").mkdir(parents=True)
    (root / "step-7" / "model.bin").write_bytes(b"weights" * 1000)
    monkeypatch.setenv(contract.ENV_CHECKPOINT_DIR, str(root))
    checkpoint.commit(root / "step-7", step=7)
    with stalling_endpoint() as endpoint:
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("SHARDCACHE_")},
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "a",
            "AWS_SECRET_ACCESS_KEY": "b",
            "AWS_REGION": "us-east-1",
            contract.ENV_CHECKPOINT_URI: "s3://b/run",
            contract.ENV_CHECKPOINT_DIR: str(root),
            contract.ENV_CHECKPOINT_DRAIN: "2",
        }
        proc = subprocess.Popen(
            [sys.executable, "-m", "shardcache_sidecar.checkpoint"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            time.sleep(2.0)  # its restore is waiting on the endpoint
            assert proc.poll() is None, proc.communicate()
            started = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=30)
            took = time.monotonic() - started
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 1, err
    assert 1.5 <= took < 10.0, (took, err)
    assert (
        f"checkpoint agent: drain cut off after 2s ({contract.ENV_CHECKPOINT_DRAIN}); "
        f"not uploaded: step 7 in {root / 'step-7'}"
    ) in err
    assert "Traceback" not in err
    # The commit is still there for the next agent.
    assert (root / "step-7").is_dir()
