"""The sidecar's settings: one typed dataclass, read once at start-up.

Every field comes from a `SHARDCACHE_*` environment variable (names in
`shardcache.contract`, written into the pod by the webhook) and may be overridden by
a command-line flag of `shardcache sidecar`. Invalid values stop the sidecar at start
with a message naming the variable, what was expected and what was found.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shardcache import contract, errors, plans, sidecar_client
from shardcache.node import caches
from shardcache_sidecar.checkpoint import agent_config

GiB = 1 << 30

#: Not shared with the operator, so defined here rather than in `names`.
ENV_METRICS_HOST = "SHARDCACHE_METRICS_HOST"
ENV_LOG_FORMAT = "SHARDCACHE_LOG_FORMAT"
ENV_LOG_LEVEL = "SHARDCACHE_LOG_LEVEL"


@dataclasses.dataclass(frozen=True)
class Settings:
    #: Dataset URI (`s3://bucket/prefix`, `file:///data`, ...). Required.
    source_uri: str
    #: Unix socket of the control API, in the volume shared with the trainer.
    socket_path: Path
    #: Memory-tier directory (a memory-backed volume shared with the trainer).
    memory_dir: Path
    #: Disk-tier directory (node-local, shared by every sidecar on the node).
    disk_dir: Path
    #: Shard format ("parquet", "arrow", ...); None infers it from file names.
    source_format: str | None = None
    #: Pinned manifest digest ("sha256:..."). When set and the source resolves to
    #: another digest, no data is served and /readyz says why.
    manifest_digest: str | None = None
    #: Bytes of decoded shards in the memory tier. Counts against the pod's memory
    #: limit; 4 GiB holds several shards ahead of a reader.
    memory_limit: int = 4 * GiB
    #: Bytes of source shards on the node's disk. Shared by every pod on the node.
    disk_limit: int = 50 * GiB
    #: Shards decoded ahead of each reader (see NodeSettings.prefetch_depth).
    prefetch_depth: int = 4
    #: Concurrent source fetches + decodes; each decode takes a core.
    fetch_concurrency: int = 4
    #: /readyz waits until this many shards of the startup plan are resident, so a
    #: native sidecar's startup probe holds the trainer back until data is warm. Two:
    #: the first shard to read and the next, so the first step and the one after it
    #: do not wait on the object store.
    ready_shards: int = 2
    #: The startup plan (pre-registered so prefetch starts before the trainer does).
    seed: int = 0
    shuffle: bool = True
    block_size: int = plans.DEFAULT_BLOCK_SIZE
    world_size: int = 1
    rank: int = 0
    #: TCP address of /healthz, /readyz and /metrics for kubelet and Prometheus.
    #: 0.0.0.0 because probes arrive on the pod IP.
    metrics_host: str = "0.0.0.0"
    metrics_port: int = contract.DEFAULT_METRICS_PORT
    #: Seconds the sidecar keeps its own hold on a shard it handed to a client that did
    #: not take it over (the client died between the answer and its lock). The handover
    #: takes milliseconds; 30 s tolerates a stalled trainer without pinning for long.
    handoff_timeout: float = 30.0
    #: Longest one acquire may block, in seconds (a client may ask for less). Ten
    #: minutes: a cold multi-GiB shard from a slow store, not a stuck one.
    acquire_timeout: float = 600.0
    #: Threads that run blocking cache calls. Each waiting acquire holds one, so this
    #: bounds how many readers can wait at once; 32 covers 8 GPUs x 4 loader workers.
    control_threads: int = 32
    #: "json" (one object per line, for log pipelines) or "text".
    log_format: str = "json"
    log_level: str = "INFO"
    #: The checkpoint agent's settings ($SHARDCACHE_CHECKPOINT_*); None runs no agent.
    checkpoint: agent_config.CheckpointSettings | None = None

    def __post_init__(self) -> None:
        if not self.source_uri:
            raise errors.InputError(
                f"no dataset source: set ${contract.ENV_SOURCE_URI} or --source, "
                "e.g. s3://bucket/prefix"
            )
        size = len(os.fsencode(self.socket_path))
        if size > sidecar_client.MAX_SOCKET_PATH_BYTES:
            raise errors.InputError(
                f"control socket path {str(self.socket_path)!r} is {size} bytes; Unix sockets "
                f"allow at most {sidecar_client.MAX_SOCKET_PATH_BYTES}: use a shorter run directory"
            )
        for name in ("memory_limit", "disk_limit", "prefetch_depth", "ready_shards"):
            if getattr(self, name) < 0:
                raise errors.InputError(f"{name} must be >= 0, found {getattr(self, name)}")
        for name in ("fetch_concurrency", "control_threads"):
            if getattr(self, name) < 1:
                raise errors.InputError(f"{name} must be >= 1, found {getattr(self, name)}")
        for name in ("handoff_timeout", "acquire_timeout"):
            if getattr(self, name) <= 0:
                raise errors.InputError(f"{name} must be > 0 seconds, found {getattr(self, name)}")
        if not 0 <= self.metrics_port <= 65535:
            raise errors.InputError(
                f"metrics port must be in [0, 65535], found {self.metrics_port}"
            )
        if self.log_format not in ("json", "text"):
            raise errors.InputError(
                f"log format must be 'json' or 'text', found {self.log_format!r}"
            )
        if self.manifest_digest is not None and not self.manifest_digest.startswith("sha256:"):
            raise errors.InputError(
                f"${contract.ENV_MANIFEST_DIGEST}: expected 'sha256:<hex>', "
                f"found {self.manifest_digest!r}"
            )
        # PlanParams checks rank < world_size etc. with its own messages.
        self.startup_plan()

    def startup_plan(self) -> plans.PlanParams:
        return plans.PlanParams(
            seed=self.seed,
            epoch=0,
            rank=self.rank,
            world_size=self.world_size,
            shuffle=self.shuffle,
            block_size=self.block_size,
        )

    def node_settings(self) -> caches.NodeSettings:
        return caches.NodeSettings(
            disk_dir=self.disk_dir,
            memory_dir=self.memory_dir,
            disk_limit=self.disk_limit,
            memory_limit=self.memory_limit,
            prefetch_depth=self.prefetch_depth,
            fetch_concurrency=self.fetch_concurrency,
        )


def _int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise errors.InputError(f"${name}: expected an integer, found {raw!r}") from None


def _bool(env: Mapping[str, str], name: str) -> bool | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise errors.InputError(f"${name}: expected true or false, found {raw!r}")


def from_env(
    environ: Mapping[str, str] | None = None, overrides: Mapping[str, Any] | None = None
) -> Settings:
    """Settings from the environment, then `overrides` (command-line flags; None = unset).

    The socket is $SHARDCACHE_SOCKET, else `<run dir>/<mount>/control.sock`; the memory
    directory $SHARDCACHE_MEMORY_DIR, else `<run dir>/<mount>/mem`, the layout the
    client derives from the same variables.
    """
    env = os.environ if environ is None else environ
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    run_dir = Path(
        given.pop("run_dir", None) or env.get(contract.ENV_RUN_DIR) or contract.DEFAULT_RUN_DIR
    )
    mount = given.pop("mount", None) or env.get(contract.ENV_MOUNT) or "default"
    values: dict[str, Any] = {
        "source_uri": env.get(contract.ENV_SOURCE_URI, ""),
        "socket_path": Path(env.get(contract.ENV_SOCKET) or contract.socket_path(run_dir, mount)),
        "memory_dir": Path(env.get(contract.ENV_MEMORY_DIR) or contract.memory_dir(run_dir, mount)),
        "disk_dir": Path(env.get(contract.ENV_DISK_DIR) or contract.DEFAULT_DISK_DIR),
        "source_format": env.get(contract.ENV_SOURCE_FORMAT) or None,
        "manifest_digest": env.get(contract.ENV_MANIFEST_DIGEST) or None,
        "metrics_host": env.get(ENV_METRICS_HOST) or None,
        "log_format": env.get(ENV_LOG_FORMAT) or None,
        "log_level": env.get(ENV_LOG_LEVEL) or None,
    }
    ints = {
        "memory_limit": contract.ENV_MEMORY_LIMIT,
        "disk_limit": contract.ENV_DISK_LIMIT,
        "prefetch_depth": contract.ENV_PREFETCH_DEPTH,
        "fetch_concurrency": contract.ENV_FETCH_CONCURRENCY,
        "ready_shards": contract.ENV_READY_SHARDS,
        "seed": contract.ENV_SEED,
        "block_size": contract.ENV_BLOCK_SIZE,
        "world_size": contract.ENV_WORLD_SIZE,
        "rank": contract.ENV_RANK,
        "metrics_port": contract.ENV_METRICS_PORT,
    }
    for field, var in ints.items():
        values[field] = _int(env, var)
    values["shuffle"] = _bool(env, contract.ENV_SHUFFLE)
    values["checkpoint"] = agent_config.CheckpointSettings.from_env(env)
    values.update(given)
    for field in ("socket_path", "memory_dir", "disk_dir"):
        values[field] = Path(values[field])
    # Unset values take the dataclass defaults; a socket moved by flag moves nothing else.
    return Settings(**{k: v for k, v in values.items() if v is not None or k in _NULLABLE})


_NULLABLE = frozenset({"source_format", "manifest_digest"})
