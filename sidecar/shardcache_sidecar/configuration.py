"""The sidecar's settings: one typed dataclass, read once at start-up.

Most fields come from a row of the contract table (`shardcache.contract.variables`,
written into the pod by the webhook; `OPTIONS` below says which), take its default, and
may be overridden by the flag `shardcache sidecar` builds from the same row. Env and
flags are parsed with the row's parser, so an invalid value stops the sidecar at start
with a message naming the variable or flag, what was expected and what was found;
`Settings` checks the ranges again for values given in code.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shardcache import contract, errors, plans, sidecar_client, source, uris
from shardcache.contract import mixture_sources, variables
from shardcache.node import caches
from shardcache_sidecar import logs
from shardcache_sidecar.checkpoint import agent_config


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
    #: Where the operator's handed manifests are mounted (`handed_manifests`): the pin's
    #: manifest found there starts the sidecar without a resolve from the store.
    handed_manifests_dir: Path = Path(variables.HANDED_MANIFESTS_DIR.required_default)
    #: Where the DatasetMount's Secret is mounted as files (`source_credentials`): read
    #: again when the store refuses the credentials in use.
    credentials_dir: Path = Path(variables.CREDENTIALS_DIR.required_default)
    # Defaults of the settings the webhook writes are the contract table's
    # (`shardcache.contract.variables`), where each says why it was chosen.
    #: Bytes of decoded shards in the memory tier. Counts against the pod's memory limit.
    memory_limit: int = variables.MEMORY_LIMIT.required_default
    #: Bytes of source shards on the node's disk. Shared by every pod on the node.
    disk_limit: int = variables.DISK_LIMIT.required_default
    #: Shards decoded ahead of each reader (see NodeSettings.prefetch_depth).
    prefetch_depth: int = variables.PREFETCH_DEPTH.required_default
    #: Tune each reader's depth from its stall signal (`prefetch_tuner`), between
    #: `prefetch_depth` and `prefetch_max_depth`; the memory tier bounds it too.
    prefetch_adaptive: bool = variables.PREFETCH_ADAPTIVE.required_default
    prefetch_max_depth: int = variables.PREFETCH_MAX_DEPTH.required_default
    #: Concurrent source fetches + decodes; each decode takes a core. 0: sized from the
    #: container's CPU quota and memory limit (`shardcache.node.quotas`).
    fetch_concurrency: int = variables.FETCH_CONCURRENCY.required_default
    #: /readyz waits until this many shards of the startup plan are resident, so a
    #: native sidecar's startup probe holds the trainer back until data is warm.
    ready_shards: int = variables.READY_SHARDS.required_default
    #: The startup plan (pre-registered so prefetch starts before the trainer does).
    seed: int = variables.SEED.required_default
    shuffle: bool = variables.SHUFFLE.required_default
    block_size: int = variables.BLOCK_SIZE.required_default
    #: "block" or "sample" (`plans.GRANULARITIES`), and the sample-shuffle window in
    #: rows: the mount's, so the startup reader warms the shards a sample-mode rank
    #: leases first (its whole first windows), not a block-mode rank's.
    granularity: str = variables.SHUFFLE_GRANULARITY.required_default
    window: int = variables.SHUFFLE_WINDOW.required_default
    world_size: int = variables.WORLD_SIZE.required_default
    rank: int = variables.RANK.required_default
    #: Ranks from `rank` on whose epochs the cache node fills from start-up (see
    #: CacheNode.register_reader's `fill_ranks`): a sidecar shared by a node's ranks.
    local_ranks: int = variables.LOCAL_RANKS.required_default
    #: TCP address of /healthz, /readyz and /metrics for kubelet and Prometheus.
    metrics_host: str = variables.METRICS_HOST.required_default
    metrics_port: int = variables.METRICS_PORT.required_default
    #: TCP port of the web inspector. It binds `UI_HOST` only: the inspector reads the
    #: dataset, so it is never reachable from the pod network (port-forward reaches it).
    ui_port: int = variables.UI_PORT.required_default
    #: Seconds the sidecar keeps its own hold on a shard it handed to a client that did
    #: not take it over (the client died between the answer and its lock). The handover
    #: takes milliseconds; 30 s tolerates a stalled trainer without pinning for long.
    handoff_timeout: float = 30.0
    #: Longest one acquire may block, in seconds (a client may ask for less). Ten
    #: minutes: a cold multi-GiB shard from a slow store, not a stuck one.
    acquire_timeout: float = 600.0
    #: Seconds a shard fetch keeps retrying a store that fails transiently (refused or
    #: reset connections, 5xx, timeouts) before the reader gets `SourceError`: rides out
    #: a store restarting mid-epoch (`source.RetryPolicy.budget_seconds`, whose default
    #: says why), far inside `acquire_timeout`.
    source_retry_seconds: float = source.RetryPolicy().budget_seconds
    #: Threads that run blocking cache calls. Each waiting acquire holds one, so this
    #: bounds how many readers can wait at once; 32 covers 8 GPUs x 4 loader workers.
    control_threads: int = 32
    #: Where the sidecar writes why it exits (`termination`): the container's
    #: terminationMessagePath, which `kubectl describe pod` shows.
    termination_message_path: Path = Path(variables.TERMINATION_MESSAGE_PATH.required_default)
    #: "json" (one object per line, for log pipelines) or "text".
    log_format: str = variables.LOG_FORMAT.required_default
    log_level: str = variables.LOG_LEVEL.required_default
    #: The checkpoint agent's settings ($SHARDCACHE_CHECKPOINT_*); None runs no agent.
    checkpoint: agent_config.CheckpointSettings | None = None
    #: Every source of a multi-source mount ($SHARDCACHE_MIXTURE); the first is
    #: `source_uri`. None: the one source. See `server.running.source_settings`.
    mixture: mixture_sources.Mixture | None = None

    def __post_init__(self) -> None:
        if not self.source_uri:
            raise errors.InputError(
                f"no dataset source: set ${contract.ENV_SOURCE_URI} or --source, "
                "e.g. s3://bucket/prefix"
            )
        uris.refuse_userinfo(self.source_uri, where="the dataset source")
        size = len(os.fsencode(self.socket_path))
        if size > sidecar_client.MAX_SOCKET_PATH_BYTES:
            raise errors.InputError(
                f"control socket path {str(self.socket_path)!r} is {size} bytes; Unix sockets "
                f"allow at most {sidecar_client.MAX_SOCKET_PATH_BYTES}: use a shorter run directory"
            )
        for name in (
            "memory_limit",
            "disk_limit",
            "prefetch_depth",
            "prefetch_max_depth",
            "ready_shards",
            "fetch_concurrency",
        ):
            if getattr(self, name) < 0:
                raise errors.InputError(f"{name} must be >= 0, found {getattr(self, name)}")
        if self.control_threads < 1:
            raise errors.InputError(f"control_threads must be >= 1, found {self.control_threads}")
        # `not ... > 0` and `isfinite` refuse NaN, which compares false with everything.
        for name in ("handoff_timeout", "acquire_timeout"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise errors.InputError(
                    f"{name}: expected a finite number of seconds > 0, found {value}"
                )
        if not (self.source_retry_seconds >= 0 and math.isfinite(self.source_retry_seconds)):
            raise errors.InputError(
                "source_retry_seconds: expected a finite number of seconds >= 0, "
                f"found {self.source_retry_seconds}"
            )
        for name in ("metrics_port", "ui_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise errors.InputError(
                    f"{name} must be in [0, 65535], found {getattr(self, name)}"
                )
        if self.log_format not in ("json", "text"):
            raise errors.InputError(
                f"log format must be 'json' or 'text', found {self.log_format!r}"
            )
        logs.levels(self.log_level)
        if self.manifest_digest is not None and not self.manifest_digest.startswith("sha256:"):
            raise errors.InputError(
                f"${contract.ENV_MANIFEST_DIGEST}: expected 'sha256:<hex>', "
                f"found {self.manifest_digest!r}"
            )
        if self.mixture is not None and self.mixture.sources[0].uri != self.source_uri:
            raise errors.InputError(
                f"${variables.MIXTURE.env}: expected its first source to be the mount's own "
                f"source {self.source_uri!r}, found {self.mixture.sources[0].uri!r}"
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
            granularity=self.granularity,
            window=self.window,
        )

    def node_settings(self) -> caches.NodeSettings:
        return caches.NodeSettings(
            disk_dir=self.disk_dir,
            memory_dir=self.memory_dir,
            disk_limit=self.disk_limit,
            memory_limit=self.memory_limit,
            prefetch_depth=self.prefetch_depth,
            fetch_concurrency=self.fetch_concurrency,
            retry=source.RetryPolicy(budget_seconds=self.source_retry_seconds),
            # The pod's own memory volume: no other process commits or evicts there.
            memory_sole_writer=True,
        )


#: Where the web inspector listens: loopback only, never the pod IP (docs/security.md).
UI_HOST = "127.0.0.1"

#: A sidecar started by hand without a mount name serves this one (in a pod the
#: webhook always names it; the client has no such fallback, see `variables.MOUNT`).
LOCAL_MOUNT = "default"


@dataclasses.dataclass(frozen=True)
class Option:
    """A setting read from a contract variable, and the flag of `shardcache sidecar`
    that overrides it."""

    field: str
    variable: variables.Variable[Any]
    flag: str


#: Every contract variable the sidecar reads (a unit test holds this to the table's
#: readers column). `run_dir` and `mount` only place the socket and the memory tier.
OPTIONS: tuple[Option, ...] = (
    Option("source_uri", variables.SOURCE_URI, "--source"),
    Option("source_format", variables.SOURCE_FORMAT, "--format"),
    Option("manifest_digest", variables.MANIFEST_DIGEST, "--digest"),
    Option("handed_manifests_dir", variables.HANDED_MANIFESTS_DIR, "--handed-manifests-dir"),
    Option("credentials_dir", variables.CREDENTIALS_DIR, "--credentials-dir"),
    Option("run_dir", variables.RUN_DIR, "--run-dir"),
    Option("mount", variables.MOUNT, "--mount"),
    Option("socket_path", variables.SOCKET, "--socket"),
    Option("memory_dir", variables.MEMORY_DIR, "--memory-dir"),
    Option("disk_dir", variables.DISK_DIR, "--disk-dir"),
    Option("memory_limit", variables.MEMORY_LIMIT, "--memory-limit"),
    Option("disk_limit", variables.DISK_LIMIT, "--disk-limit"),
    Option("prefetch_depth", variables.PREFETCH_DEPTH, "--prefetch-depth"),
    Option("prefetch_adaptive", variables.PREFETCH_ADAPTIVE, "--prefetch-adaptive"),
    Option("prefetch_max_depth", variables.PREFETCH_MAX_DEPTH, "--prefetch-max-depth"),
    Option("fetch_concurrency", variables.FETCH_CONCURRENCY, "--fetch-concurrency"),
    Option("ready_shards", variables.READY_SHARDS, "--ready-shards"),
    Option("seed", variables.SEED, "--seed"),
    Option("shuffle", variables.SHUFFLE, "--shuffle"),
    Option("block_size", variables.BLOCK_SIZE, "--block-size"),
    Option("granularity", variables.SHUFFLE_GRANULARITY, "--granularity"),
    Option("window", variables.SHUFFLE_WINDOW, "--window"),
    Option("world_size", variables.WORLD_SIZE, "--world-size"),
    Option("rank", variables.RANK, "--rank"),
    Option("local_ranks", variables.LOCAL_RANKS, "--local-ranks"),
    Option("metrics_host", variables.METRICS_HOST, "--metrics-host"),
    Option("metrics_port", variables.METRICS_PORT, "--metrics-port"),
    Option("ui_port", variables.UI_PORT, "--ui-port"),
    Option(
        "termination_message_path",
        variables.TERMINATION_MESSAGE_PATH,
        "--termination-message-path",
    ),
    Option("log_format", variables.LOG_FORMAT, "--log-format"),
    Option("log_level", variables.LOG_LEVEL, "--log-level"),
    Option("mixture", variables.MIXTURE, "--mixture"),
)


def where_set(field: str) -> str:
    """Where a user sets `field`, for an error that asks them to change it:
    `--metrics-port / $SHARDCACHE_METRICS_PORT`."""
    for option in OPTIONS:
        if option.field == field:
            return f"{option.flag} / ${option.variable.env}"
    raise KeyError(field)


def from_env(
    environ: Mapping[str, str] | None = None, overrides: Mapping[str, Any] | None = None
) -> Settings:
    """Settings from the environment, then `overrides` (command-line flags; None = unset).

    The socket is $SHARDCACHE_SOCKET, else `<run dir>/<mount>/control.sock`; the memory
    directory $SHARDCACHE_MEMORY_DIR, else `<run dir>/<mount>/mem`, the layout the
    client derives from the same variables. Unset values take the table's defaults.
    """
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {option.field: option.variable.read(env) for option in OPTIONS}
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    run_dir = Path(values.pop("run_dir"))
    mount = values.pop("mount") or LOCAL_MOUNT
    # The environment's value is parsed already; one given in code is checked here: it
    # becomes a directory below the run directory (`variables.MOUNT_NAME` says why).
    variables.MOUNT_NAME("--mount", mount)
    # A socket moved by flag moves nothing else: the memory tier stays where the
    # run directory and mount put it.
    values["socket_path"] = Path(values["socket_path"] or contract.socket_path(run_dir, mount))
    values["memory_dir"] = Path(values["memory_dir"] or contract.memory_dir(run_dir, mount))
    values["disk_dir"] = Path(values["disk_dir"])
    values["handed_manifests_dir"] = Path(values["handed_manifests_dir"])
    values["credentials_dir"] = Path(values["credentials_dir"])
    values["termination_message_path"] = Path(values["termination_message_path"])
    values["source_uri"] = values["source_uri"] or ""
    values["checkpoint"] = agent_config.CheckpointSettings.from_env(env)
    return Settings(**values)
