"""A sidecar whose checkpoint drain is cut off (an upload stuck on a store that stopped
answering, past $SHARDCACHE_CHECKPOINT_DRAIN_SECONDS) exits 1, with the steps it did not
upload in its termination message: it logged them and exited 0, so `kubectl describe`
showed a clean exit for a checkpoint that never reached the store."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from shardcache import checkpoint, contract
from tests.integration.test_checkpoint_agent_drain import stalling_endpoint
from tests.support import datasets
from tests.support.sidecar import SidecarProcess

pytestmark = pytest.mark.integration


def test_a_drain_cut_off_exits_nonzero_naming_what_was_not_uploaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "ds"
    datasets.write_dataset(pafs.LocalFileSystem(), str(source), [100])
    root = tmp_path / "ckpt"
    (root / "step-7").mkdir(parents=True)
    (root / "step-7" / "model.bin").write_bytes(b"weights" * 1000)
    monkeypatch.setenv(contract.ENV_CHECKPOINT_DIR, str(root))
    checkpoint.commit(root / "step-7", step=7)
    message = tmp_path / "termination-log"
    message.write_text("")
    (tmp_path / "work").mkdir()
    with stalling_endpoint() as endpoint:
        env = {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "a",
            "AWS_SECRET_ACCESS_KEY": "b",
            "AWS_REGION": "us-east-1",
            contract.ENV_CHECKPOINT_URI: "s3://b/run",
            contract.ENV_CHECKPOINT_DIR: str(root),
            contract.ENV_CHECKPOINT_DRAIN: "2",
            "SHARDCACHE_TERMINATION_MESSAGE_PATH": str(message),
        }
        proc = SidecarProcess(f"file://{source}", workdir=tmp_path / "work", env=env)
        proc.extra_env = {**{k: v for k, v in os.environ.items() if k.startswith("AWS_")}, **env}
        try:
            proc.start()
            time.sleep(1.0)  # its restore is waiting on the endpoint
            started = time.monotonic()
            code = proc.stop()
            took = time.monotonic() - started
            log = proc.log_tail()
        finally:
            proc.cleanup()
    assert code == 1, log
    assert took < 20, took
    text = message.read_text()
    assert text.startswith(
        f"checkpoint agent: drain cut off after 2s ({contract.ENV_CHECKPOINT_DRAIN}); "
        f"not uploaded: step 7 in {root / 'step-7'}"
    ), text
    assert (root / "step-7").is_dir()  # the next sidecar uploads it
