"""Names of everything the webhook writes into a pod and the sidecar and client read.

Environment variable names, the shared volume's layout (run directory, control socket,
memory tier) and the sidecar's probe port. Changing a value here changes the contract
between the operator, the sidecar and the trainer, so it is versioned by
`CONTROL_API_VERSION` (docs/wire-format.md).
"""

from __future__ import annotations

from pathlib import Path

#: Version of the control protocol spoken over the Unix socket (see docs/wire-format.md).
CONTROL_API_VERSION = "v1"

# --- environment variables -------------------------------------------------------
#: Root of the per-pod shared run directory; each mount has a subdirectory.
ENV_RUN_DIR = "SHARDCACHE_RUN_DIR"
#: Name of the DatasetMount that `shardcache.open()` uses when none is given.
ENV_MOUNT = "SHARDCACHE_MOUNT"
#: Comma-separated names of every DatasetMount injected into the pod.
ENV_MOUNTS = "SHARDCACHE_MOUNTS"
#: Explicit control socket path; overrides the one derived from run dir and mount.
ENV_SOCKET = "SHARDCACHE_SOCKET"

# Settings the webhook writes for the sidecar (the checkpoint directory also reaches
# trainers: they commit into it).
ENV_SOURCE_URI = "SHARDCACHE_SOURCE_URI"
ENV_SOURCE_FORMAT = "SHARDCACHE_SOURCE_FORMAT"
ENV_MANIFEST_DIGEST = "SHARDCACHE_MANIFEST_DIGEST"
ENV_MEMORY_DIR = "SHARDCACHE_MEMORY_DIR"
ENV_MEMORY_LIMIT = "SHARDCACHE_MEMORY_LIMIT_BYTES"
ENV_DISK_DIR = "SHARDCACHE_DISK_DIR"
ENV_DISK_LIMIT = "SHARDCACHE_DISK_LIMIT_BYTES"
ENV_PREFETCH_DEPTH = "SHARDCACHE_PREFETCH_DEPTH"
ENV_FETCH_CONCURRENCY = "SHARDCACHE_FETCH_CONCURRENCY"
ENV_READY_SHARDS = "SHARDCACHE_READY_SHARDS"
ENV_SEED = "SHARDCACHE_SEED"
ENV_SHUFFLE = "SHARDCACHE_SHUFFLE"
ENV_BLOCK_SIZE = "SHARDCACHE_BLOCK_SIZE"
ENV_WORLD_SIZE = "SHARDCACHE_WORLD_SIZE"
ENV_RANK = "SHARDCACHE_RANK"
ENV_METRICS_PORT = "SHARDCACHE_METRICS_PORT"
ENV_CHECKPOINT_DIR = "SHARDCACHE_CHECKPOINT_DIR"
ENV_CHECKPOINT_URI = "SHARDCACHE_CHECKPOINT_URI"
ENV_CHECKPOINT_KEEP_LAST = "SHARDCACHE_CHECKPOINT_KEEP_LAST"
ENV_CHECKPOINT_RESTORE = "SHARDCACHE_CHECKPOINT_RESTORE"
#: Checkpoint agent tuning, from spec.checkpoint (see docs/checkpoints.md).
ENV_CHECKPOINT_RESTORE_FALLBACK = "SHARDCACHE_CHECKPOINT_RESTORE_FALLBACK"
ENV_CHECKPOINT_CONCURRENCY = "SHARDCACHE_CHECKPOINT_CONCURRENCY"
ENV_CHECKPOINT_VERIFY_UPLOADS = "SHARDCACHE_CHECKPOINT_VERIFY_UPLOADS"
ENV_CHECKPOINT_UPLOAD_BUFFER = "SHARDCACHE_CHECKPOINT_UPLOAD_BUFFER_BYTES"

#: S3 settings read by `shardcache.source` (the usual AWS variable names).
ENV_S3_ENDPOINT = "AWS_ENDPOINT_URL"
ENV_S3_ENDPOINT_S3 = "AWS_ENDPOINT_URL_S3"
ENV_S3_REGION = "AWS_REGION"

# --- paths -----------------------------------------------------------------------
#: Default run directory inside pods (a memory-backed volume per mount below it).
DEFAULT_RUN_DIR = "/var/run/shardcache"
#: Default node-local disk tier directory (a hostPath shared by all pods on the node).
DEFAULT_DISK_DIR = "/var/cache/shardcache"
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
DEFAULT_METRICS_PORT = 8470
