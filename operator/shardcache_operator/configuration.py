"""Operator settings: a typed dataclass read once at start-up from env, then CLI flags.

Every field names its environment variable (prefix SHARDCACHE_OPERATOR_); the Helm
chart sets them. Units are in the field names or comments. The values are parsed with
the contract's parsers (`shardcache.contract.parsers`), like every other setting: strict
booleans, and errors that name the variable, what was expected and what was found.
"""

from __future__ import annotations

import dataclasses
import posixpath
from collections.abc import Mapping
from typing import Any

from shardcache import contract, errors
from shardcache.contract import parsers
from shardcache_operator import authority, endpoint_policy, specs

ENV_PREFIX = "SHARDCACHE_OPERATOR_"
POLICIES = ("Refuse", "Admit")


@dataclasses.dataclass(frozen=True)
class Settings:
    # --- what gets injected ---------------------------------------------------------
    #: Sidecar image when a DatasetMount names none; the chart pins it to its version.
    sidecar_image: str = "localhost/shardcache:0.1.0"
    #: Run directory inside pods (socket and memory tier live below it).
    run_dir: str = contract.DEFAULT_RUN_DIR
    #: Non-root UID of the sidecar. 65532 is the conventional "nonroot" user of
    #: distroless images, so it exists in the image without an /etc/passwd edit.
    sidecar_uid: int = 65532
    #: Seconds a sidecar may take to get ready (checkpoint restore, warm-up) before
    #: kubelet restarts it; 10 minutes covers a multi-GiB restore on a slow link.
    startup_timeout_seconds: int = 600
    #: The sidecars' probe/metrics ports: the first mount of a pod gets the first free
    #: one from `metrics_port_first`, further mounts the next, never above
    #: `metrics_port_last`: the chart renders both from networkPolicy.metricsPorts, the
    #: ports its NetworkPolicy opens to Prometheus and the operator. A mount with no
    #: free port left in the range follows its spec.admission.policy (refused, or
    #: admitted without its cache; `admission`). Ten ports: ten mounts, or a trainer's
    #: own ports among them.
    metrics_port_first: int = contract.DEFAULT_METRICS_PORT
    metrics_port_last: int = contract.DEFAULT_METRICS_PORT + 9
    #: What to do with a pod whose DatasetMount does not exist: Refuse (default: the
    #: trainer would fail later anyway, louder and later) or Admit without injection.
    missing_policy: str = "Refuse"

    # --- what DatasetMounts may ask for (`authority.Policy`, docs/security.md) ----------
    #: hostPath directories spec.cache.nodePath may name (chart: policy.nodePaths).
    node_paths: tuple[str, ...] = authority.Policy.node_paths
    #: spec.cache.nodePath of DatasetMounts that name none (chart: nodeCache.path, the
    #: directory its node-cache DaemonSet prepares on every node).
    default_node_path: str = authority.Policy.default_node_path
    #: Images spec.sidecar.image may name besides `sidecar_image` (policy.sidecarImages).
    sidecar_images: tuple[str, ...] = authority.Policy.sidecar_images
    #: Caps in bytes on spec.cache.memory and spec.cache.disk; quantities in env
    #: ("64Gi"). See `authority.Policy` for why the defaults.
    max_cache_memory: int = authority.Policy.max_cache_memory
    max_cache_disk: int = authority.Policy.max_cache_disk
    #: Resolve file:// sources (the operator's own filesystem): single-tenant only.
    allow_file_sources: bool = False
    #: Lend tenants' sources the operator's ambient cloud identity (no secretRef, or a
    #: scheme other than s3://). Off: anonymous or refused (`sources.Access`).
    allow_ambient_credentials: bool = False
    #: Endpoints (origins, `scheme://host[:port]` or `scheme://*.suffix[:port]`) a
    #: tenant's Secret may point the operator at (policy.sourceEndpoints). Empty: any but
    #: the operator pod's loopback and link-local/metadata addresses, which are never a
    #: tenant's store (`endpoint_policy`).
    source_endpoints: tuple[endpoint_policy.Origin, ...] = ()

    # --- what is watched ----------------------------------------------------------------
    #: Namespaces to serve; empty means all (cluster-wide).
    namespaces: tuple[str, ...] = ()
    #: Namespaces where the operator hands each pinned manifest to the sidecars in
    #: ConfigMaps (`manifest_handoff`; chart: rbac.manifestNamespaces, which grants it
    #: ConfigMaps there and nowhere else). Elsewhere each node's first sidecar of a pin
    #: reads the whole dataset to hash it before it is ready.
    manifest_namespaces: tuple[str, ...] = ()

    # --- reconcile ------------------------------------------------------------------------
    #: Upper bound in seconds on one manifest resolution (listing + reading footers);
    #: a large bucket takes minutes, a hung endpoint must not stall the handler forever.
    resolve_timeout_seconds: float = 600.0
    #: Bytes of data (RLIMIT_DATA: heap, private mappings, thread stacks) each resolve's
    #: child process may map (`resolve_children`); over it the resolve fails
    #: `ResolveOverMemory`. A resolve of 200 shards maps about 140 MiB (90 MiB resident,
    #: most of it the interpreter and pyarrow); 256Mi resolves about 100,000 shards of
    #: one small schema (about 2 KB a shard: its listing entry and its manifest entry),
    #: 512Mi 200,000. Each read worker (`read_workers`) may map as much. Quantities in
    #: env ("256Mi").
    resolve_memory: int = 256 << 20
    #: Resolve children at once across all namespaces (`resolve_slots`); 0: as many as
    #: the operator container's memory limit holds at `resolve_memory` each beside the
    #: operator itself (`resolve_slots.capacity_for`, at least 2; no cap without a limit).
    resolve_children: int = 0
    #: Periodic reads of tenants' stores at once across all namespaces (the source
    #: checks and the applied skips), each in a worker process that may map
    #: `resolve_memory` (`read_workers`); a namespace holds one of them at a time.
    read_workers: int = 2
    #: First retry delay in seconds after a source error; doubles up to the maximum.
    backoff_initial_seconds: float = 5.0
    #: Cap in seconds on the retry delay: a broken source is re-tried every 5 minutes.
    backoff_max_seconds: float = 300.0
    #: Seconds between reachability checks of a pinned source (one metadata request);
    #: a source that went away turns the mount Degraded within this.
    source_check_seconds: float = 300.0
    #: Seconds pod changes are gathered before status.attachedPods is written: a burst of
    #: 1,000 pods becomes one patch per mount per interval, not one per pod. Counts are
    #: driven by pod events (no timer); 2 s keeps the Pods column current to the eye.
    pods_interval_seconds: float = 2.0
    #: Seconds between looks for skips the sidecars applied at restore: one listing of
    #: the checkpoint store per DatasetMount that has spec.checkpoint (status.lastSkip).
    #: A skip is a rare, human-started event; a minute is soon enough to see it, and
    #: 500 mounts cost one listing each per minute, not per pod interval.
    skips_interval_seconds: float = 60.0
    #: Seconds between looks at the stall fraction of each mount's running pods (one
    #: LIST of the mount's running pods and one /metrics GET per sidecar): DataStarved.
    #: Starvation that matters lasts minutes (spec.stall.forSeconds, 120 s by default).
    #: 0 turns the checks off.
    stall_check_seconds: float = 30.0
    #: Seconds between checks while a deleted DatasetMount waits for its pods.
    deletion_poll_seconds: float = 15.0

    # --- webhook --------------------------------------------------------------------------
    #: Serve the mutating webhook (off: reconcile only, e.g. a second operator set).
    webhook_enabled: bool = True
    #: Address the HTTPS webhook listens on (all interfaces in a pod; loopback locally).
    webhook_addr: str = "0.0.0.0"
    #: 9443 is the conventional webhook port; unprivileged, so no capability is needed.
    webhook_port: int = 9443
    #: Host name the API server uses in a managed webhook configuration's URL.
    webhook_host: str | None = None
    #: Serving certificate, key and CA bundle files (e.g. from the chart's Secret). When
    #: unset, a CA and serving certificate are generated at start-up.
    webhook_cert_file: str | None = None
    webhook_key_file: str | None = None
    webhook_ca_file: str | None = None
    #: Where generated certificates are written (a temporary directory when unset).
    webhook_cert_dir: str | None = None
    #: Extra DNS names / IPs for a generated certificate (comma-separated in env).
    webhook_sans: tuple[str, ...] = ()
    #: Name of a MutatingWebhookConfiguration the operator creates and keeps up to date
    #: (with caBundle); unset when the chart installs it.
    webhook_configuration: str | None = None

    # --- health, metrics, peering ---------------------------------------------------------
    #: /healthz and /metrics listener.
    health_addr: str = "0.0.0.0"
    health_port: int = 8080
    #: Peering object shared by replicas; the one with the highest priority is active.
    peering_name: str = "shardcache"
    #: This replica's peering priority; unset draws a random one so two replicas never
    #: tie (kopf freezes all operators of equal priority).
    priority: int | None = None
    #: Run without peering (a single replica, or tests without the peering CRD).
    standalone: bool = False
    #: kubeconfig for running outside the cluster; unset uses in-cluster config first.
    kubeconfig: str | None = None

    def policy(self) -> authority.Policy:
        return authority.Policy(
            node_paths=self.node_paths,
            default_node_path=self.default_node_path,
            sidecar_images=self.sidecar_images,
            max_cache_memory=self.max_cache_memory,
            max_cache_disk=self.max_cache_disk,
        )


