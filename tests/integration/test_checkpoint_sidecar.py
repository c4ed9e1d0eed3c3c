"""Checkpoints through `shardcache sidecar` as a real process: SIGKILL mid-upload,
restore before /readyz, drain on SIGTERM.

MinIO is reached through the fault proxy so a test can slow every request down and
catch the upload in the middle.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from shardcache_operator import injection, specs
from shardcache_sidecar.checkpoint import Agent, CheckpointSettings

from shardcache import checkpoint, contract
from shardcache.checkpoint import _protocol, layout
from tests.support import datasets, rot
from tests.support.checkpoints import tree, write_checkpoint
from tests.support.faultproxy import FaultProxy
from tests.support.s3server import S3Server
from tests.support.sidecar import SidecarProcess

pytestmark = pytest.mark.integration

Factory = Callable[..., SidecarProcess]
STEP1 = {"model.bin": b"m1" * 50_000, "opt.bin": b"o1" * 1000}
# Large enough for a multipart upload of several parts, with small files beside it.
STEP2 = {
    "model.bin": hashlib.sha256(b"2").digest() * (96 << 15),
    "opt/a.bin": b"a" * 300_000,
    "opt/b.bin": b"b" * 10_000,
    "rng.json": b'{"seed": 2}',
}


def restore_elsewhere(s3_server: S3Server, uri: str, root: Path) -> int | None:
    """What a new pod on another node would restore (an agent in this process)."""
    settings = CheckpointSettings(directory=root, uri=uri)
    return Agent(settings, storage_options=s3_server.env()).restore().step


def publish_as_previous_pod(
    s3_server: S3Server, bucket: str, tmp_path: Path, steps: dict[int, dict[str, bytes]]
) -> None:
    """Steps a previous pod committed and its agent published to s3://bucket/run."""
    root = tmp_path / "previous-pod"
    agent = Agent(
        CheckpointSettings(directory=root, uri=f"s3://{bucket}/run"),
        storage_options=s3_server.env(),
    )
    for step, files in steps.items():
        checkpoint.commit(write_checkpoint(root, f"step-{step}", files), step=step)
        assert agent.scan() == [step]


def sidecar_with_checkpoints(
    factory: Factory, s3_server: S3Server, bucket: str, proxy: FaultProxy, root: Path
) -> SidecarProcess:
    datasets.write_dataset(s3_server.filesystem(), f"{bucket}/ds", [60, 40])
    env = {
        **s3_server.env(),
        "AWS_ENDPOINT_URL": proxy.endpoint_url,
        contract.ENV_CHECKPOINT_URI: f"s3://{bucket}/run",
        contract.ENV_CHECKPOINT_DIR: str(root),
        contract.ENV_CHECKPOINT_KEEP_LAST: "3",
        "SHARDCACHE_LOG_FORMAT": "text",
    }
    return factory(f"s3://{bucket}/ds", env=env)


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def test_sigkill_mid_upload_never_exposes_a_partial_checkpoint_and_a_restart_completes_it(
    sidecar_factory: Factory,
    s3_server: S3Server,
    s3_bucket: str,
    fault_proxy: FaultProxy,
    tmp_path: Path,
) -> None:
    root = tmp_path / "ckpt"
    uri = f"s3://{s3_bucket}/run"
    sidecar = sidecar_with_checkpoints(sidecar_factory, s3_server, s3_bucket, fault_proxy, root)
    sidecar.start(wait="ready")
    checkpoint.commit(write_checkpoint(root, "step-1", STEP1), step=1)
    checkpoint.wait(1, timeout=60, root=root)

    # Every request to the store now takes a second: the upload of step 2 is slow.
    fault_proxy.stall_next(100_000, 1.0)
    checkpoint.commit(write_checkpoint(root, "step-2", STEP2), step=2, data_state={"position": 2})
    fs = s3_server.filesystem()
    data_dir = f"{s3_bucket}/run/step-000000000002/data"
    manifest = layout.manifest_path(f"{s3_bucket}/run", 2)

    def some_objects_uploaded() -> bool:
        infos = fs.get_file_info(pafs.FileSelector(data_dir, recursive=True, allow_not_found=True))
        return any(i.type == pafs.FileType.File for i in infos)

    wait_until(some_objects_uploaded, 60, "the first objects of step 2")
    assert fs.get_file_info(manifest).type == pafs.FileType.NotFound, "upload was too fast"
    sidecar.kill()  # SIGKILL
    fault_proxy.clear_faults()

    # Part of step 2 is in the bucket, but it is not a checkpoint.
    assert layout.list_steps(fs, f"{s3_bucket}/run") == ([1], [2])
    assert layout.read_json(fs, layout.pointer_path(f"{s3_bucket}/run"))["step"] == 1  # type: ignore[index]
    assert restore_elsewhere(s3_server, uri, tmp_path / "other-1") == 1
    assert checkpoint.latest(root=root) == 1

    # The kubelet restarts the native sidecar: it restores step 1 (reusing the copy on
    # the node) and finishes uploading step 2.
    sidecar.start(wait="ready")
    checkpoint.wait(2, timeout=120, root=root)
    assert checkpoint.latest(root=root) == 2
    assert restore_elsewhere(s3_server, uri, tmp_path / "other-2") == 2
    assert tree(tmp_path / "other-2" / "step-2") == STEP2
    assert checkpoint.data_state("latest", root=tmp_path / "other-2") == {"position": 2}
    _, metrics = sidecar.http_get("/metrics")
    assert "shardcache_checkpoint_last_committed_step 2.0" in metrics
    assert 'shardcache_checkpoint_bytes_total{direction="upload"}' in metrics


