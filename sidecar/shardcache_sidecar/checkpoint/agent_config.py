"""Settings of the checkpoint agent, read once at start-up from the environment."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path

from shardcache import contract, errors, source

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclasses.dataclass(frozen=True)
class CheckpointSettings:
    #: The checkpoint volume shared with the trainer; each checkpoint is a subdirectory.
    directory: Path
    #: Object store prefix checkpoints are published under (any pyarrow filesystem URI).
    uri: str
    #: Published checkpoints kept (remote and on the node); spec.checkpoint.keepLast.
    keep_last: int = 3
    #: What to restore at start: "latest", "none" or a step number.
    restore: str = "latest"
    #: Restore the next older published checkpoint when the chosen one does not match
    #: its manifest. Off: silently restoring an older model is the user's decision
    #: (spec.checkpoint.restoreFallback).
    restore_fallback: bool = False
    #: Files uploaded (and restored) at once. Eight keeps a 2-core sidecar busy hashing
    #: while the network stays full; large files add parallel multipart parts on top
    #: (spec.checkpoint.concurrency).
    upload_concurrency: int = 8
    #: Seconds between scans of the checkpoint directory for new markers. A commit is
    #: picked up within this; a scan costs one readdir plus two small reads per
    #: checkpoint directory, nothing next to an upload.
    poll_interval: float = 0.05
    #: Bytes of upload parts queued in memory across all files (pyarrow buffers a
    #: multipart upload's parts until they are sent). 512 MiB lets a lone large file
    #: keep its upload busy; counts against the sidecar's memory limit
    #: (spec.checkpoint.uploadBuffer).
    upload_buffer: int = 512 << 20
    #: Read each object back and re-hash it before publishing. Off by default: it
    #: doubles the traffic, and restore verifies every byte anyway
    #: (spec.checkpoint.verifyUploads).
    verify_uploads: bool = False
    #: Backoff for object store errors, per object.
    retry: source.RetryPolicy = dataclasses.field(default_factory=source.RetryPolicy)
    #: Seconds before a checkpoint whose upload failed transiently is tried again.
    retry_interval: float = 5.0
    #: Seconds the sidecar keeps publishing commits after SIGTERM. The native sidecar
    #: is stopped after the trainer exits, within the pod's grace period (30 s by
    #: default), so the trainer's last commit still goes up when it fits.
    drain_timeout: float = 25.0

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise errors.InputError(
                f"{contract.ENV_CHECKPOINT_KEEP_LAST}: expected an integer >= 1, found {self.keep_last}"
            )
        parse_restore(self.restore)
        source.split_uri(self.uri)  # an unsupported scheme stops the sidecar at start
        if self.upload_concurrency < 1:
            raise errors.InputError(
                f"{contract.ENV_CHECKPOINT_CONCURRENCY}: expected an integer >= 1, "
                f"found {self.upload_concurrency}"
            )
        if self.upload_buffer < 0:
            raise errors.InputError(
                f"{contract.ENV_CHECKPOINT_UPLOAD_BUFFER}: expected a byte count >= 0, "
                f"found {self.upload_buffer}"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> CheckpointSettings | None:
        """The settings, or None when no checkpoint URI is configured."""
        env = os.environ if env is None else env
        uri = env.get(contract.ENV_CHECKPOINT_URI, "").strip()
        if not uri:
            return None
        directory = env.get(contract.ENV_CHECKPOINT_DIR, "").strip()
        if not directory:
            raise errors.InputError(
                f"{contract.ENV_CHECKPOINT_URI} is set but {contract.ENV_CHECKPOINT_DIR} is not: "
                "expected the path of the checkpoint volume shared with the trainer"
            )
        return cls(
            directory=Path(directory),
            uri=uri,
            keep_last=_int(env, contract.ENV_CHECKPOINT_KEEP_LAST, 3),
            restore=env.get(contract.ENV_CHECKPOINT_RESTORE, "latest").strip() or "latest",
            restore_fallback=_bool(env, contract.ENV_CHECKPOINT_RESTORE_FALLBACK, False),
            upload_concurrency=_int(env, contract.ENV_CHECKPOINT_CONCURRENCY, 8),
            upload_buffer=_int(env, contract.ENV_CHECKPOINT_UPLOAD_BUFFER, 512 << 20),
            verify_uploads=_bool(env, contract.ENV_CHECKPOINT_VERIFY_UPLOADS, False),
        )


def parse_restore(value: str) -> int | str | None:
    """ "latest" -> "latest", "none" -> None, "42" -> 42."""
    text = value.strip().lower()
    if text in ("latest", "none"):
        return None if text == "none" else "latest"
    if text.isdigit():
        return int(text)
    raise errors.InputError(
        f"{contract.ENV_CHECKPOINT_RESTORE}: expected latest, none or a step number, found {value!r}"
    )


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise errors.InputError(f"{name}: expected an integer, found {raw!r}") from exc


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    # Strict: a typo such as "ture" must not silently leave the setting off.
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise errors.InputError(
        f"{name}: expected one of {', '.join(_TRUE + _FALSE)}, found {env[name]!r}"
    )
