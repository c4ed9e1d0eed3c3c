"""The DatasetMount spec model: the operator's reconcile, its webhook and `shardcache inject`.

One source of truth: the dataclasses below carry, per field, its JSON name, its
description, its default and its value checks. `from_dict` validates a `spec` mapping
against them (errors name the field path, what was expected and what was found), and
the operator generates the CRD's OpenAPI schema from the same metadata
(`shardcache_operator.crd`), so `kubectl explain` and this module never disagree.

Checks across fields are `Rule`s: a CEL expression for the API server
(`x-kubernetes-validations`) and the same check in Python for offline tools
(`shardcache inject`) and the webhook; a unit test evaluates both on the same documents.

It lives in the operator because only the operator reads DatasetMounts; what the
sidecar and trainers need of a spec reaches them as environment variables defined in
the contract (`shardcache.contract`).
"""

# `_field` wraps `dataclasses.field` to attach the schema metadata; ruff cannot tell.
# ruff: noqa: RUF009

from __future__ import annotations

import dataclasses
import decimal
import re
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

from shardcache import contract, errors, plans, uris
from shardcache.contract import parsers, variables

GROUP = "shardcache.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "DatasetMount"
PLURAL = "datasetmounts"
SINGULAR = "datasetmount"
SHORT_NAMES = ("dsm",)
#: The operator's finalizer on every DatasetMount (kopf's persistence setting).
FINALIZER = f"{GROUP}/finalizer"
#: `<this>=true` on a DatasetMount being deleted: remove the finalizer without waiting
#: for its pods to end (docs/operator.md, "Deletion and the finalizer").
ANNOTATION_FORCE_DELETE = f"{GROUP}/force-delete"

FORMATS = ("parquet", "arrow", "jsonl")
MEDIA = ("Memory", "Disk")
POLICIES = ("Refuse", "Admit")
RANK_SOURCES = ("JobCompletionIndex", "Fixed", "Reader")
PULL_POLICIES = ("IfNotPresent", "Always", "Never")

#: A byte size: a non-negative integer or a Kubernetes quantity without fractions of a byte.
#: At most 19 digits and a decimal exponent of at most 18, so "1e5000" or "1e30" never
#: reach the parser from the API server; the parser caps the value at `MAX_BYTES`.
QUANTITY_PATTERN = (
    r"^\+?(([0-9]{1,19}(\.[0-9]{0,19})?)|(\.[0-9]{1,19}))"
    r"(([KMGTPE]i)|[kMGTPE]|([eE]\+?(1[0-8]|0?[0-9])))?$"
)
#: Largest byte size: a Kubernetes quantity is an int64 of bytes.
MAX_BYTES = 2**63 - 1
#: Any Kubernetes resource quantity (CPU may use milli units, e.g. "250m").
RESOURCE_QUANTITY_PATTERN = (
    r"^\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE]\+?[0-9]+))?$"
)
#: The contract's URI form and limit (`parsers.URI_PATTERN`, `MAX_URI_LENGTH`): what the
#: API server refuses in a DatasetMount, a variable or flag refuses too. The limit also
#: keeps CEL within its cost budget.
URI_PATTERN = parsers.URI_PATTERN
MAX_URI_LENGTH = parsers.MAX_URI_LENGTH
NODE_PATH_PATTERN = r"^(/[A-Za-z0-9_-][A-Za-z0-9._-]*)+$"
DIGEST_PATTERN = r"^sha256:[0-9a-f]{64}$"
RESTORE_PATTERN = r"^(latest|none|[0-9]+)$"
SECRET_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
#: An absolute, normalised path: segments that are not "." or "..", no "//", no
#: trailing "/", not "/" itself, no control characters. Normalised, so that comparing
#: the text (ours with the sidecar's paths, the API server's for duplicate mount paths)
#: compares the directories: "/a/../b" is "/b" to the kernel, not to either.
MOUNT_PATH_PATTERN = r"^(/([^/.\x00-\x1f]|\.[^/.\x00-\x1f]|\.\.[^/\x00-\x1f])[^/\x00-\x1f]*)+$"

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
_QUANTITY_RE = re.compile(QUANTITY_PATTERN)


def parse_quantity(value: object, *, path: str = "quantity") -> int:
    """Bytes of a Kubernetes quantity: 2Gi -> 2147483648, 500M -> 500000000, 1e3 -> 1000.

    Raises `InputError` naming `path` when the value is negative, fractional in bytes,
    or not a quantity at all (surrounding spaces included: the API server refuses them).
    """
    if isinstance(value, bool):
        raise errors.InputError(f"{path}: expected a byte size like '2Gi', found {value!r}")
    if isinstance(value, int):
        if not 0 <= value <= MAX_BYTES:
            raise errors.InputError(
                f"{path}: expected a byte size from 0 to {MAX_BYTES}, found {value}"
            )
        return value
    if not isinstance(value, str) or len(value) > 64 or not _QUANTITY_RE.fullmatch(value):
        raise errors.InputError(
            f"{path}: expected a non-negative byte size like '2Gi', '500M' or 1048576, "
            f"found {value!r}"
        )
    text = value.lstrip("+")
    number, multiplier = text, 1
    for suffixes in (_BINARY, _DECIMAL):
        for suffix, factor in suffixes.items():
            if text.endswith(suffix) and not text.endswith("e" + suffix):
                number, multiplier = text[: -len(suffix)], factor
                break
        if multiplier != 1:
            break
    amount = decimal.Decimal(number) * multiplier
    if amount != amount.to_integral_value():
        raise errors.InputError(f"{path}: {value!r} is not a whole number of bytes")
    if amount > MAX_BYTES:
        raise errors.InputError(
            f"{path}: {value!r} is over the largest byte size a Kubernetes quantity holds "
            f"({MAX_BYTES} bytes, just under 8Ei)"
        )
    return int(amount)


_RESOURCE_RE = re.compile(RESOURCE_QUANTITY_PATTERN)
_RESOURCE_SUFFIXES: dict[str, decimal.Decimal] = {
    **{suffix: decimal.Decimal(factor) for suffix, factor in (_BINARY | _DECIMAL).items()},
    "n": decimal.Decimal("1e-9"),
    "u": decimal.Decimal("1e-6"),
    "m": decimal.Decimal("1e-3"),
}
#: Kubernetes keeps a quantity in nano units, a finer amount rounded up (0.1n -> 1n).
_NANO = decimal.Decimal("1e-9")
#: Exact arithmetic: a quantity may have more digits than the default context's 28,
#: which would round; the `_MAGNITUDE_LIMIT` check keeps the numbers small.
_EXACT = decimal.Context(prec=decimal.MAX_PREC, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN)
#: Above this decimal exponent (`Decimal.adjusted`) a value is over `MAX_BYTES`.
_MAGNITUDE_LIMIT = len(str(MAX_BYTES))


