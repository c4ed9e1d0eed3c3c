"""The contract table: every `SHARDCACHE_*` variable that crosses a process boundary.

One row per variable: its name, its parser (type and range), the DatasetMount spec
field it comes from, its default (defined here once), who reads it and which
containers the webhook writes it into. Everything else loops over `TABLE`:

* the spec model (`shardcache_operator.specs`) takes its field defaults from the rows,
  so the generated CRD shows them too;
* the webhook's env builders (`shardcache_operator.injection`) write the rows marked
  for the sidecar or the trainer containers;
* the sidecar's settings and flags, the checkpoint agent's settings, the client
  (`sidecar_client`) and the local launcher read and write through `Variable.read`,
  `Variable.get` and `Variable.render`.

docs/wire-format.md ("Environment") shows this table; tests/unit/test_contract_table.py
checks it against the CRD's defaults, the docs and what the webhook writes.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping
from typing import Any, Final, Generic, TypeVar

from shardcache import errors, plans
from shardcache.contract import log_levels, mixture_sources, parsers

T = TypeVar("T")

GiB: Final = 1 << 30
MiB: Final = 1 << 20


class Reader(enum.Enum):
    """Who reads a variable."""

    SIDECAR = "sidecar"
    #: The sidecar's checkpoint agent (`shardcache_sidecar.checkpoint`).
    AGENT = "agent"
    #: The trainer process: `shardcache.open()`, `shardcache.checkpoint`, user code.
    TRAINER = "trainer"


class Container(enum.Enum):
    """Where the webhook writes a variable."""

    SIDECAR = "sidecar"
    TRAINER = "trainer"


class _Same(enum.Enum):
    SAME = "same"


#: `Variable.spec_default` when the spec's default is the variable's own.
SAME: Final = _Same.SAME


@dataclasses.dataclass(frozen=True)
class Variable(Generic[T]):
    """One row of the contract table."""

    env: str
    parser: parsers.Parser[T]
    #: What readers use when the variable is unset or empty; None: no value (the doc
    #: says what that means).
    default: T | None
    readers: frozenset[Reader]
    doc: str
    #: The DatasetMount spec field (JSON path below `spec`) the webhook takes it from.
    spec_field: str | None = None
    #: The spec field's default when it is not `default`: None for optional fields
    #: the webhook then leaves unset (so the reader's default applies).
    spec_default: T | _Same | None = SAME
    #: Containers the webhook writes it into; empty: set by hand or by the launcher.
    injected: frozenset[Container] = frozenset()

    def parse(self, text: str) -> T:
        """`text` as this variable's value; `InputError` names the variable."""
        return self.parser(f"${self.env}", text)

    def get(self, environ: Mapping[str, str]) -> T | None:
        """The value set in `environ`, or None when unset or empty."""
        text = environ.get(self.env, "")
        return self.parse(text) if text.strip() else None

    def read(self, environ: Mapping[str, str]) -> T | None:
        """The value set in `environ`, else the default."""
        value = self.get(environ)
        return self.default if value is None else value

    def render(self, value: T) -> str:
        """`value` as the text this variable carries (booleans as true/false)."""
        return parsers.render(value)

    @property
    def spec_value_default(self) -> T | None:
        """The default of `spec_field` in the spec model (None: none)."""
        return self.default if self.spec_default is SAME else self.spec_default

    @property
    def required_default(self) -> T:
        """The default, for a reader's typed dataclass field; only rows that have one."""
        if self.default is None:
            raise TypeError(f"{self.env} has no default")
        return self.default


def _readers(*readers: Reader) -> frozenset[Reader]:
    return frozenset(readers)


def _into(*containers: Container) -> frozenset[Container]:
    return frozenset(containers)


_SIDECAR = _readers(Reader.SIDECAR)
_AGENT = _readers(Reader.AGENT)
_IN_SIDECAR = _into(Container.SIDECAR)