def _quantity(text: str) -> int:
    try:
        return specs.parse_quantity(text, path="value")
    except errors.InputError:
        raise parsers.ParseError("a byte size like '64Gi' or 1048576", repr(text)) from None


def _absolute_path(text: str) -> str:
    # Mounted into every injected pod: a relative or unnormalised path is an invalid
    # mountPath (or names a directory other than the one it reads as).
    if not (
        text.startswith("/") and not text.startswith("//") and posixpath.normpath(text) == text
    ):
        raise parsers.ParseError(
            "an absolute, normalised path like /run/shardcache (no '.' or '..' segments, "
            "no '//', no trailing '/')",
            repr(text),
        )
    return text


_NODE_PATH = parsers.pattern(
    specs.NODE_PATH_PATTERN[1:-1],
    expected="an absolute path like /var/cache/shardcache "
    "(no '.' or '..' segments, no '//', no trailing '/')",
    kind="node path",
)


def _node_paths(text: str) -> tuple[str, ...]:
    # Each is compared with a mount's spec.cache.nodePath, which the CRD holds to the
    # same pattern: a path outside it could never be named, so it is a typo.
    return tuple(_NODE_PATH.convert(path) for path in parsers.words(text))


#: Below this a resolve of a few shards does not fit: the interpreter and pyarrow map
#: about 90 MiB, a resolve of 200 shards about 140 MiB (it failed at 128 one time in 3).
MIN_RESOLVE_MEMORY = 160 << 20