def resource_quantity(value: object, *, path: str) -> decimal.Decimal:
    """The value of a Kubernetes resource quantity, by the API server's rules: '250m' ->
    0.25, '1.5Gi' -> 1610612736, '1e3' -> 1000, '0.1n' -> 0.000000001 (rounded up to
    whole nano units, what Kubernetes keeps).

    Raises `InputError` naming `path` when the value is not a non-negative quantity
    (surrounding spaces included) or is over `MAX_BYTES` (a quantity's int64).
    """
    text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(text, str) or not _RESOURCE_RE.fullmatch(text):
        raise errors.InputError(
            f"{path}: expected a non-negative quantity like '500m' or '1Gi', found {value!r}"
        )
    number, unit = _split_resource_quantity(text.lstrip("+"))
    mantissa = decimal.Decimal(number)
    # Compared before multiplying, so "1e999999999" is refused without being computed.
    if mantissa and mantissa.adjusted() + unit.adjusted() > _MAGNITUDE_LIMIT:
        raise _too_large(value, path)
    amount = _EXACT.multiply(mantissa, unit).quantize(
        _NANO, rounding=decimal.ROUND_CEILING, context=_EXACT
    )
    if amount > MAX_BYTES:
        raise _too_large(value, path)
    return amount


def _split_resource_quantity(text: str) -> tuple[str, decimal.Decimal]:
    """A quantity matching `RESOURCE_QUANTITY_PATTERN` as its number and its unit's value."""
    if text[-2:] in _BINARY:
        return text[:-2], _RESOURCE_SUFFIXES[text[-2:]]
    if text[-1] in _RESOURCE_SUFFIXES:
        return text[:-1], _RESOURCE_SUFFIXES[text[-1]]
    number, _, exponent = text.replace("E", "e").partition("e")
    if len(exponent.lstrip("+0")) > 6:  # beyond any exponent a value below MAX_BYTES has
        return number, decimal.Decimal("1e999999")
    return number, decimal.Decimal(1).scaleb(int(exponent or 0), context=_EXACT)


def _too_large(value: object, path: str) -> errors.InputError:
    return errors.InputError(
        f"{path}: {value!r} is over the largest quantity Kubernetes holds "
        f"({MAX_BYTES}, just under 8Ei)"
    )


def memory_bytes(value: object, *, path: str) -> int:
    """Whole bytes of a memory quantity, a fraction of a byte rounded up as Kubernetes
    does when it sets the limit ('1.3Gi' -> 1395864372)."""
    return int(resource_quantity(value, path=path).to_integral_value(decimal.ROUND_CEILING))


def format_bytes(size: int) -> str:
    """A short binary-unit rendering for printer columns: 1536 -> '1.5Ki'."""
    amount = float(size)
    for unit in ("", "Ki", "Mi", "Gi", "Ti", "Pi"):
        if amount < 1024 or unit == "Pi":
            text = f"{amount:.1f}".rstrip("0").rstrip(".") if unit else str(int(amount))
            return f"{text}{unit}"
        amount /= 1024
    raise AssertionError("unreachable")


MiB = 1 << 20
#: The run volume's room over the memory tier's limit, and its sizeLimit: defined once,
#: in the contract (the sidecar counts that volume against its memory limit).
RUN_VOLUME_HEADROOM = variables.RUN_VOLUME_HEADROOM
run_volume_bytes = variables.run_volume_bytes


# --- field metadata ----------------------------------------------------------------
_META = "shardcache"


@dataclasses.dataclass(frozen=True)
class FieldInfo:
    """How one dataclass field appears in the CRD and how its value is checked."""

    json: str
    description: str
    required: bool = False
    #: The field holds bytes; the JSON form is an integer or a quantity string.
    quantity: bool = False
    #: The default as written in the CRD (for quantities: the string, e.g. "2Gi").
    schema_default: object = None
    enum: tuple[str, ...] | None = None
    pattern: str | None = None
    minimum: int | None = None
    maximum: int | None = None
    #: Longest accepted string; also bounds the API server's CEL cost estimate.
    max_length: int | None = None
    #: Map values are resource quantities (CPU "250m", memory "1Gi").
    resource_map: bool = False
    #: Bounds of a list field (`tuple[Model, ...]`), which also bound CEL's cost estimate.
    min_items: int | None = None
    max_items: int | None = None
    #: What `pattern` asks for, in words, for the error when a value does not match.
    expected: str | None = None


@dataclasses.dataclass(frozen=True)
class Rule:
    """A check across fields of one object: CEL for the API server, Python for the rest."""

    cel: str
    message: str
    check: Callable[[Any], bool]
    #: The value the Python error shows as found (CEL's message is fixed text).
    found: Callable[[Any], object] | None = None


_MISSING: Any = dataclasses.MISSING

#: Checks on every int-or-string quantity (a structural schema allows no minimum there).
QUANTITY_RULES = (
    Rule(
        cel="type(self) != int || self >= 0",
        message="must not be negative",
        check=lambda value: not isinstance(value, int) or value >= 0,
    ),
)


def _field(
    json: str,
    description: str,
    *,
    default: Any = _MISSING,
    default_factory: Any = _MISSING,
    **info: Any,
) -> Any:
    schema_default = info.pop("schema_default", None)
    if schema_default is None and default is not _MISSING and default is not None:
        schema_default = default
    required = default is _MISSING and default_factory is _MISSING
    meta = {_META: FieldInfo(json, description, required, schema_default=schema_default, **info)}
    if default_factory is not _MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    if default is not _MISSING:
        return dataclasses.field(default=default, metadata=meta)
    return dataclasses.field(metadata=meta)


def _quantity(json: str, default: int, description: str) -> Any:
    return _field(
        json,
        description,
        default=default,
        quantity=True,
        schema_default=parsers.quantity(default),
    )


