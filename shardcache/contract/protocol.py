"""The control protocol between a trainer and its sidecar, defined once for both ends.

HTTP/1.1 over the Unix socket `contract.socket_path(...)`, JSON bodies, every data-plane
route under `/<CONTROL_API_VERSION>/`. The spec, with every request and response, is
docs/wire-format.md; this module holds what both ends must agree on byte for byte:
route paths, the JSON form of a reader's plan parameters, and the error body with the
`kind` that maps back to a `shardcache.errors` class on the client.

Pure functions only: no sockets here (the client transport is `sidecar_client`, the
server is `shardcache_sidecar.server`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any, Final

from shardcache import contract, errors, plans, streams

VERSION: Final = contract.CONTROL_API_VERSION
PREFIX: Final = f"/{VERSION}"

# Unversioned probe routes: kubelet and Prometheus reach them by these fixed paths.
HEALTHZ: Final = "/healthz"
READYZ: Final = "/readyz"
METRICS: Final = "/metrics"

MANIFEST: Final = f"{PREFIX}/manifest"
STATUS: Final = f"{PREFIX}/status"

#: Reader ids are chosen by the client, so a re-registration after a sidecar restart is
#: the same reader; the pattern keeps them safe in a URL path and in logs.
#: Both patterns are for `fullmatch` only: with `match`, a `$` would accept a final "\n".
READER_ID_PATTERN: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
LEASE_ID_PATTERN: Final = re.compile(r"[0-9a-f]{32}")
#: Characters of an unexpected answer body shown in the error it becomes.
_SHOWN_BODY: Final = 500

# --- features: what a sidecar serves beyond the first v1 routes ----------------------
# Additions to v1 are optional for both ends: a sidecar lists the ones it serves in its
# answer to a reader's registration, and a client uses only those it finds there, so a
# newer client keeps working with an older sidecar and the other way round.
#: acquire takes `ahead` and answers with leases on the reader's next resident shards.
FEATURE_AHEAD: Final = "ahead"
#: POST /v1/readers/{id}/notes: pinned shards and dropped holds, batched.
FEATURE_NOTES: Final = "notes"
#: A reader's plan params may carry `segments` (elastic resume), and the sidecar's
#: prefetcher follows them. An older sidecar ignores the field: it still serves every
#: shard asked for, but reads ahead along rule 5, so the client warns.
FEATURE_SEGMENTS: Final = "segments"
#: notes carry `stalls`: the reader's training-loop wait and step totals
#: (`shardcache.stalls`), exported by the sidecar as the data-stall signal.
FEATURE_STALLS: Final = "stalls"
#: A registration takes `ahead` and answers with leases on the reader's first resident
#: shards, so opening a dataset costs no acquire round trip when its shards are warm.
FEATURE_OPEN_AHEAD: Final = "open_ahead"
#: A registration may say `"reader_lock": true`: the client holds a shared flock on
#: `<memory dir>/.readers/<reader id>.lock` (`shardcache.node.reader_locks`) for as long
#: as the reader is open, and the sidecar drops the reader once nobody holds it (the
#: process that opened it is gone).
FEATURE_READER_LOCKS: Final = "reader_locks"
#: A registration may say `"skip_handed": true`: the client pins again, itself, every
#: entry handed to it with `reuse` (the warm fast path), so grants ahead (of an acquire
#: or a registration) leave out the shards already handed to this reader: a lease, a
#: hold and its release each, for a pin the client makes anyway.
FEATURE_SKIP_HANDED: Final = "skip_handed"
#: Every request that carries a reader's position (registration, position, acquire,
#: pinned, notes) may carry `seq`: the client's count of that reader's moves when the
#: request was built. The client sends requests on several connections (the notifier's
#: batches among them), so one built earlier may arrive later; the sidecar applies no
#: position older than the last it applied for the reader, and everything else in the
#: request as before. A request without `seq` (an older client) moves the reader, as
#: it always did.
FEATURE_SEQ: Final = "seq"
FEATURES: Final = (
    FEATURE_AHEAD,
    FEATURE_NOTES,
    FEATURE_SEGMENTS,
    FEATURE_STALLS,
    FEATURE_OPEN_AHEAD,
    FEATURE_READER_LOCKS,
    FEATURE_SKIP_HANDED,
    FEATURE_SEQ,
)
#: The registration's field of `FEATURE_READER_LOCKS`.
READER_LOCK_FIELD: Final = "reader_lock"
#: The registration's field of `FEATURE_SKIP_HANDED`.
SKIP_HANDED_FIELD: Final = "skip_handed"
#: The field of `FEATURE_SEQ`, in every request that carries a position.
SEQ_FIELD: Final = "seq"
#: Most shards one acquire answer grants ahead; a client asking for more gets this many.
MAX_AHEAD: Final = 16

# --- error kinds: what the caller should do ---------------------------------------
#: Fix the request; retrying will not help.
KIND_INPUT: Final = "input"
#: The object store failed after the sidecar's retries; a later retry may succeed.
KIND_SOURCE: Final = "source"
#: The node cache cannot serve the request (limits, a timeout, an internal error).
KIND_CACHE: Final = "cache"
#: The sidecar is up but not serving data yet (still resolving the manifest); retry.
KIND_UNAVAILABLE: Final = "unavailable"
KINDS: Final = (KIND_INPUT, KIND_SOURCE, KIND_CACHE, KIND_UNAVAILABLE)

# Codes refine a kind where the client acts on them.
CODE_BAD_REQUEST: Final = "bad_request"
CODE_UNKNOWN_READER: Final = "unknown_reader"
CODE_UNKNOWN_SHARD: Final = "unknown_shard"
CODE_UNKNOWN_ROUTE: Final = "unknown_route"
CODE_MANIFEST_MISMATCH: Final = "manifest_mismatch"
#: The object store refused the sidecar's credentials (`errors.AccessDeniedError`); a
#: client that predates it raises the `InputError` of its kind, the class's parent.
CODE_ACCESS_DENIED: Final = "access_denied"
CODE_STARTING: Final = "starting"
CODE_TIMEOUT: Final = "timeout"
CODE_SOURCE_FAILED: Final = "source_failed"
CODE_INTERNAL: Final = "internal"


def reader_path(reader_id: str) -> str:
    return f"{PREFIX}/readers/{reader_id}"


def acquire_path(reader_id: str) -> str:
    return f"{PREFIX}/readers/{reader_id}/acquire"


def position_path(reader_id: str) -> str:
    return f"{PREFIX}/readers/{reader_id}/position"


def pinned_path(reader_id: str) -> str:
    return f"{PREFIX}/readers/{reader_id}/pinned"


def notes_path(reader_id: str) -> str:
    return f"{PREFIX}/readers/{reader_id}/notes"


def lease_path(lease_id: str) -> str:
    return f"{PREFIX}/leases/{lease_id}"


def error_body(kind: str, code: str, message: str) -> dict[str, Any]:
    """The JSON body of every non-2xx response."""
    return {"error": {"kind": kind, "code": code, "message": message, "version": VERSION}}


def kind_of(exc: BaseException) -> str:
    """The wire kind of a shardcache error raised inside the sidecar."""
    if isinstance(exc, errors.InputError):
        return KIND_INPUT
    if isinstance(exc, errors.SourceError):
        return KIND_SOURCE
    return KIND_CACHE


@dataclasses.dataclass(frozen=True)
class WireError:
    """An error response as the client received it."""

    status: int
    kind: str
    code: str
    message: str

    @classmethod
    def from_body(cls, status: int, body: object) -> WireError:
        """Unknown or malformed bodies (a proxy in between, a newer sidecar) still give
        a cache error that says what came back, never a bare KeyError."""
        if isinstance(body, Mapping) and isinstance(body.get("error"), Mapping):
            err = body["error"]
            return cls(
                status=status,
                kind=str(err.get("kind", KIND_CACHE)),
                code=str(err.get("code", CODE_INTERNAL)),
                message=str(err.get("message", "")),
            )
        shown = repr(body)
        if len(shown) > _SHOWN_BODY:  # a huge body would bury the message in the log
            shown = f"{shown[:_SHOWN_BODY]}... ({len(shown)} characters)"
        return cls(status, KIND_CACHE, CODE_INTERNAL, f"unexpected response body: {shown}")

    def to_exception(self) -> errors.ShardcacheError:
        """The `shardcache.errors` class for this kind, with the sidecar's message."""
        text = f"sidecar: {self.message} (HTTP {self.status}, kind={self.kind}, code={self.code})"
        if self.code == CODE_MANIFEST_MISMATCH:
            return errors.ManifestMismatchError(text)
        if self.code == CODE_UNKNOWN_SHARD:
            return errors.ShardIndexError(text)
        if self.code == CODE_ACCESS_DENIED:
            return errors.AccessDeniedError(text)
        if self.kind == KIND_INPUT:
            return errors.InputError(text)
        if self.kind == KIND_SOURCE:
            return errors.SourceError(text)
        if self.kind == KIND_UNAVAILABLE:
            return errors.SidecarUnavailableError(text)
        if self.code == CODE_TIMEOUT:
            # A TimeoutError too, as the same wait in embedded mode raises it.
            return errors.AcquireTimeoutError(text)
        return errors.CacheError(text)