# --- where things are -------------------------------------------------------------
RUN_DIR: Final = Variable(
    "SHARDCACHE_RUN_DIR",
    parsers.PATH,
    "/var/run/shardcache",
    _readers(Reader.SIDECAR, Reader.TRAINER),
    "Root of the pod's shared run directory; each mount has a subdirectory holding its "
    "control socket and memory tier.",
    injected=_into(Container.SIDECAR, Container.TRAINER),
)
#: A DatasetMount's name, as Kubernetes allows it (a DNS-1123 subdomain, lower case) and
#: the webhook injects it: the sidecar makes it one directory below the run directory,
#: so `..`, `a/b` or `.` would move the socket and memory tier out of their place.
#: (`pattern` ignores case; `(?-i:...)` keeps the lower case Kubernetes requires.)
MOUNT_NAME: Final = parsers.pattern(
    r"(?-i:(?=.{1,253}\Z)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*)",
    expected="a DatasetMount name (lower-case letters, digits, '-' and '.', each "
    "'.'-separated part starting and ending with a letter or digit; at most 253 characters)",
    kind="DatasetMount name",
)
MOUNT: Final = Variable(
    "SHARDCACHE_MOUNT",
    MOUNT_NAME,
    None,
    _readers(Reader.SIDECAR, Reader.TRAINER),
    "The DatasetMount a sidecar serves, and the one `shardcache.open()` uses when given "
    "none (a value the user set on a trainer is kept). Unset: the trainer is not in an "
    "injected pod; a sidecar started by hand serves the mount `default`.",
    injected=_into(Container.SIDECAR, Container.TRAINER),
)
MOUNTS: Final = Variable(
    "SHARDCACHE_MOUNTS",
    parsers.WORDS,
    None,
    _readers(Reader.TRAINER),
    "Every DatasetMount injected into the pod, comma-separated, for trainers that read several.",
    injected=_into(Container.TRAINER),
)
SOCKET: Final = Variable(
    "SHARDCACHE_SOCKET",
    parsers.PATH,
    None,
    _readers(Reader.SIDECAR, Reader.TRAINER),
    "The control socket; overrides the one derived from the run directory and the mount "
    "(`<run dir>/<mount>/control.sock`).",
    injected=_IN_SIDECAR,
)
MEMORY_DIR: Final = Variable(
    "SHARDCACHE_MEMORY_DIR",
    parsers.PATH,
    None,
    _SIDECAR,
    "The memory tier; unset: `<run dir>/<mount>/mem`, where trainers look for it.",
    injected=_IN_SIDECAR,
)
DISK_DIR: Final = Variable(
    "SHARDCACHE_DISK_DIR",
    parsers.PATH,
    "/var/cache/shardcache",
    _SIDECAR,
    "The node disk tier in the sidecar container. The webhook mounts only "
    "`ns-<namespace>.<uid>` (the namespace's name and UID) of the hostPath "
    "spec.cache.nodePath (a subPath), at "
    "`ns-<namespace>` below the default, and points each sidecar there, so tenants "
    "never share cache entries nor see each other's.",
    injected=_IN_SIDECAR,
)
METRICS_PORT: Final = Variable(
    "SHARDCACHE_METRICS_PORT",
    parsers.integer(minimum=0, maximum=65535),
    8470,
    _SIDECAR,
    "TCP port of /healthz, /readyz and /metrics (nothing else: the inspector has its "
    "own loopback port); the webhook picks the first free port from this one, within the "
    "operator's SHARDCACHE_OPERATOR_METRICS_PORT_FIRST-LAST (the chart's "
    "networkPolicy.metricsPorts). The "
    "control API stays on the Unix socket.",
    injected=_IN_SIDECAR,
)
UI_PORT: Final = Variable(
    "SHARDCACHE_UI_PORT",
    parsers.integer(minimum=0, maximum=65535),
    8490,
    _SIDECAR,
    "TCP port of the web inspector (/ui), bound to 127.0.0.1 only: reach it with "
    "kubectl port-forward; the webhook picks the first free port from this one.",
    injected=_IN_SIDECAR,
)
METRICS_HOST: Final = Variable(
    "SHARDCACHE_METRICS_HOST",
    parsers.TEXT,
    "0.0.0.0",
    _SIDECAR,
    "Address of the probe and metrics listener; all interfaces because kubelet probes "
    "arrive on the pod IP (the local launcher uses 127.0.0.1).",
)
TERMINATION_MESSAGE_PATH: Final = Variable(
    "SHARDCACHE_TERMINATION_MESSAGE_PATH",
    parsers.PATH,
    "/dev/termination-log",
    _SIDECAR,
    "File the sidecar writes why it exits into (a refusal, unusable tier directories), "
    "so `kubectl describe pod` shows it: the injected sidecar container's "
    "terminationMessagePath, which is this default. Written only when it exists (the "
    "kubelet makes it): outside Kubernetes nothing is written.",
)
LOG_FORMAT: Final = Variable(
    "SHARDCACHE_LOG_FORMAT",
    parsers.choice("json", "text"),
    "json",
    _SIDECAR,
    "Sidecar log lines: json (one object per line, for log pipelines) or text.",
)
LOG_LEVEL: Final = Variable(
    "SHARDCACHE_LOG_LEVEL",
    log_levels.PARSER,
    "INFO",
    _SIDECAR,
    "Sidecar log level (a Python logging level name), optionally with levels for single "
    "loggers: INFO,shardcache_sidecar.slow=DEBUG.",
)