def _uri(description: str) -> Any:
    """A required object-store URI (`uri`): where a source or the checkpoints live."""
    return _field("uri", description, pattern=URI_PATTERN, max_length=MAX_URI_LENGTH)


def _shard_format(description: str) -> Any:
    """The shards' file format (`format`), the contract's default when omitted."""
    return _field(
        "format",
        description,
        default=variables.SOURCE_FORMAT.spec_value_default,
        enum=FORMATS,
    )


def _pinned_version(description: str) -> Any:
    """An optional manifest digest a source is pinned to (`version`)."""
    return _field("version", description, default=None, pattern=DIGEST_PATTERN)


def field_info(field: dataclasses.Field[Any]) -> FieldInfo:
    info = field.metadata.get(_META)
    if not isinstance(info, FieldInfo):
        raise TypeError(f"field {field.name} has no shardcache FieldInfo")
    return info


#: URIs are copied into pod env, status and events: credentials in them are refused.
_URI_WITHOUT_USERINFO = Rule(
    cel=(
        f"!has(self.uri) || !self.uri.matches('{uris.USERINFO_CEL_PATTERN}') "
        f"|| self.uri.matches('{uris.CONTAINER_CEL_PATTERN}')"
    ),
    message=f"uri: {uris.ADVICE}",
    check=lambda s: not uris.has_userinfo(s.uri),
)


# --- the model ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SecretRef:
    """A Secret in the DatasetMount's namespace."""

    name: str = _field(
        "name",
        "Name of a Secret in the DatasetMount's namespace whose keys are environment "
        "variables for the object store client (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
        "AWS_ENDPOINT_URL, AWS_REGION). Only the cache sidecar receives them.",
        pattern=SECRET_NAME_PATTERN,
    )


@dataclasses.dataclass(frozen=True)
class SourceSpec:
    """Where the dataset lives."""

    rules: ClassVar[tuple[Rule, ...]] = (_URI_WITHOUT_USERINFO,)

    uri: str = _uri(
        "URI of the dataset: a directory or glob of shard files on any pyarrow filesystem "
        "(s3://bucket/prefix, gs://..., hdfs://..., file:///...). Credentials in the URI "
        "(user:password@) are refused: use secretRef.",
    )
    format: str = _shard_format(
        "File format of the shards: parquet, arrow (Arrow IPC) or jsonl.",
    )
    secret_ref: SecretRef | None = _field(
        "secretRef",
        "Secret with the object store endpoint and credentials. Omit for public s3:// "
        "buckets: the operator then reads the source anonymously (never with its own "
        "identity), and the sidecar with the pod's own identity.",
        default=None,
    )
    version: str | None = _pinned_version(
        "Pins the manifest digest explicitly (sha256:<64 hex>). The operator refuses to "
        "become Ready if the source's manifest has a different digest. Without it the "
        "digest resolved at creation is pinned in status.",
    )


#: Further sources of a mixture (spec.mixture.sources): with spec.source, at most 16.
MAX_MIXTURE_SOURCES = 15
_MIXTURE_SOURCE_NAME = r"^[a-z0-9]([-a-z0-9]{0,30}[a-z0-9])?$"


@dataclasses.dataclass(frozen=True)
class MixtureSourceSpec:
    """One further source of a mixture: a dataset, its name and its weight."""

    rules: ClassVar[tuple[Rule, ...]] = (_URI_WITHOUT_USERINFO,)

    name: str = _field(
        "name",
        "Name of the source in the mixture (a DNS label of at most 32 characters): the "
        "trainer's mixture and its state name it so.",
        pattern=_MIXTURE_SOURCE_NAME,
        max_length=32,
    )
    weight: int = _field(
        "weight",
        "Relative weight: the share of batches drawn from this source is its weight over "
        "the sum of all weights (spec.mixture.weight counts for spec.source).",
        minimum=0,
        maximum=1_000_000,
    )
    uri: str = _uri(
        "URI of the source's shards, as spec.source.uri. Read with spec.source.secretRef: "
        "one sidecar holds one set of object store credentials.",
    )
    format: str = _shard_format(
        "File format of the source's shards: parquet, arrow (Arrow IPC) or jsonl.",
    )
    version: str | None = _pinned_version(
        "Pins the source's manifest digest (sha256:<64 hex>), as spec.source.version.",
    )


def _names_differ(m: Any) -> bool:
    names = [m.name, *(s.name for s in m.sources)]
    return len(set(names)) == len(names)