# --- request fields ------------------------------------------------------------------
def require_int(body: Mapping[str, Any], key: str, *, minimum: int | None = None) -> int:
    value = body.get(key)
    # bool is an int in Python but never a row count on the wire.
    if not isinstance(value, int) or isinstance(value, bool):
        raise errors.InputError(f"field {key!r}: expected an integer, found {value!r}")
    if minimum is not None and value < minimum:
        raise errors.InputError(f"field {key!r}: expected an integer >= {minimum}, found {value}")
    return value


def optional_int(body: Mapping[str, Any], key: str, *, minimum: int, default: int) -> int:
    if body.get(key) is None:
        return default
    return require_int(body, key, minimum=minimum)


def optional_seq(body: Mapping[str, Any]) -> int | None:
    """A request's `seq` (`FEATURE_SEQ`): an integer >= 0, or None when absent."""
    if body.get(SEQ_FIELD) is None:
        return None
    return require_int(body, SEQ_FIELD, minimum=0)


def int_list(body: Mapping[str, Any], key: str) -> list[int]:
    """A list of integers (empty when absent); InputError names the bad field."""
    value = body.get(key, [])
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise errors.InputError(f"field {key!r}: expected a list of integers, found {value!r}")
    return value


def lease_list(body: Mapping[str, Any], key: str) -> list[str]:
    """A list of lease ids (empty when absent); InputError names the bad field."""
    value = body.get(key, [])
    if not isinstance(value, list) or not all(
        isinstance(v, str) and LEASE_ID_PATTERN.fullmatch(v) for v in value
    ):
        raise errors.InputError(f"field {key!r}: expected a list of lease ids, found {value!r}")
    return value