# --- the dataset and its cache ------------------------------------------------------
SOURCE_URI: Final = Variable(
    "SHARDCACHE_SOURCE_URI",
    parsers.URI,
    None,
    _SIDECAR,
    "Dataset URI (s3://bucket/prefix, file:///data, ...). Required by the sidecar.",
    spec_field="source.uri",
    injected=_IN_SIDECAR,
)
SOURCE_FORMAT: Final = Variable(
    "SHARDCACHE_SOURCE_FORMAT",
    parsers.choice("parquet", "arrow", "jsonl"),
    None,
    _SIDECAR,
    "Shard format. Unset (a sidecar started by hand): inferred from the file names; "
    "the spec always names one, so every pod and the operator agree.",
    spec_field="source.format",
    spec_default="parquet",
    injected=_IN_SIDECAR,
)
MANIFEST_DIGEST: Final = Variable(
    "SHARDCACHE_MANIFEST_DIGEST",
    parsers.DIGEST,
    None,
    _SIDECAR,
    "The pinned manifest digest (status.manifestDigest, else spec.source.version); when "
    "the source resolves to another, no data is served. Unset: not pinned.",
    injected=_IN_SIDECAR,
)
HANDED_MANIFESTS_DIR: Final = Variable(
    "SHARDCACHE_HANDED_MANIFESTS_DIR",
    parsers.PATH,
    "/etc/shardcache/manifests",
    _SIDECAR,
    "Where the webhook mounts the pinned manifests the operator hands over "
    "(`shardcache.node.handed_manifests`): a sidecar that finds its pin there, and no "
    "copy on its node, starts without reading the dataset to hash it.",
    injected=_IN_SIDECAR,
)
CREDENTIALS_DIR: Final = Variable(
    "SHARDCACHE_CREDENTIALS_DIR",
    parsers.PATH,
    "/etc/shardcache/credentials",
    _readers(Reader.SIDECAR, Reader.AGENT),
    "Where the webhook mounts the DatasetMount's Secret (`spec.source.secretRef`) as "
    "files, read-only, in the sidecar only. When the store refuses the credentials in "
    "use, the sidecar and its checkpoint agent read AWS_ACCESS_KEY_ID, "
    "AWS_SECRET_ACCESS_KEY and AWS_SESSION_TOKEN there again "
    "(`shardcache.source_credentials`): a key rotated in the Secret reaches a running "
    "pod once the kubelet updates the files, without a restart. Credentials there "
    "replace the environment's; a directory without them leaves the environment alone.",
    injected=_IN_SIDECAR,
)
MEMORY_LIMIT: Final = Variable(
    "SHARDCACHE_MEMORY_LIMIT_BYTES",
    parsers.BYTES,
    # The sizeLimit of the pod's memory volume, and what the sidecar's memory limit is
    # raised by: 2 GiB holds a few decoded shards of a typical dataset ahead of a
    # reader without doubling a small sidecar's footprint.
    2 * GiB,
    _SIDECAR,
    "Bytes of decoded shards in the memory tier.",
    spec_field="cache.memory",
    injected=_IN_SIDECAR,
)
#: The run volume's room over the memory tier's limit, as a fraction of that limit. The
#: webhook sizes the pod's memory volume `run_volume_bytes(cache.memory)` and raises the
#: sidecar's memory limit by as much; the sidecar counts that much of its cgroup limit
#: as tmpfs pages, not as room to decode in (`shardcache.node.quotas.decode_room`).
#: Why a quarter: the tier counts only its files, but a rank keeps the batch it last
#: used (a zero-copy slice that maps its whole shard) while it asks for the next, so an
#: evicted shard's pages stay in the volume until it moves on: one decoded shard per
#: local rank beyond the limit. A quarter covers that while the tier holds four or more
#: decoded shards per local rank; admission warns a pod whose ranks' shards exceed it
#: (`shardcache_operator.volume_room`), and a sidecar whose ranks all wait for room they
#: hold themselves fails their acquires with what the volume needs
#: (`shardcache.node.volume_cycles`). The operator sizes with these two, not a copy.
RUN_VOLUME_HEADROOM: Final = 0.25