@dataclasses.dataclass(frozen=True)
class MixtureSpec:
    """Further sources mixed with spec.source, each with a weight (a multi-source mount)."""

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            # `has(self.sources)`: the API server also checks rules on an empty object.
            cel=(
                "!has(self.sources) || self.sources.all(a, a.name != "
                "(has(self.name) ? self.name : 'main') && "
                "self.sources.exists_one(b, b.name == a.name))"
            ),
            message="every source needs its own name (spec.mixture.name names spec.source)",
            check=_names_differ,
        ),
        Rule(
            cel=(
                "(has(self.weight) ? self.weight : 1) > 0 || "
                "(has(self.sources) && self.sources.exists(s, s.weight > 0))"
            ),
            message="some source needs a weight > 0",
            check=lambda m: m.weight > 0 or any(s.weight > 0 for s in m.sources),
        ),
    )

    sources: tuple[MixtureSourceSpec, ...] = _field(
        "sources",
        "The further sources. Each is resolved, pinned (status.mixture) and cached like "
        "spec.source, and the pod's one sidecar serves them all; the trainer reads the "
        "mixture with shardcache.open_mixture().",
        min_items=1,
        max_items=MAX_MIXTURE_SOURCES,
    )
    name: str = _field(
        "name",
        "Name of spec.source in the mixture.",
        default="main",
        pattern=_MIXTURE_SOURCE_NAME,
        max_length=32,
    )
    weight: int = _field(
        "weight",
        "Relative weight of spec.source.",
        default=1,
        minimum=0,
        maximum=1_000_000,
    )
    seed: int = _field(
        "seed",
        "Seed of the per-batch draw of sources (the trainer may override it).",
        default=0,
    )


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """Sizes and placement of the two cache tiers."""

    memory: int = _quantity(
        "memory",
        variables.MEMORY_LIMIT.required_default,
        "Size of the memory tier per pod: decoded Arrow shards that trainers mmap. "
        "It is the sizeLimit of the pod's memory-backed volume; with medium Memory the "
        "sidecar's memory limit is raised by this much, since tmpfs pages count against it.",
    )
    medium: str = _field(
        "medium",
        "Backing of the memory tier volume. Memory: tmpfs, always resident, never "
        "written to disk; where the node's tmpfs uses 4 KiB pages (the usual "
        "transparent_hugepage/shmem_enabled=never), warm reads pay a TLB miss every 4 KiB. "
        "Disk: the node's default emptyDir storage; decoded shards live in the page cache "
        "and are written back to disk, may be reclaimed under memory pressure (then read "
        "back), and on filesystems with large folios (ext4, xfs on recent kernels) warm "
        "reads run faster than on 4 KiB-page tmpfs (docs/benchmarks.md). mmap avoids "
        "copies either way.",
        default="Memory",
        enum=MEDIA,
    )
    disk: int = _quantity(
        "disk",
        variables.DISK_LIMIT.required_default,
        "Byte limit of the node-local disk tier (source bytes, LRU, shared by the pods of "
        "this namespace on the node that use the same nodePath; each namespace has its own "
        "directory below it).",
    )
    #: None: the platform's default (`authority.Policy.default_node_path`, chart value
    #: nodeCache.path), filled in when the operator loads the mount (`mounts.Store`).
    #: The CRD has no default here on purpose: one the API server fills in would be
    #: stored as if written, and a platform whose nodes keep the cache elsewhere could
    #: not tell such a mount from one that asked for /var/cache/shardcache.
    node_path: str | None = _field(
        "nodePath",
        "Directory on the node (hostPath, created if missing) that holds the disk tier. "
        "Unset: the platform's default (chart value nodeCache.path, "
        f"{contract.DEFAULT_DISK_DIR} unless changed), which the chart's node-cache "
        "DaemonSet prepares on every node; any other path must be writable by the "
        "sidecar's user. Only paths the platform allows (chart value policy.nodePaths) "
        "are admitted.",
        default=None,
        # Absolute, no "." or ".." segments, no "//": compared exactly with the
        # platform's allow-list (`authority.Policy.node_paths`).
        pattern=NODE_PATH_PATTERN,
        max_length=255,
    )


@dataclasses.dataclass(frozen=True)
class PrefetchSpec:
    """How far the sidecar reads ahead of the trainers."""

    depth: int = _field(
        "depth",
        "Shards prefetched ahead of each reader's position (0 disables read-ahead).",
        default=variables.PREFETCH_DEPTH.default,
        minimum=0,
        maximum=1024,
    )
    adaptive: bool = _field(
        "adaptive",
        "Tune each reader's read-ahead from its data-stall signal: deeper (up to maxDepth "
        "and what cache.memory holds beside the other readers' shards) while its trainer "
        "waits on cold shards, back to depth once it no longer does. Every change is "
        "logged and exported (shardcache_prefetch_depth). false: depth stays fixed.",
        default=variables.PREFETCH_ADAPTIVE.default,
    )
    max_depth: int = _field(
        "maxDepth",
        "Deepest the sidecar tunes a reader's read-ahead to with adaptive (never below "
        "depth, never beyond what cache.memory holds beside the other readers' shards).",
        default=variables.PREFETCH_MAX_DEPTH.default,
        minimum=0,
        maximum=1024,
    )
    concurrency: int = _field(
        "concurrency",
        "Shards fetched from the source (and decoded) at the same time; 0: one per CPU "
        "of the sidecar's CPU limit, as many as its memory limit holds beside the memory "
        "tier.",
        default=variables.FETCH_CONCURRENCY.default,
        minimum=0,
        maximum=256,
    )
    ready_shards: int = _field(
        "readyShards",
        "Shards of the startup plan that must be resident before the sidecar reports "
        "ready, so trainers start on a warm cache: the default 2 is the first shard to read "
        "and the next. 0: ready as soon as the manifest is verified. When they do not fit "
        "in cache.memory together, the sidecar becomes ready with those that fit.",
        default=variables.READY_SHARDS.default,
        minimum=0,
    )


# `has(self.rankFrom)` although it has a default: the API server also checks the rules
# against the object's own default ({}), before nested defaults are filled in.
_RANK_NEEDS_FIXED = Rule(
    cel="!has(self.rankFrom) || self.rankFrom != 'Fixed' || (has(self.rank) && has(self.worldSize))",
    message="rankFrom Fixed needs both rank and worldSize",
    check=lambda s: s.rank_from != "Fixed" or (s.rank is not None and s.world_size is not None),
)
_RANK_BELOW_WORLD = Rule(
    cel="!has(self.rank) || !has(self.worldSize) || self.rank < self.worldSize",
    message="rank must be smaller than worldSize",
    check=lambda s: s.rank is None or s.world_size is None or s.rank < s.world_size,
)
_RANK_ONLY_FIXED = Rule(
    cel="!has(self.rank) || (has(self.rankFrom) && self.rankFrom == 'Fixed')",
    message="rank is only used with rankFrom Fixed",
    check=lambda s: s.rank is None or s.rank_from == "Fixed",
)


@dataclasses.dataclass(frozen=True)
class ShardingSpec:
    """The reading plan: shuffle seed and how the dataset is split across ranks."""

    rules: ClassVar[tuple[Rule, ...]] = (_RANK_NEEDS_FIXED, _RANK_BELOW_WORLD, _RANK_ONLY_FIXED)

    seed: int = _field(
        "seed",
        "Seed of the shard and block permutation; same seed, same order.",
        default=variables.SEED.default,
    )
    shuffle: bool = _field(
        "shuffle",
        "Shuffle each epoch at the chosen granularity (false: file order).",
        default=variables.SHUFFLE.default,
    )
    granularity: str = _field(
        "granularity",
        "What the shuffle permutes. block: the shard order and blocks of blockSize rows "
        "inside each shard; rows keep their order inside a block, so a batch is zero-copy "
        "slices. sample: also the rows, within windows of `window` rows spanning several "
        "shards; each batch is gathered with one copy, and a reader holds every shard of "
        "its window (docs/reading-plan.md). Trainers that call shardcache.open() without "
        "shuffle (or with shuffle=True) read in this mode.",
        default=variables.SHUFFLE_GRANULARITY.default,
        enum=plans.GRANULARITIES,
    )
    window: int = _field(
        "window",
        "Rows per sample-shuffle window (granularity sample only). The sidecar keeps the "
        "shards of each reader's current and next window in the memory tier, so "
        "cache.memory must hold about two windows of decoded rows; a larger window mixes "
        "rows of more shards.",
        default=variables.SHUFFLE_WINDOW.default,
        minimum=1,
    )
    block_size: int | None = _field(
        "blockSize",
        "Rows per shuffle block inside a shard. Omit to let the sidecar choose.",
        default=variables.BLOCK_SIZE.spec_value_default,
        minimum=1,
    )
    world_size: int | None = _field(
        "worldSize",
        "Number of ranks reading the dataset. Omit to take it from the readers; a pod "
        "annotation shardcache.io/world-size overrides it per pod.",
        default=variables.WORLD_SIZE.spec_value_default,
        minimum=1,
    )
    rank_from: str = _field(
        "rankFrom",
        "Where the sidecar learns its rank: JobCompletionIndex (the pod's Indexed Job "
        "completion index, via the downward API; pods without one fall back to Reader), "
        "Fixed (the rank field) or Reader (the trainer registers its own rank).",
        default="JobCompletionIndex",
        enum=RANK_SOURCES,
    )
    rank: int | None = _field(
        "rank",
        "Rank of every pod when rankFrom is Fixed.",
        default=variables.RANK.spec_value_default,
        minimum=0,
    )