def test_readyz_stays_unready_until_the_checkpoint_is_restored(
    sidecar_factory: Factory,
    s3_server: S3Server,
    s3_bucket: str,
    fault_proxy: FaultProxy,
    tmp_path: Path,
) -> None:
    # A previous pod published step 2.
    publish_as_previous_pod(s3_server, s3_bucket, tmp_path, {2: STEP2})

    root = tmp_path / "ckpt"
    sidecar = sidecar_with_checkpoints(sidecar_factory, s3_server, s3_bucket, fault_proxy, root)
    fault_proxy.stall_next(30, 0.5)
    sidecar.start(wait="healthy")
    unready: list[object] = []
    deadline = time.monotonic() + 120
    while True:
        status, body = sidecar.http_get("/readyz")
        if status == 200:
            break
        unready.append(body)
        assert time.monotonic() < deadline, f"never ready: {body}; log:\n{sidecar.log_tail()}"
        time.sleep(0.02)
    # The moment /readyz says ready, the whole checkpoint is in place for the trainer.
    assert tree(root / "step-2") == STEP2
    assert checkpoint.restore(root=root) == root / "step-2"
    gates = {g["name"]: g for g in body["checks"]}
    assert gates["checkpoint-restore"]["ok"] and "step 2" in gates["checkpoint-restore"]["reason"]
    assert any(
        not g["ok"] and g["name"] == "checkpoint-restore"
        for b in unready
        if isinstance(b, dict)
        for g in b["checks"]
    )


def test_sigterm_publishes_what_was_committed_before_exiting(
    sidecar_factory: Factory,
    s3_server: S3Server,
    s3_bucket: str,
    fault_proxy: FaultProxy,
    tmp_path: Path,
) -> None:
    root = tmp_path / "ckpt"
    sidecar = sidecar_with_checkpoints(sidecar_factory, s3_server, s3_bucket, fault_proxy, root)
    sidecar.start(wait="ready")
    checkpoint.commit(write_checkpoint(root, "final", STEP1), step=99)
    assert sidecar.stop() == 0  # SIGTERM right after the trainer's last commit
    assert restore_elsewhere(s3_server, f"s3://{s3_bucket}/run", tmp_path / "next") == 99
    assert tree(tmp_path / "next" / "final") == STEP1


def injected_agent_env(checkpoint_spec: dict[str, object]) -> dict[str, str]:
    """The checkpoint agent tuning the webhook writes for `spec.checkpoint`."""
    spec = specs.parse_spec({"source": {"uri": "s3://d/x/"}, "checkpoint": checkpoint_spec})
    pod = {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "trainer"}]}}
    mount = injection.Mount("ds", spec, None)
    injected = injection.inject(pod, [mount], defaults=injection.SidecarDefaults(image="s:1"))
    (sidecar,) = injected["spec"]["initContainers"]
    tuning = {
        contract.ENV_CHECKPOINT_RESTORE_FALLBACK,
        contract.ENV_CHECKPOINT_CONCURRENCY,
        contract.ENV_CHECKPOINT_VERIFY_UPLOADS,
        contract.ENV_CHECKPOINT_UPLOAD_BUFFER,
    }
    env = {e["name"]: e["value"] for e in sidecar["env"] if e["name"] in tuning}
    assert set(env) == tuning
    return env


def test_sidecar_with_the_webhooks_restore_fallback_skips_a_damaged_checkpoint(
    sidecar_factory: Factory,
    s3_server: S3Server,
    s3_bucket: str,
    fault_proxy: FaultProxy,
    tmp_path: Path,
) -> None:
    # A previous pod published steps 1 and 2; then step 2 rotted in the store.
    publish_as_previous_pod(s3_server, s3_bucket, tmp_path, {1: STEP1, 2: STEP1})
    victim = f"{s3_bucket}/run/step-000000000002/data/model.bin"
    rot.flip_bit(s3_server.filesystem(), victim, 100)

    root = tmp_path / "ckpt"
    agent_env = injected_agent_env(
        {"uri": f"s3://{s3_bucket}/run", "restoreFallback": True, "concurrency": 2}
    )
    datasets.write_dataset(s3_server.filesystem(), f"{s3_bucket}/ds", [60, 40])
    env = {
        **s3_server.env(),
        "AWS_ENDPOINT_URL": fault_proxy.endpoint_url,
        contract.ENV_CHECKPOINT_URI: f"s3://{s3_bucket}/run",
        contract.ENV_CHECKPOINT_DIR: str(root),
        **agent_env,
    }
    sidecar = sidecar_factory(f"s3://{s3_bucket}/ds", env=env)
    sidecar.start(wait="healthy")
    deadline = time.monotonic() + 60
    while True:
        status, body = sidecar.http_get("/readyz")
        gates = {g["name"]: g for g in body["checks"]} if isinstance(body, dict) else {}
        reason = str(gates.get("checkpoint-restore", {}).get("reason", ""))
        if status == 200 or "failed" in reason:
            break
        assert time.monotonic() < deadline, f"never ready: {body}; log:\n{sidecar.log_tail()}"
        time.sleep(0.02)
    assert status == 200, f"restore did not fall back: {reason}"
    assert "step 1" in reason
    assert tree(root / "step-1") == STEP1
    restored = _protocol.read_root_file(root, _protocol.RESTORE_NAME)
    assert restored is not None
    assert (restored["step"], [s for s, _ in restored["skipped"]]) == (1, [2])