def _resolve_memory(text: str) -> int:
    size = _quantity(text)
    if size < MIN_RESOLVE_MEMORY:
        raise parsers.ParseError(
            f"a byte size of at least {MIN_RESOLVE_MEMORY >> 20}Mi (a resolve's process maps "
            "about 140 MiB for a few hundred shards)",
            repr(text),
        )
    return size


PORT = parsers.integer(minimum=0, maximum=65535)
_SECONDS = parsers.SECONDS

#: Each numeric or path setting's parser, with its range; the rest are read by their
#: annotated type (`_parser`). docs/operator.md, "Settings", states the ranges.
_PARSERS: dict[str, parsers.Parser[Any]] = {
    "run_dir": parsers.Parser("absolute path", _absolute_path),
    # 0 is root, which the injected runAsNonRoot refuses.
    "sidecar_uid": parsers.integer(minimum=1),
    "startup_timeout_seconds": parsers.integer(minimum=1),
    "missing_policy": parsers.choice(*POLICIES),
    "node_paths": parsers.Parser("comma-separated node paths", _node_paths),
    # A mount's own nodePath is held to the CRD's pattern; the default is held to it too.
    "default_node_path": _NODE_PATH,
    "source_endpoints": endpoint_policy.PARSER,
    "max_cache_memory": parsers.Parser("quantity", _quantity),
    "max_cache_disk": parsers.Parser("quantity", _quantity),
    "resolve_timeout_seconds": _SECONDS,
    "resolve_memory": parsers.Parser(
        f"quantity of at least {MIN_RESOLVE_MEMORY >> 20}Mi", _resolve_memory
    ),
    "resolve_children": parsers.integer(minimum=0),
    "read_workers": parsers.integer(minimum=1),
    "backoff_initial_seconds": _SECONDS,
    "backoff_max_seconds": _SECONDS,
    "source_check_seconds": _SECONDS,
    "pods_interval_seconds": _SECONDS,
    "skips_interval_seconds": _SECONDS,
    "stall_check_seconds": parsers.seconds(zero="off"),
    "deletion_poll_seconds": _SECONDS,
    # Declared on the sidecar container: a real port, not 0.
    "metrics_port_first": parsers.integer(minimum=1, maximum=65535),
    "metrics_port_last": parsers.integer(minimum=1, maximum=65535),
    # 0: any free port (tests, and local runs beside another operator).
    "webhook_port": PORT,
    "health_port": PORT,
    "priority": parsers.integer(),
}