def paths_overlap(one: str, other: str) -> bool:
    """Whether of two absolute paths one is the other or lies inside it."""
    one_dir, other_dir = one.rstrip("/") + "/", other.rstrip("/") + "/"
    return one_dir.startswith(other_dir) or other_dir.startswith(one_dir)


#: Where the sidecar mounts its own volumes (at the operator's default run directory).
SIDECAR_DIRS = (contract.DEFAULT_DISK_DIR, contract.DEFAULT_RUN_DIR)

# The sidecar mounts the checkpoint volume too: at one of its own paths the pod would
# have two volumes at one path (the API server refuses it), and around one a volume
# would hide the other.
_CHECKPOINT_BESIDE_SIDECAR = Rule(
    cel=(
        "!has(self.mountPath) || !"
        + "["
        + ", ".join(f"'{d}'" for d in SIDECAR_DIRS)
        + "]"
        + ".exists(p, (p + '/').startsWith(self.mountPath.endsWith('/') ? "
        "self.mountPath : self.mountPath + '/') || (self.mountPath + '/').startsWith(p + '/'))"
    ),
    message=(
        "mountPath: must not be, hold or lie inside the cache sidecar's own directories "
        f"{contract.DEFAULT_DISK_DIR} (the node disk tier) and {contract.DEFAULT_RUN_DIR} "
        "(its run directory)"
    ),
    check=lambda c: not any(paths_overlap(c.mount_path, d) for d in SIDECAR_DIRS),
    found=lambda c: c.mount_path,
)


@dataclasses.dataclass(frozen=True)
class CheckpointSpec:
    """Checkpoint upload and restore (carried out by the sidecar's checkpoint agent)."""

    rules: ClassVar[tuple[Rule, ...]] = (_URI_WITHOUT_USERINFO, _CHECKPOINT_BESIDE_SIDECAR)

    uri: str = _uri(
        "Object store prefix checkpoints are uploaded to (s3://bucket/run-42/). Uses the "
        "source's secretRef for credentials (credentials in the URI are refused). Ranked "
        "pods publish under <uri>/rank-<rank>.",
    )
    keep_last: int = _field(
        "keepLast",
        "Number of committed checkpoints kept; older ones are deleted.",
        default=variables.CHECKPOINT_KEEP_LAST.default,
        minimum=1,
    )
    restore: str = _field(
        "restore",
        "What the sidecar restores before the trainer starts: latest, none, or a step number.",
        default=variables.CHECKPOINT_RESTORE.default,
        pattern=RESTORE_PATTERN,
    )
    mount_path: str = _field(
        "mountPath",
        "Directory in the trainer containers (and the sidecar) where checkpoints are "
        "written and restored: an absolute path without '.' or '..' segments or a "
        "trailing '/', not at, above or inside the sidecar's own /var/cache/shardcache "
        "and /var/run/shardcache.",
        default=variables.CHECKPOINT_DIR.spec_value_default,
        pattern=MOUNT_PATH_PATTERN,
        max_length=1024,
        expected=(
            "an absolute path without '.' or '..' segments, '//', a trailing '/' or "
            "control characters, and not '/' itself (like /checkpoints)"
        ),
    )
    size: int = _quantity(
        "size",
        parse_quantity("20Gi"),
        "sizeLimit of the pod-local volume that holds checkpoints before upload.",
    )
    restore_fallback: bool = _field(
        "restoreFallback",
        "When the checkpoint chosen by restore does not match its manifest (a damaged "
        "copy in the store), restore the next older published checkpoint instead, and so "
        "on; the pod stays unready only if every one is damaged. A pinned step that is "
        "not published is still an error. Default false: silently resuming from an older "
        "model is a decision the user must make.",
        default=variables.CHECKPOINT_RESTORE_FALLBACK.default,
    )
    concurrency: int = _field(
        "concurrency",
        "Checkpoint files uploaded (and downloaded at restore) at the same time; each "
        "large file is also a parallel multipart upload. Default 8 keeps a 2-core sidecar "
        "busy hashing while the network stays full.",
        default=variables.CHECKPOINT_CONCURRENCY.default,
        minimum=1,
        maximum=256,
    )
    verify_uploads: bool = _field(
        "verifyUploads",
        "Read every uploaded object back and compare its sha256 before publishing the "
        "checkpoint. Default false: it doubles the traffic, and restore verifies every "
        "byte anyway.",
        default=variables.CHECKPOINT_VERIFY_UPLOADS.default,
    )
    upload_buffer: int = _quantity(
        "uploadBuffer",
        variables.CHECKPOINT_UPLOAD_BUFFER.required_default,
        "Bytes of upload parts held in memory across all files being uploaded (the object "
        "store client keeps a multipart upload's parts until they are sent); each file in "
        "flight keeps at least 32Mi. It counts against the sidecar's memory limit "
        "(sidecar.resources.limits.memory): lower it with a small limit. Default 512Mi "
        "lets a lone large file keep its upload busy.",
    )