#: The least memory limit a sidecar can start in, besides its memory tier's volume (the
#: webhook adds that on top: `run_volume_bytes`): the process holds 100-150 MiB resident
#: once it listens (interpreter, pyarrow, aiohttp, the manifest; 143 MB measured with 8
#: ranks, `shardcache.node.quotas.process_base`), and a 40Mi limit was OOMKilled at every
#: start. The operator refuses a spec below it (`spec.sidecar.resources.limits.memory`);
#: the margin over 150 MiB leaves a little room to decode a small shard in. Below
#: `quotas.BASE_MEMORY_BYTES` (256 MiB), since sidecars given 256Mi serve.
SIDECAR_MEMORY_FLOOR: Final = 192 * MiB


def run_volume_bytes(memory_tier_bytes: int) -> int:
    """The run volume's sizeLimit for a memory tier of `memory_tier_bytes`: the tier plus
    `RUN_VOLUME_HEADROOM`, the headroom rounded up to whole MiB."""
    headroom = -(-int(memory_tier_bytes * RUN_VOLUME_HEADROOM) // MiB) * MiB
    return memory_tier_bytes + headroom


DISK_LIMIT: Final = Variable(
    "SHARDCACHE_DISK_LIMIT_BYTES",
    parsers.BYTES,
    # Source bytes shared by every pod on the node: room for several datasets on a
    # typical node's local disk.
    50 * GiB,
    _SIDECAR,
    "Bytes of source shards in the node disk tier (LRU, shared by the node's pods); a "
    "limit above the size of the tier's volume is clamped to that size at start "
    "(logged: a WARNING when set, INFO for the default).",
    spec_field="cache.disk",
    injected=_IN_SIDECAR,
)
PREFETCH_DEPTH: Final = Variable(
    "SHARDCACHE_PREFETCH_DEPTH",
    parsers.integer(minimum=0, maximum=1024),
    # Enough to hide one slow fetch behind the shards a reader is consuming, while a
    # memory tier of 2 GiB still holds them.
    4,
    _SIDECAR,
    "Shards decoded ahead of each reader's position (0 disables read-ahead).",
    spec_field="prefetch.depth",
    injected=_IN_SIDECAR,
)
PREFETCH_ADAPTIVE: Final = Variable(
    "SHARDCACHE_PREFETCH_ADAPTIVE",
    parsers.BOOLEAN,
    # On: it only ever deepens the read-ahead of a reader that waits on cold shards,
    # within room the memory tier has beside every reader's window, and backs off when
    # the stall clears; a fixed depth is one variable away.
    True,
    _SIDECAR,
    "Tune each reader's read-ahead from its data-stall signal: deeper (up to the max "
    "depth and what the memory tier holds) while it waits on cold shards, back to the "
    "depth once it no longer does (docs/monitoring.md). false: the depth stays fixed.",
    spec_field="prefetch.adaptive",
    injected=_IN_SIDECAR,
)
PREFETCH_MAX_DEPTH: Final = Variable(
    "SHARDCACHE_PREFETCH_MAX_DEPTH",
    parsers.integer(minimum=0, maximum=1024),
    # Four times the default depth: deeper rarely hides more of a store's latency (the
    # fetch concurrency bounds how many shards arrive at once), and the memory tier
    # bounds it anyway.
    16,
    _SIDECAR,
    "Deepest the sidecar tunes a reader's read-ahead to (never below the depth, never "
    "beyond what the memory tier holds beside the other readers' windows).",
    spec_field="prefetch.maxDepth",
    injected=_IN_SIDECAR,
)
FETCH_CONCURRENCY: Final = Variable(
    "SHARDCACHE_FETCH_CONCURRENCY",
    parsers.integer(minimum=0, maximum=256),
    # Each fetch is followed by a decode that takes a core, so the right number is the
    # container's CPUs: a fixed 4 left 12 of 16 cores idle in a cold epoch and would
    # overcommit a 2-CPU pod. 0 sizes it from the CPU quota and the memory limit.
    0,
    _SIDECAR,
    "Shards fetched from the source (and decoded) at the same time; 0: one per CPU of "
    "the container's CPU quota (cgroup), as many as its memory limit holds beside the "
    "memory tier.",
    spec_field="prefetch.concurrency",
    injected=_IN_SIDECAR,
)
READY_SHARDS: Final = Variable(
    "SHARDCACHE_READY_SHARDS",
    parsers.integer(minimum=0),
    # Two: the first shard to read and the next, so neither the first step nor the one
    # after it waits on the object store. The native sidecar's startup probe is there
    # to hold the trainer until its data is warm; 0 would start it on a cold cache. The
    # gate opens early, and says so, when they do not fit in the memory tier together.
    2,
    _SIDECAR,
    "Shards of the startup plan resident before /readyz passes (0: ready as soon as the "
    "manifest is verified).",
    spec_field="prefetch.readyShards",
    injected=_IN_SIDECAR,
)


def _mixture(text: str) -> mixture_sources.Mixture:
    try:
        return mixture_sources.Mixture.parse(text)
    except errors.InputError as exc:
        raise parsers.ParseError(
            "a mixture as JSON (docs/operator.md, Mixtures)", str(exc)
        ) from exc


MIXTURE: Final = Variable(
    "SHARDCACHE_MIXTURE",
    parsers.Parser("mixture JSON", _mixture),
    None,
    _SIDECAR,
    "Every source of a multi-source DatasetMount (spec.mixture) with its weight and "
    "pinned digest, as JSON; the first is spec.source. Unset: one source. The sidecar "
    "serves each and writes them to <run dir>/<mount>/mixture.json for "
    "shardcache.open_mixture().",
    injected=_IN_SIDECAR,
)

# --- the reading plan ----------------------------------------------------------------
# The sidecar registers a reader of its own with these (its startup plan); trainer
# containers get them too, as `shardcache.open()`'s defaults for the pod's first mount
# (`shardcache._plan_defaults`), so without arguments the trainer reads in the order the
# sidecar warmed up for. Rank and world size stay the sidecar's: trainers pass their own.
_PLAN_READERS = _readers(Reader.SIDECAR, Reader.TRAINER)
_PLAN_INTO = _into(Container.SIDECAR, Container.TRAINER)

SEED: Final = Variable(
    "SHARDCACHE_SEED",
    parsers.integer(),
    0,
    _PLAN_READERS,
    "Seed of the shard and block permutation; in trainers, `shardcache.open()`'s default "
    "for the pod's first mount.",
    spec_field="sharding.seed",
    injected=_PLAN_INTO,
)
SHUFFLE: Final = Variable(
    "SHARDCACHE_SHUFFLE",
    parsers.BOOLEAN,
    True,
    _PLAN_READERS,
    "Shuffle each epoch, at $SHARDCACHE_SHUFFLE_GRANULARITY (false: file order); in "
    "trainers, `open()`'s default for the pod's first mount.",
    spec_field="sharding.shuffle",
    injected=_PLAN_INTO,
)
BLOCK_SIZE: Final = Variable(
    "SHARDCACHE_BLOCK_SIZE",
    parsers.integer(minimum=1),
    plans.DEFAULT_BLOCK_SIZE,
    _PLAN_READERS,
    "Rows per shuffle block inside a shard; in trainers, `open()`'s default for the pod's "
    "first mount.",
    spec_field="sharding.blockSize",
    spec_default=None,
    injected=_PLAN_INTO,
)
SHUFFLE_GRANULARITY: Final = Variable(
    "SHARDCACHE_SHUFFLE_GRANULARITY",
    parsers.choice(*plans.GRANULARITIES),
    # Block mode reads zero-copy slices; sample mode costs a gather per batch and a
    # window of shards in the memory tier, so it is asked for (docs/reading-plan.md).
    plans.BLOCK,
    _PLAN_READERS,
    "What a shuffle permutes: block (shards, then blocks of rows) or sample (also rows, "
    "within windows spanning shards); in trainers, the mode `open()` reads the pod's first "
    "mount in when `shuffle` is left out or True.",
    spec_field="sharding.granularity",
    injected=_PLAN_INTO,
)
SHUFFLE_WINDOW: Final = Variable(
    "SHARDCACHE_SHUFFLE_WINDOW",
    parsers.integer(minimum=1),
    plans.DEFAULT_WINDOW,
    _PLAN_READERS,
    "Rows per sample-shuffle window (sample granularity only); the sidecar keeps the "
    "shards of a reader's current and next window resident. In trainers, `open()`'s "
    "default for the pod's first mount.",
    spec_field="sharding.window",
    injected=_PLAN_INTO,
)
WORLD_SIZE: Final = Variable(
    "SHARDCACHE_WORLD_SIZE",
    parsers.integer(minimum=1),
    1,
    _SIDECAR,
    "Ranks reading the dataset (the pod annotation shardcache.io/world-size wins over the spec).",
    spec_field="sharding.worldSize",
    spec_default=None,
    injected=_IN_SIDECAR,
)
RANK: Final = Variable(
    "SHARDCACHE_RANK",
    parsers.integer(minimum=0),
    0,
    _SIDECAR,
    "This pod's rank: spec.sharding.rank with rankFrom Fixed, the Indexed Job's "
    "completion index (downward API) with JobCompletionIndex.",
    spec_field="sharding.rank",
    spec_default=None,
    injected=_IN_SIDECAR,
)
LOCAL_RANKS: Final = Variable(
    "SHARDCACHE_LOCAL_RANKS",
    parsers.integer(minimum=1),
    # One: a pod's sidecar serves its own rank; filling other ranks' epochs would fetch
    # shards that other pods read (docs/benchmarks.md, "The cold fill").
    1,
    _SIDECAR,
    "Ranks this sidecar serves, from SHARDCACHE_RANK on: their epochs are filled from "
    "start-up, before their trainers open the dataset (a sidecar shared by the ranks "
    "of a node). 1: this pod's rank alone; other ranks' shards are never fetched "
    "before a reader of them registers.",
)

# --- checkpoints ------------------------------------------------------------------------
CHECKPOINT_DIR: Final = Variable(
    "SHARDCACHE_CHECKPOINT_DIR",
    parsers.PATH,
    None,
    _readers(Reader.AGENT, Reader.TRAINER),
    "The checkpoint volume, shared by the trainer (it commits checkpoints into it) and "
    "the agent (it uploads and restores them). Required by the agent.",
    spec_field="checkpoint.mountPath",
    spec_default="/checkpoints",
    injected=_into(Container.SIDECAR, Container.TRAINER),
)
CHECKPOINT_URI: Final = Variable(
    "SHARDCACHE_CHECKPOINT_URI",
    parsers.URI,
    None,
    _AGENT,
    "Object store prefix checkpoints are published under (ranked pods: `<uri>/rank-<rank>`). "
    "Unset: no checkpoint agent.",
    spec_field="checkpoint.uri",
    injected=_IN_SIDECAR,
)
CHECKPOINT_KEEP_LAST: Final = Variable(
    "SHARDCACHE_CHECKPOINT_KEEP_LAST",
    parsers.integer(minimum=1),
    # The newest, a fallback if it turns out damaged, and one more while a new one is
    # being published.
    3,
    _AGENT,
    "Published checkpoints kept, in the store and on the node.",
    spec_field="checkpoint.keepLast",
    injected=_IN_SIDECAR,
)
CHECKPOINT_RESTORE: Final = Variable(
    "SHARDCACHE_CHECKPOINT_RESTORE",
    parsers.pattern(
        r"latest|none|[0-9]+",
        expected="latest, none or a step number",
        kind="latest/none/step",
    ),
    "latest",
    _AGENT,
    "What the agent restores before the trainer starts.",
    spec_field="checkpoint.restore",
    injected=_IN_SIDECAR,
)
CHECKPOINT_RESTORE_FALLBACK: Final = Variable(
    "SHARDCACHE_CHECKPOINT_RESTORE_FALLBACK",
    parsers.BOOLEAN,
    # Silently resuming from an older model is a decision the user must make.
    False,
    _AGENT,
    "Restore the next older published checkpoint when the chosen one does not match its manifest.",
    spec_field="checkpoint.restoreFallback",
    injected=_IN_SIDECAR,
)
CHECKPOINT_CONCURRENCY: Final = Variable(
    "SHARDCACHE_CHECKPOINT_CONCURRENCY",
    parsers.integer(minimum=1, maximum=256),
    # Keeps a 2-core sidecar busy hashing while the network stays full.
    8,
    _AGENT,
    "Checkpoint files uploaded (and downloaded at restore) at the same time.",
    spec_field="checkpoint.concurrency",
    injected=_IN_SIDECAR,
)
CHECKPOINT_VERIFY_UPLOADS: Final = Variable(
    "SHARDCACHE_CHECKPOINT_VERIFY_UPLOADS",
    parsers.BOOLEAN,
    # It doubles the traffic, and restore verifies every byte anyway.
    False,
    _AGENT,
    "Read every uploaded object back and compare its sha256 before publishing.",
    spec_field="checkpoint.verifyUploads",
    injected=_IN_SIDECAR,
)
CHECKPOINT_UPLOAD_BUFFER: Final = Variable(
    "SHARDCACHE_CHECKPOINT_UPLOAD_BUFFER_BYTES",
    parsers.BYTES,
    # Lets a lone large file keep its multipart upload busy; counts against the
    # sidecar's memory limit.
    512 * MiB,
    _AGENT,
    "Bytes of upload parts held in memory across all files being uploaded.",
    spec_field="checkpoint.uploadBuffer",
    injected=_IN_SIDECAR,
)

CHECKPOINT_DRAIN: Final = Variable(
    "SHARDCACHE_CHECKPOINT_DRAIN_SECONDS",
    parsers.SECONDS,
    # Inside Kubernetes' default 30 s grace period with room to log: past it the kubelet
    # kills the process and nobody learns which commits never went up.
    25.0,
    _AGENT,
    "Seconds the checkpoint agent keeps publishing what is committed after SIGTERM; "
    "then it logs the steps it did not upload (the standalone agent exits 1). An "
    "upload stuck on a store that does not answer ends there.",
)

# --- the client ---------------------------------------------------------------------
RECONNECT_TIMEOUT: Final = Variable(
    "SHARDCACHE_RECONNECT_TIMEOUT_SECONDS",
    parsers.SECONDS,
    # A crashed native sidecar is restarted within seconds, but the kubelet's back-off
    # grows to tens of seconds after repeated crashes; two minutes rides out the first few.
    120.0,
    _readers(Reader.TRAINER),
    "Seconds a trainer keeps retrying a sidecar that does not answer.",
)

#: Every row, in the order the webhook writes them.
TABLE: Final[tuple[Variable[Any], ...]] = (
    MOUNT,
    RUN_DIR,
    MOUNTS,
    SOCKET,
    SOURCE_URI,
    SOURCE_FORMAT,
    MANIFEST_DIGEST,
    HANDED_MANIFESTS_DIR,
    CREDENTIALS_DIR,
    MIXTURE,
    MEMORY_DIR,
    MEMORY_LIMIT,
    DISK_DIR,
    DISK_LIMIT,
    PREFETCH_DEPTH,
    PREFETCH_ADAPTIVE,
    PREFETCH_MAX_DEPTH,
    FETCH_CONCURRENCY,
    READY_SHARDS,
    SEED,
    SHUFFLE,
    BLOCK_SIZE,
    SHUFFLE_GRANULARITY,
    SHUFFLE_WINDOW,
    WORLD_SIZE,
    RANK,
    LOCAL_RANKS,
    METRICS_PORT,
    UI_PORT,
    METRICS_HOST,
    TERMINATION_MESSAGE_PATH,
    LOG_FORMAT,
    LOG_LEVEL,
    CHECKPOINT_DIR,
    CHECKPOINT_KEEP_LAST,
    CHECKPOINT_RESTORE,
    CHECKPOINT_RESTORE_FALLBACK,
    CHECKPOINT_CONCURRENCY,
    CHECKPOINT_VERIFY_UPLOADS,
    CHECKPOINT_UPLOAD_BUFFER,
    CHECKPOINT_DRAIN,
    CHECKPOINT_URI,
    RECONNECT_TIMEOUT,
)

BY_ENV: Final[Mapping[str, Variable[Any]]] = {v.env: v for v in TABLE}


def read_by(reader: Reader) -> tuple[Variable[Any], ...]:
    return tuple(v for v in TABLE if reader in v.readers)


#: Rows per container, in `TABLE`'s order: the webhook asks for every pod it admits.
_INJECTED: Final[Mapping[Container, tuple[Variable[Any], ...]]] = {
    container: tuple(v for v in TABLE if container in v.injected) for container in Container
}


def injected_into(container: Container) -> tuple[Variable[Any], ...]:
    return _INJECTED[container]


def environ(values: Iterable[tuple[Variable[Any], object]]) -> dict[str, str]:
    """`{name: text}` for (variable, value) pairs, e.g. a launcher's sidecar env.

    Each text is parsed back, so a value its readers would refuse fails here, naming
    the variable, rather than in the process that reads it.
    """
    result: dict[str, str] = {}
    for variable, value in values:
        text = parsers.render(value)
        variable.parse(text)
        result[variable.env] = text
    return result
