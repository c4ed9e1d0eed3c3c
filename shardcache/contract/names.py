"""Names of everything the webhook writes into a pod and the sidecar and client read.

Environment variable names (short names for the rows of `variables`, the contract
table), the shared volume's layout (run directory, control socket, memory tier) and the
sidecar's probe port. Changing a value here changes the contract
between the operator, the sidecar and the trainer, so it is versioned by
`CONTROL_API_VERSION` (docs/wire-format.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from shardcache.contract import variables

#: Version of the control protocol spoken over the Unix socket (see docs/wire-format.md).
CONTROL_API_VERSION = "v1"

# --- environment variable names ---------------------------------------------------
# Short names for the rows of the contract table (`variables`), where each variable's
# type, default, spec field and readers are defined.
ENV_RUN_DIR: Final = variables.RUN_DIR.env
ENV_MOUNT: Final = variables.MOUNT.env
ENV_MOUNTS: Final = variables.MOUNTS.env
ENV_SOCKET: Final = variables.SOCKET.env
ENV_SOURCE_URI: Final = variables.SOURCE_URI.env
ENV_SOURCE_FORMAT: Final = variables.SOURCE_FORMAT.env
ENV_MANIFEST_DIGEST: Final = variables.MANIFEST_DIGEST.env
ENV_HANDED_MANIFESTS_DIR: Final = variables.HANDED_MANIFESTS_DIR.env
ENV_CREDENTIALS_DIR: Final = variables.CREDENTIALS_DIR.env
ENV_MIXTURE: Final = variables.MIXTURE.env
ENV_MEMORY_DIR: Final = variables.MEMORY_DIR.env
ENV_MEMORY_LIMIT: Final = variables.MEMORY_LIMIT.env
ENV_DISK_DIR: Final = variables.DISK_DIR.env
ENV_DISK_LIMIT: Final = variables.DISK_LIMIT.env
ENV_PREFETCH_DEPTH: Final = variables.PREFETCH_DEPTH.env
ENV_PREFETCH_ADAPTIVE: Final = variables.PREFETCH_ADAPTIVE.env
ENV_PREFETCH_MAX_DEPTH: Final = variables.PREFETCH_MAX_DEPTH.env
ENV_FETCH_CONCURRENCY: Final = variables.FETCH_CONCURRENCY.env
ENV_READY_SHARDS: Final = variables.READY_SHARDS.env
ENV_SEED: Final = variables.SEED.env
ENV_SHUFFLE: Final = variables.SHUFFLE.env
ENV_BLOCK_SIZE: Final = variables.BLOCK_SIZE.env
ENV_SHUFFLE_GRANULARITY: Final = variables.SHUFFLE_GRANULARITY.env
ENV_SHUFFLE_WINDOW: Final = variables.SHUFFLE_WINDOW.env
ENV_WORLD_SIZE: Final = variables.WORLD_SIZE.env
ENV_RANK: Final = variables.RANK.env
ENV_LOCAL_RANKS: Final = variables.LOCAL_RANKS.env
ENV_METRICS_PORT: Final = variables.METRICS_PORT.env
ENV_UI_PORT: Final = variables.UI_PORT.env
ENV_METRICS_HOST: Final = variables.METRICS_HOST.env
ENV_TERMINATION_MESSAGE_PATH: Final = variables.TERMINATION_MESSAGE_PATH.env
ENV_LOG_FORMAT: Final = variables.LOG_FORMAT.env
ENV_LOG_LEVEL: Final = variables.LOG_LEVEL.env
ENV_CHECKPOINT_DIR: Final = variables.CHECKPOINT_DIR.env
ENV_CHECKPOINT_URI: Final = variables.CHECKPOINT_URI.env
ENV_CHECKPOINT_KEEP_LAST: Final = variables.CHECKPOINT_KEEP_LAST.env
ENV_CHECKPOINT_RESTORE: Final = variables.CHECKPOINT_RESTORE.env
ENV_CHECKPOINT_RESTORE_FALLBACK: Final = variables.CHECKPOINT_RESTORE_FALLBACK.env
ENV_CHECKPOINT_CONCURRENCY: Final = variables.CHECKPOINT_CONCURRENCY.env
ENV_CHECKPOINT_VERIFY_UPLOADS: Final = variables.CHECKPOINT_VERIFY_UPLOADS.env
ENV_CHECKPOINT_UPLOAD_BUFFER: Final = variables.CHECKPOINT_UPLOAD_BUFFER.env
ENV_CHECKPOINT_DRAIN: Final = variables.CHECKPOINT_DRAIN.env
ENV_RECONNECT_TIMEOUT: Final = variables.RECONNECT_TIMEOUT.env

#: S3 settings read by `shardcache.source` (the usual AWS variable names): the keys of
#: the Secret named by spec.source.secretRef, which the operator reads and the sidecar
#: gets as its environment (`envFrom`).
ENV_S3_ACCESS_KEY_ID = "AWS_ACCESS_KEY_ID"
ENV_S3_SECRET_ACCESS_KEY = "AWS_SECRET_ACCESS_KEY"
ENV_S3_SESSION_TOKEN = "AWS_SESSION_TOKEN"
ENV_S3_ENDPOINT = "AWS_ENDPOINT_URL"
ENV_S3_ENDPOINT_S3 = "AWS_ENDPOINT_URL_S3"
ENV_S3_REGION = "AWS_REGION"
ENV_S3_DEFAULT_REGION = "AWS_DEFAULT_REGION"

# --- paths -----------------------------------------------------------------------
#: Default run directory inside pods (a memory-backed volume per mount below it).
DEFAULT_RUN_DIR: Final = variables.RUN_DIR.required_default
#: Default node-local disk tier directory (a hostPath shared by all pods on the node).
DEFAULT_DISK_DIR: Final = variables.DISK_DIR.required_default
SOCKET_NAME = "control.sock"
MEMORY_SUBDIR = "mem"
DISK_SUBDIR = "disk"


def mount_dir(run_dir: str | Path, mount: str) -> Path:
    """The shared directory of one mount inside a pod: socket and memory tier."""
    return Path(run_dir) / mount


def socket_path(run_dir: str | Path, mount: str) -> Path:
    return mount_dir(run_dir, mount) / SOCKET_NAME


def memory_dir(run_dir: str | Path, mount: str) -> Path:
    return mount_dir(run_dir, mount) / MEMORY_SUBDIR


#: TCP port of the sidecar's HTTP endpoints that kubelet and Prometheus reach
#: (/healthz, /readyz, /metrics, /ui). The control API stays on the Unix socket.
DEFAULT_METRICS_PORT: Final = variables.METRICS_PORT.required_default
DEFAULT_UI_PORT: Final = variables.UI_PORT.required_default