#: The sidecar's resources when the spec sets neither requests nor limits.
DEFAULT_SIDECAR_REQUESTS: Mapping[str, str] = types.MappingProxyType(
    {"cpu": "250m", "memory": "256Mi"}
)
DEFAULT_SIDECAR_LIMITS: Mapping[str, str] = types.MappingProxyType({"cpu": "2", "memory": "1Gi"})


def _amount(resources: Mapping[str, str], key: str) -> decimal.Decimal:
    return resource_quantity(resources[key], path=key)


def _bounded(
    defaults: Mapping[str, str], given: Mapping[str, str], *, above: bool
) -> dict[str, str]:
    """`defaults`, each replaced by its resource's amount in `given` where that is
    beyond it: above it (`above`, a limit raised to a request) or below it (a request
    lowered to a limit)."""
    out = {}
    for key, value in defaults.items():
        beyond = key in given and (
            _amount(given, key) > _amount(defaults, key)
            if above
            else _amount(given, key) < _amount(defaults, key)
        )
        out[key] = given[key] if beyond else value
    return out


@dataclasses.dataclass(frozen=True)
class ResourcesSpec:
    """Compute resources of the sidecar container."""

    requests: dict[str, str] = _field(
        "requests",
        "Minimum resources (cpu, memory) the sidecar is scheduled with. Omitted: cpu 250m "
        "and memory 256Mi, each lowered to its limit where the limit is lower. Each must "
        "be at most its limit (for memory with cache.medium Memory: the raised limit). "
        "With cache.medium Memory the memory request is raised by the memory tier's "
        "volume at injection too, at most to the raised limit: its pages are node memory "
        "the scheduler must count.",
        default_factory=lambda: dict(DEFAULT_SIDECAR_REQUESTS),
        resource_map=True,
    )
    limits: dict[str, str] = _field(
        "limits",
        "Maximum resources of the sidecar. Omitted: cpu 2 and memory 1Gi, each raised to "
        "its request where the request is higher. With cache.medium Memory the memory "
        "limit is raised by the memory tier's volume (cache.memory and a quarter) at "
        "injection, a fraction of a byte rounded up. A memory limit must be at least "
        "192Mi (the sidecar holds 100-150 MiB resident; below it is OOMKilled at start).",
        default_factory=lambda: dict(DEFAULT_SIDECAR_LIMITS),
        resource_map=True,
    )

    @staticmethod
    def given_defaults(given: Mapping[str, Any]) -> dict[str, Any]:
        """The one of requests and limits the spec omits, never on the wrong side of the
        other: the API server refuses a pod whose request is above its limit."""
        requests, limits = given.get("requests"), given.get("limits")
        if requests is None and limits is not None:
            # As Kubernetes, which takes a resource's limit as its request when the
            # request is omitted, a limit below the default request becomes the request.
            return {"requests": _bounded(DEFAULT_SIDECAR_REQUESTS, limits, above=False)}
        if limits is None and requests is not None:
            return {"limits": _bounded(DEFAULT_SIDECAR_LIMITS, requests, above=True)}
        return {}


@dataclasses.dataclass(frozen=True)
class SidecarSpec:
    """The cache sidecar container injected into pods."""

    image: str | None = _field(
        "image",
        "Sidecar image. Omit to use the operator's configured default image; another "
        "image must be on the platform's list (chart value policy.sidecarImages), since "
        "the sidecar receives the source's credentials.",
        default=None,
        max_length=512,
    )
    image_pull_policy: str = _field(
        "imagePullPolicy",
        "Pull policy of the sidecar image.",
        default="IfNotPresent",
        enum=PULL_POLICIES,
    )
    resources: ResourcesSpec = _field(
        "resources", "Resource requests and limits of the sidecar.", default_factory=ResourcesSpec
    )


@dataclasses.dataclass(frozen=True)
class AdmissionSpec:
    """What the webhook does with pods that ask for this mount."""

    policy: str = _field(
        "policy",
        "When this DatasetMount is not Ready: Refuse the pod (with a message naming the "
        "mount and why) or Admit it without injection.",
        default="Refuse",
        enum=POLICIES,
    )
    allow_share_process_namespace: bool = _field(
        "allowShareProcessNamespace",
        "Admit pods with shareProcessNamespace: true or hostPID: true. Default false: in "
        "such a pod the trainer can read the sidecar's environment, which holds the object "
        "store credentials; allow it only for a source whose credentials the trainer may "
        "have.",
        default=False,
    )


@dataclasses.dataclass(frozen=True)
class StallSpec:
    """When the operator calls a pod starved of data (condition DataStarved)."""

    threshold_percent: int = _field(
        "thresholdPercent",
        "A pod is starved when a reader's recent stall fraction (the share of its training "
        "loop spent waiting for batches, shardcache_reader_stall_fraction) is above this "
        "percentage. The default 50: the loop waits on data as long as it computes, the "
        "accelerators idle half the time.",
        default=50,
        minimum=1,
        maximum=100,
    )
    for_seconds: int = _field(
        "forSeconds",
        "Seconds the fraction must stay above the threshold before DataStarved is set "
        "(a cold start or an epoch boundary waits briefly, and is not starvation). It "
        "clears at the first check that finds every pod below.",
        default=120,
        minimum=0,
        maximum=86400,
    )


def sidecar_memory_raise(cache: CacheSpec) -> int:
    """Bytes the injection adds to the sidecar's memory limit: with medium Memory the
    tmpfs pages it writes are charged to its cgroup, and the whole run volume can be."""
    return run_volume_bytes(cache.memory) if cache.medium == "Memory" else 0


def _sidecar_requests_within_limits(spec: DatasetMountSpec, path: str) -> str | None:
    """Each request at most the limit the pod gets: the API server refuses the pod else.
    Python only: comparing quantities in CEL needs Kubernetes' quantity library, which
    the interpreter the tests check every CEL rule with (celpy) does not have."""
    resources = spec.sidecar.resources
    for key in resources.requests.keys() & resources.limits.keys():
        limit = _amount(resources.limits, key)
        raised = sidecar_memory_raise(spec.cache) if key == "memory" else 0
        if raised:
            limit = decimal.Decimal(memory_bytes(resources.limits[key], path=key) + raised)
        if _amount(resources.requests, key) > limit:
            where = f"{path}.sidecar.resources"
            more = (
                f" plus the {parsers.quantity(raised)} memory tier volume (cache.medium Memory)"
                if raised
                else ""
            )
            return (
                f"{where}.requests.{key}: {resources.requests[key]!r} is above its limit "
                f"{where}.limits.{key}, {resources.limits[key]!r}{more}: the API server "
                "refuses a pod whose request is above its limit; lower the request or "
                "raise the limit"
            )
    return None