def optional_float(body: Mapping[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
        raise errors.InputError(f"field {key!r}: expected a positive number, found {value!r}")
    return float(value)


def optional_bool(body: Mapping[str, Any], key: str) -> bool:
    """A true/false field; absent (or null) is false."""
    if body.get(key) is None:
        return False
    return require_bool(body, key)


def require_bool(body: Mapping[str, Any], key: str) -> bool:
    value = body.get(key)
    if not isinstance(value, bool):
        raise errors.InputError(f"field {key!r}: expected true or false, found {value!r}")
    return value


def require_str(body: Mapping[str, Any], key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise errors.InputError(f"field {key!r}: expected a non-empty string, found {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class Stalls:
    """A reader's data-stall totals as notes carry them (`FEATURE_STALLS`).

    Totals since the reader opened, never deltas: a batch of notes that is lost or sent
    twice then changes nothing, and the sidecar counts what grew since the last one.
    """

    #: Seconds the training loop waited inside the iterator for a batch.
    wait_seconds: float
    #: Seconds between batches, outside the iterator (the training step).
    step_seconds: float
    batches: int
    #: Waiting over waiting plus stepping, over about the last 20 batches (0..1).
    recent_fraction: float


def stalls_to_json(stalls: Stalls) -> dict[str, Any]:
    return dataclasses.asdict(stalls)


def _non_negative(body: Mapping[str, Any], key: str, *, maximum: float | None = None) -> float:
    value = body.get(key)
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not 0 <= value < float("inf")
        or (maximum is not None and value > maximum)
    ):
        bound = f" and <= {maximum}" if maximum is not None else ""
        raise errors.InputError(f"field {key!r}: expected a number >= 0{bound}, found {value!r}")
    return float(value)


def stalls_from_json(body: Mapping[str, Any]) -> Stalls | None:
    """The `stalls` field of a notes body (None when absent); InputError names a bad one."""
    value = body.get("stalls")
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise errors.InputError(f"field 'stalls': expected an object, found {value!r}")
    return Stalls(
        wait_seconds=_non_negative(value, "wait_seconds"),
        step_seconds=_non_negative(value, "step_seconds"),
        batches=require_int(value, "batches", minimum=0),
        recent_fraction=_non_negative(value, "recent_fraction", maximum=1.0),
    )


def params_to_json(params: plans.PlanParams) -> dict[str, Any]:
    return {
        "seed": params.seed,
        "epoch": params.epoch,
        "rank": params.rank,
        "world_size": params.world_size,
        "shuffle": params.shuffle,
        "block_size": params.block_size,
        # After an elastic resume, the segments the rank reads in their epoch: the
        # sidecar prefetches and leases along them. Absent: rule 5 (older clients).
        "segments": params.segments.to_json() if params.segments is not None else None,
        "granularity": params.granularity,
        "window": params.window,
    }


def params_from_json(body: Mapping[str, Any]) -> plans.PlanParams:
    """Plan parameters from a request body; `InputError` names the bad field."""
    # PlanParams validates the ranges (rank < world_size, ...) with its own messages.
    return plans.PlanParams(
        seed=require_int(body, "seed"),
        epoch=require_int(body, "epoch", minimum=0),
        rank=require_int(body, "rank", minimum=0),
        world_size=require_int(body, "world_size", minimum=1),
        shuffle=require_bool(body, "shuffle"),
        block_size=require_int(body, "block_size", minimum=1),
        segments=(
            streams.Segments.from_json(body["segments"], where="field 'segments'")
            if body.get("segments") is not None
            else None
        ),
        # Plan version 2's fields; a client from before them reads in block mode.
        granularity=require_str(body, "granularity") if "granularity" in body else plans.BLOCK,
        window=require_int(body, "window", minimum=1) if "window" in body else plans.DEFAULT_WINDOW,
    )


def check_reader_id(reader_id: str) -> str:
    if not READER_ID_PATTERN.fullmatch(reader_id):
        raise errors.InputError(
            f"reader id: expected 1-128 characters of [A-Za-z0-9_.-] starting with a letter "
            f"or digit, found {reader_id!r}"
        )
    return reader_id