def parser(name: str) -> parsers.Parser[Any]:
    """The parser of setting `name` (a field of `Settings`): its env text and flags."""
    field = next((f for f in dataclasses.fields(Settings) if f.name == name), None)
    if field is None:
        raise KeyError(name)
    return _parser(field)


def _parser(field: dataclasses.Field[Any]) -> parsers.Parser[Any]:
    """The contract's parser for a field: its own (`_PARSERS`), else by annotated type."""
    if field.name in _PARSERS:
        return _PARSERS[field.name]
    kind = str(field.type)
    if kind.startswith("bool"):
        return parsers.BOOLEAN
    if kind.startswith("tuple"):
        return parsers.WORDS
    if kind.startswith("str"):
        return parsers.TEXT
    # A number has a range: give it one in `_PARSERS` (tests hold every field to it).
    raise TypeError(f"setting {field.name} ({kind}) has no parser in _PARSERS")


def from_env(environ: Mapping[str, str], **overrides: Any) -> Settings:
    """Settings from SHARDCACHE_OPERATOR_* variables, then `overrides` (None = keep).

    Overrides (the CLI's flags) are held to the same parsers and ranges, named by their
    setting, so no value reaches the operator unchecked."""
    values: dict[str, Any] = {}
    fields = {field.name: field for field in dataclasses.fields(Settings)}
    for field in fields.values():
        name = ENV_PREFIX + field.name.upper()
        text = environ.get(name, "")
        if text.strip():
            values[field.name] = _parser(field)(f"${name}", text)
    for key, value in overrides.items():
        if value is None:
            continue
        if key not in fields:
            raise TypeError(f"no operator setting {key!r}")
        values[key] = _parser(fields[key])(key, parsers.render(value))
    settings = Settings(**values)
    if settings.metrics_port_first > settings.metrics_port_last:
        first, last = (ENV_PREFIX + f"METRICS_PORT_{end}" for end in ("FIRST", "LAST"))
        raise errors.InputError(
            f"${first} and ${last}: expected the first port <= the last (a range like "
            f"8470-8479), found {settings.metrics_port_first}-{settings.metrics_port_last}"
        )
    return settings