def _sidecar_memory_limit_above_floor(spec: DatasetMountSpec, path: str) -> str | None:
    """A memory limit the sidecar can start in: below the floor it is OOMKilled at every
    start and the pod never runs. The spec's own limit is what the process has: with
    cache.medium Memory the webhook adds the memory tier's volume on top of it, and with
    Disk the tier's pages are page cache the kernel reclaims, so the floor alone bounds
    it either way. No limit at all (limits without memory) has nothing to check."""
    given = spec.sidecar.resources.limits.get("memory")
    if given is None:
        return None
    field = f"{path}.sidecar.resources.limits.memory"
    found = memory_bytes(given, path=field)
    floor = variables.SIDECAR_MEMORY_FLOOR
    if found >= floor:
        return None
    return (
        f"{field}: expected at least {parsers.quantity(floor)} (the sidecar holds 100-150 MiB "
        f"resident once it starts, and is OOMKilled at every start below that), found "
        f"{given!r}; raise the limit or omit it (default 1Gi)"
    )


@dataclasses.dataclass(frozen=True)
class DatasetMountSpec:
    """What data a job reads and how the node caches it."""

    python_checks: ClassVar[tuple[Callable[[Any, str], str | None], ...]] = (
        _sidecar_requests_within_limits,
        _sidecar_memory_limit_above_floor,
    )

    source: SourceSpec = _field("source", "The dataset in object storage.")
    cache: CacheSpec = _field(
        "cache", "Cache tiers on the node and in the pod.", default_factory=CacheSpec
    )
    prefetch: PrefetchSpec = _field(
        "prefetch", "Read-ahead of the sidecar.", default_factory=PrefetchSpec
    )
    sharding: ShardingSpec = _field(
        "sharding", "Shuffle seed and rank partition.", default_factory=ShardingSpec
    )
    checkpoint: CheckpointSpec | None = _field(
        "checkpoint",
        "Checkpoint upload and restore. Omit to mount no checkpoint volume.",
        default=None,
    )
    mixture: MixtureSpec | None = _field(
        "mixture",
        "Further sources to mix with spec.source by weight. Omit for one source.",
        default=None,
    )
    sidecar: SidecarSpec = _field(
        "sidecar", "The injected cache sidecar.", default_factory=SidecarSpec
    )
    admission: AdmissionSpec = _field(
        "admission", "Admission policy of pods using this mount.", default_factory=AdmissionSpec
    )
    stall: StallSpec = _field(
        "stall",
        "When the DataStarved condition is raised (docs/monitoring.md).",
        default_factory=StallSpec,
    )


# --- generic conversion --------------------------------------------------------------
T = TypeVar("T")


def _unwrap_optional(hint: Any) -> tuple[Any, bool]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return hint, False


#: field_types per model class: `typing.get_type_hints` evaluates the string annotations
#: on every call, and it was most of the cost of parsing a spec (1.8 s of a 12 s admission
#: profile, issue 18). The model classes are fixed, so this never grows past them.
_FIELD_TYPES: dict[type[Any], dict[str, tuple[Any, bool]]] = {}


def field_types(cls: type[Any]) -> dict[str, tuple[Any, bool]]:
    """Each field's type (with `None` stripped) and whether it is optional (do not mutate)."""
    cached = _FIELD_TYPES.get(cls)
    if cached is None:
        hints = typing.get_type_hints(cls)
        cached = {f.name: _unwrap_optional(hints[f.name]) for f in dataclasses.fields(cls)}
        _FIELD_TYPES[cls] = cached
    return cached


def _type_name(value: object) -> str:
    return {
        bool: "a boolean",
        int: "an integer",
        str: "a string",
        dict: "an object",
        list: "a list",
        float: "a number",
        type(None): "null",
    }.get(type(value), type(value).__name__)


def from_dict(cls: type[T], data: object, *, path: str) -> T:
    """Build a model dataclass from its JSON form, applying defaults and checking values.

    Raises `InputError` whose message starts with the field path, e.g.
    ``spec.cache.memory: expected a non-negative byte size like '2Gi', found '-1Gi'``.

    A model may have `given_defaults(values)`: defaults of omitted fields that depend on
    the fields given (by field name), and `python_checks`: checks the API server cannot
    make, each called with the object and its path, returning None or the error.
    """
    if not isinstance(data, Mapping):
        raise errors.InputError(f"{path}: expected an object, found {_type_name(data)}")
    kinds = field_types(cls)
    known = {field_info(f).json for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - known)
    if unknown:
        raise errors.InputError(
            f"{path}: unknown field {unknown[0]!r}; expected one of {', '.join(sorted(known))}"
        )
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        info = field_info(field)
        kind, _optional = kinds[field.name]
        here = f"{path}.{info.json}"
        raw = data.get(info.json)
        if raw is None:
            if info.required:
                raise errors.InputError(f"{here}: required, but missing")
            continue
        values[field.name] = _convert(kind, info, raw, path=here)
    given_defaults = getattr(cls, "given_defaults", None)
    if given_defaults is not None:
        values = {**given_defaults(values), **values}
    obj = cls(**values)
    for rule in getattr(cls, "rules", ()):
        if not rule.check(obj):
            found = f", found {rule.found(obj)!r}" if rule.found is not None else ""
            raise errors.InputError(f"{path}: {rule.message}{found}")
    for check in getattr(cls, "python_checks", ()):
        problem = check(obj, path)
        if problem is not None:
            raise errors.InputError(problem)
    return obj


