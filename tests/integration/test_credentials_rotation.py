"""A key rotated in the Secret reaches a running sidecar without a restart.

A real sidecar process against its own MinIO, its credentials both in the environment
(the Secret's `envFrom`, fixed for the container's life) and in
`$SHARDCACHE_CREDENTIALS_DIR` (the Secret's volume, which the kubelet updates). The
store's key is then rotated: MinIO restarted on the same data with other root
credentials, so the old key is refused. Until the files change, a cold fetch is refused
and the trainer gets `AccessDeniedError`; once they hold the new key, the next cold
fetch and the next checkpoint upload use it, with no restart of anything
(`shardcache.source_credentials`); a checkpoint the store refused meanwhile waits on the
node, tried again, not failed for good.
"""

from __future__ import annotations

import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

import pyarrow.fs as pafs
import pytest

import shardcache
from shardcache import checkpoint, contract, errors
from tests.support import datasets
from tests.support.s3server import S3Server, own_server
from tests.support.sidecar import SidecarProcess

pytestmark = pytest.mark.integration

SHARDS = [40, 30, 20, 10]


@pytest.fixture
def server() -> Iterator[S3Server]:
    """A MinIO of this test's own: its root key is rotated, which the session's shared
    server must never see."""
    with own_server("shardcache-minio-rotated-") as minio:
        yield minio


WEIGHTS = b"weights" * 1000


def commit(root: Path, step: int) -> None:
    (root / f"step-{step}").mkdir()
    (root / f"step-{step}" / "model.bin").write_bytes(WEIGHTS)
    checkpoint.commit(root / f"step-{step}", step=step)


def write_credentials(directory: Path, server: S3Server) -> None:
    """The Secret's volume as the kubelet writes it: one file per key, swapped whole."""
    staged = directory.with_name(directory.name + ".new")
    staged.mkdir()
    (staged / contract.ENV_S3_ACCESS_KEY_ID).write_text(server.access_key)
    (staged / contract.ENV_S3_SECRET_ACCESS_KEY).write_text(server.secret_key)
    if directory.exists():
        shutil.rmtree(directory)
    staged.rename(directory)


def rotate(server: S3Server) -> None:
    """A new root key for the same data; the old one is refused from now on."""
    server.stop()
    server.access_key = "rotated-" + secrets.token_hex(4)
    server.secret_key = secrets.token_urlsafe(24)
    server.start()


def read_uids(proc: SidecarProcess, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every row's uid, through the sidecar, in manifest order."""
    for name, value in proc.client_env().items():
        monkeypatch.setenv(name, value)
    with shardcache.open(shuffle=False) as ds:
        return [uid for batch in ds for uid in batch.column("uid").to_pylist()]


def test_a_key_rotated_in_the_secret_is_used_by_a_running_sidecar_and_its_agent(
    server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket = server.make_bucket()
    datasets.write_dataset(server.filesystem(), f"{bucket}/tokens", SHARDS)
    uri = f"s3://{bucket}/tokens/"
    credentials = tmp_path / "credentials"
    write_credentials(credentials, server)
    ckpt_root = tmp_path / "checkpoints"
    ckpt_root.mkdir()
    monkeypatch.setenv(contract.ENV_CHECKPOINT_DIR, str(ckpt_root))
    old_env = server.env()  # fixed for the sidecar's life, as a container's env is
    env = {
        **old_env,
        contract.ENV_CREDENTIALS_DIR: str(credentials),
        contract.ENV_CHECKPOINT_URI: f"s3://{bucket}/ckpt",
        contract.ENV_CHECKPOINT_DIR: str(ckpt_root),
        # Nothing fetched ahead: each shard is fetched when a reader asks for it.
        contract.ENV_READY_SHARDS: "0",
        contract.ENV_PREFETCH_DEPTH: "0",
    }
    (tmp_path / "work").mkdir()
    proc = SidecarProcess(uri, workdir=tmp_path / "work", env=env)
    try:
        proc.start(wait="ready")
        rotate(server)
        # The files still hold the old key: the refusal stands, and says what it is.
        with pytest.raises(errors.AccessDeniedError, match="code=access_denied"):
            read_uids(proc, monkeypatch)
        commit(ckpt_root, 3)
        # Not failed for good: it waits on the node for credentials that work.
        with pytest.raises(TimeoutError, match="ACCESS_DENIED"):
            checkpoint.wait(3, timeout=3)
        write_credentials(credentials, server)
        assert read_uids(proc, monkeypatch) == list(range(sum(SHARDS)))
        commit(ckpt_root, 4)
        checkpoint.wait(4, timeout=60)
        log = proc.log_tail()
    finally:
        proc.cleanup()
    store = server.filesystem()
    listed = store.get_file_info(pafs.FileSelector(f"{bucket}/ckpt", recursive=True))
    uploaded = {info.path: info.size for info in listed if info.base_name == "model.bin"}
    assert list(uploaded.values()) == [len(WEIGHTS)], (uploaded, log)
    assert "using the ones now in" in log
    assert old_env[contract.ENV_S3_SECRET_ACCESS_KEY] not in log
