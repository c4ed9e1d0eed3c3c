"""Settings of the checkpoint agent, read once at start-up from the environment."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from shardcache import contract, errors, source
from shardcache.checkpoint import _protocol
from shardcache.contract import variables


@dataclasses.dataclass(frozen=True)
class CheckpointSettings:
    #: The checkpoint volume shared with the trainer; each checkpoint is a subdirectory.
    directory: Path
    #: Object store prefix checkpoints are published under (any pyarrow filesystem URI).
    uri: str
    # Defaults of the settings the webhook writes are the contract table's
    # (`shardcache.contract.variables`), where each says why it was chosen.
    #: Published checkpoints kept (remote and on the node); spec.checkpoint.keepLast.
    keep_last: int = variables.CHECKPOINT_KEEP_LAST.required_default
    #: What to restore at start: "latest", "none" or a step number.
    restore: str = variables.CHECKPOINT_RESTORE.required_default
    #: Restore the next older published checkpoint when the chosen one does not match
    #: its manifest (spec.checkpoint.restoreFallback).
    restore_fallback: bool = variables.CHECKPOINT_RESTORE_FALLBACK.required_default
    #: Files uploaded (and restored) at once; large files add parallel multipart parts
    #: on top (spec.checkpoint.concurrency).
    upload_concurrency: int = variables.CHECKPOINT_CONCURRENCY.required_default
    #: Seconds between scans of the checkpoint directory for new markers. A commit is
    #: picked up within this; a scan costs one readdir plus two small reads per
    #: checkpoint directory, nothing next to an upload.
    poll_interval: float = 0.05
    #: Bytes of upload parts queued in memory across all files (pyarrow buffers a
    #: multipart upload's parts until they are sent); counts against the sidecar's
    #: memory limit (spec.checkpoint.uploadBuffer).
    upload_buffer: int = variables.CHECKPOINT_UPLOAD_BUFFER.required_default
    #: Read each object back and re-hash it before publishing
    #: (spec.checkpoint.verifyUploads).
    verify_uploads: bool = variables.CHECKPOINT_VERIFY_UPLOADS.required_default
    #: Backoff for object store errors, per object.
    retry: source.RetryPolicy = dataclasses.field(default_factory=source.RetryPolicy)
    #: Seconds before a checkpoint whose upload failed transiently is tried again.
    retry_interval: float = 5.0
    #: Seconds the agent keeps publishing commits after SIGTERM
    #: ($SHARDCACHE_CHECKPOINT_DRAIN_SECONDS). The native sidecar is stopped after the
    #: trainer exits, within the pod's grace period (30 s by default), so the trainer's
    #: last commit still goes up when it fits, and a stuck upload does not hold the
    #: process past it.
    drain_timeout: float = variables.CHECKPOINT_DRAIN.required_default
    #: Where the DatasetMount's Secret is mounted as files (`source_credentials`), read
    #: again when the store refuses the credentials in use; None: the environment only,
    #: and such a refusal fails the upload for good.
    credentials_dir: Path | None = Path(variables.CREDENTIALS_DIR.required_default)

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
        uri = variables.CHECKPOINT_URI.get(env)
        if uri is None:
            return None
        directory = variables.CHECKPOINT_DIR.get(env)
        if directory is None:
            raise errors.InputError(
                f"{contract.ENV_CHECKPOINT_URI} is set but {contract.ENV_CHECKPOINT_DIR} is not: "
                "expected the path of the checkpoint volume shared with the trainer"
            )
        values: dict[str, Any] = {f: variable.read(env) for f, variable in FIELDS.items()}
        values["credentials_dir"] = Path(values["credentials_dir"])
        return cls(directory=Path(directory), uri=uri, **values)


#: The contract variables the agent reads besides its URI and directory, by field (a
#: unit test holds `FIELDS`, URI and directory to the table's readers column).
FIELDS: Final[Mapping[str, variables.Variable[Any]]] = {
    "keep_last": variables.CHECKPOINT_KEEP_LAST,
    "restore": variables.CHECKPOINT_RESTORE,
    "restore_fallback": variables.CHECKPOINT_RESTORE_FALLBACK,
    "upload_concurrency": variables.CHECKPOINT_CONCURRENCY,
    "upload_buffer": variables.CHECKPOINT_UPLOAD_BUFFER,
    "verify_uploads": variables.CHECKPOINT_VERIFY_UPLOADS,
    "drain_timeout": variables.CHECKPOINT_DRAIN,
    "credentials_dir": variables.CREDENTIALS_DIR,
}


def parse_restore(value: str) -> int | str | None:
    """ "latest" -> "latest", "none" -> None, "42" -> 42."""
    text = value.strip().lower()
    if text in ("latest", "none"):
        return None if text == "none" else "latest"
    step = _protocol.parse_step_text(text)
    if step is not None:
        return step
    raise errors.InputError(
        f"{contract.ENV_CHECKPOINT_RESTORE}: expected latest, none or a step number, found {value!r}"
    )