def _convert(kind: Any, info: FieldInfo, raw: object, *, path: str) -> Any:
    if dataclasses.is_dataclass(kind) and isinstance(kind, type):
        return from_dict(kind, raw, path=path)
    if typing.get_origin(kind) is tuple:
        (item,) = (a for a in typing.get_args(kind) if a is not Ellipsis)
        if not isinstance(raw, list):
            raise errors.InputError(f"{path}: expected a list, found {_type_name(raw)}")
        if info.min_items is not None and len(raw) < info.min_items:
            raise errors.InputError(
                f"{path}: expected at least {info.min_items} item(s), found {len(raw)}"
            )
        if info.max_items is not None and len(raw) > info.max_items:
            raise errors.InputError(
                f"{path}: expected at most {info.max_items} items, found {len(raw)}"
            )
        return tuple(from_dict(item, r, path=f"{path}[{i}]") for i, r in enumerate(raw))
    if info.quantity:
        return parse_quantity(raw, path=path)
    if info.resource_map:
        return _resource_map(raw, path=path)
    if kind is bool:
        if not isinstance(raw, bool):
            raise errors.InputError(f"{path}: expected true or false, found {raw!r}")
        return raw
    if kind is int:
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise errors.InputError(f"{path}: expected an integer, found {raw!r}")
        if info.minimum is not None and raw < info.minimum:
            raise errors.InputError(f"{path}: expected an integer >= {info.minimum}, found {raw}")
        if info.maximum is not None and raw > info.maximum:
            raise errors.InputError(f"{path}: expected an integer <= {info.maximum}, found {raw}")
        return raw
    if kind is str:
        if not isinstance(raw, str):
            raise errors.InputError(f"{path}: expected a string, found {_type_name(raw)}")
        if info.enum is not None and raw not in info.enum:
            raise errors.InputError(
                f"{path}: expected one of {', '.join(info.enum)}, found {raw!r}"
            )
        if info.max_length is not None and len(raw) > info.max_length:
            raise errors.InputError(
                f"{path}: expected at most {info.max_length} characters, found {len(raw)}"
            )
        # fullmatch: the API server's RE2 `$` never matches before a final newline.
        if info.pattern is not None and not re.fullmatch(info.pattern, raw):
            if info.expected is not None:
                raise errors.InputError(f"{path}: expected {info.expected}, found {raw!r}")
            raise errors.InputError(
                f"{path}: {raw!r} does not match the expected form {info.pattern}"
            )
        return raw
    raise TypeError(f"{path}: unsupported model type {kind!r}")


def _resource_map(raw: object, *, path: str) -> dict[str, str]:
    if not isinstance(raw, Mapping):
        raise errors.InputError(f"{path}: expected an object like {{cpu: 500m}}, found {raw!r}")
    if len(raw) > 16:
        raise errors.InputError(f"{path}: expected at most 16 entries, found {len(raw)}")
    result: dict[str, str] = {}
    for key, value in raw.items():
        resource_quantity(value, path=f"{path}.{key}")
        # Kept as written: the pod gets the user's own text (and integers as strings).
        result[str(key)] = str(value)
    return result


def to_dict(obj: object) -> dict[str, Any]:
    """The JSON form of a model object, with every default filled in (quantities as ints)."""
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        raise TypeError(f"expected a model object, found {obj!r}")
    result: dict[str, Any] = {}
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if value is None:
            continue
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = to_dict(value)
        elif isinstance(value, tuple):
            value = [to_dict(item) for item in value]
        elif isinstance(value, dict):
            value = dict(value)
        result[field_info(field).json] = value
    return result


def parse_spec(data: object, *, path: str = "spec") -> DatasetMountSpec:
    """Validate a DatasetMount `spec` mapping; `InputError` names the offending field."""
    return from_dict(DatasetMountSpec, data, path=path)


def with_node_path(spec: DatasetMountSpec, default: str) -> DatasetMountSpec:
    """`spec` with `default` (the platform's) as cache.nodePath where it names none."""
    if spec.cache.node_path is not None:
        return spec
    return dataclasses.replace(spec, cache=dataclasses.replace(spec.cache, node_path=default))


# --- whole objects -------------------------------------------------------------------
#: Checks on the whole object (CEL sees only metadata.name and generateName there).
ROOT_RULES = (
    Rule(
        cel="size(self.metadata.name) <= 63",
        message="metadata.name must be at most 63 characters: pods name it in a label value",
        check=lambda name: len(name) <= 63,
    ),
)


@dataclasses.dataclass(frozen=True)
class DatasetMount:
    """A DatasetMount object as read from the API or a YAML file."""

    name: str
    namespace: str | None
    spec: DatasetMountSpec
    #: The pinned digest: status.manifestDigest, else spec.source.version, else None.
    manifest_digest: str | None
    #: status.phase, or None when the object has no status (e.g. a file).
    phase: str | None
    #: Digests pinned for a mixture's further sources (status.mixture), by name.
    source_digests: Mapping[str, str] = dataclasses.field(default_factory=dict)


def load(doc: object, *, parse: Callable[..., DatasetMountSpec] = parse_spec) -> DatasetMount:
    """Check that `doc` is a DatasetMount object and parse it.

    `parse(spec, path=...)` parses the spec; the operator's webhook passes one that
    serves specs it already parsed for the same (uid, generation) (`mounts.Store`).
    """
    if not isinstance(doc, Mapping):
        raise errors.InputError(f"expected a {KIND} object, found {_type_name(doc)}")
    kind, api_version = doc.get("kind"), doc.get("apiVersion")
    if kind != KIND or api_version != API_VERSION:
        raise errors.InputError(
            f"expected kind {KIND} with apiVersion {API_VERSION}, "
            f"found kind {kind!r} with apiVersion {api_version!r}"
        )
    metadata = doc.get("metadata") or {}
    name = metadata.get("name") if isinstance(metadata, Mapping) else None
    if not isinstance(name, str) or not name:
        raise errors.InputError(f"{KIND}: metadata.name is required, but missing")
    for rule in ROOT_RULES:
        if not rule.check(name):
            raise errors.InputError(f"{KIND} {name}: {rule.message}")
    spec = parse(doc.get("spec"), path=f"{KIND} {name}: spec")
    status = doc.get("status") or {}
    digest = status.get("manifestDigest") if isinstance(status, Mapping) else None
    phase = status.get("phase") if isinstance(status, Mapping) else None
    pinned = status.get("mixture") if isinstance(status, Mapping) else None
    source_digests = {
        str(entry["name"]): str(entry["manifestDigest"])
        for entry in (pinned if isinstance(pinned, list) else [])
        if isinstance(entry, Mapping) and entry.get("name") and entry.get("manifestDigest")
    }
    return DatasetMount(
        name=name,
        namespace=metadata.get("namespace"),
        spec=spec,
        manifest_digest=digest if isinstance(digest, str) else spec.source.version,
        phase=phase if isinstance(phase, str) else None,
        source_digests=source_digests,
    )
