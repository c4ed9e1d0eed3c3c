"""The reconcile core: DatasetMount object in, status + events + retry delay out.

No kopf and no API client here: reading the Secret and resolving the manifest come in
as callables, so tests drive this with a real S3-compatible server and the kopf
handlers (`handlers.py`) stay thin. It never raises for a bad DatasetMount or a
failing source: every failure becomes a phase, a condition and an Event.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

from shardcache import contract, errors, manifests, s3_settings, uris
from shardcache.node import handed_manifests
from shardcache_operator import (
    manifest_handoff,
    quiet_stores,
    resolve_slots,
    sample_room,
    shard_room,
    source_reads,
    specs,
    status,
)

logger = logging.getLogger(__name__)

#: (namespace, name) -> the Secret's decoded data, or None when it does not exist;
#: raises PermissionError when the operator may not read it (RBAC).
SecretReader = Callable[[str, str], Awaitable[Mapping[str, str] | None]]


class ShardLike(Protocol):
    @property
    def path(self) -> str: ...
    @property
    def size(self) -> int: ...


class ManifestLike(Protocol):
    """What a pin records of a resolved manifest (`manifests.Manifest` in-process;
    `resolve_child.Summary` from a resolve's child process)."""

    @property
    def digest(self) -> str: ...
    @property
    def format(self) -> str: ...
    @property
    def shard_count(self) -> int: ...
    @property
    def total_rows(self) -> int: ...
    @property
    def total_bytes(self) -> int: ...
    @property
    def largest_shard(self) -> ShardLike | None: ...


#: A manifest pinned by this reconcile: the spec fields of its source ("spec.source",
#: "spec.mixture.sources[1] (web)") and what was pinned.
Pinned = tuple[str, status.Resolved]
#: Blocking manifest resolution: (uri, format, storage_options) -> manifest; raises
#: SourceRefused when it does not read the source at all, AccessDeniedError when the
#: store refuses the credentials, other InputErrors for the data found there.
Resolver = Callable[[str, str, Mapping[str, str] | None], ManifestLike]
#: A pinned shard a source check looks for: its path in the manifest and its size
#: (status.largestShard).
PinnedShard = tuple[str, int]


class Prober(Protocol):
    """Blocking, cheap reachability check of a source: (uri, storage_options) -> None,
    and with `shard`, that this pinned shard is still there at its size; raises
    SourceError when unreachable, AccessDeniedError when the credentials are refused,
    InputError when the data is gone."""

    def __call__(
        self,
        uri: str,
        options: Mapping[str, str] | None,
        /,
        *,
        shard: PinnedShard | None = None,
    ) -> None: ...


class SourceRefused(errors.InputError):
    """The operator does not read the source at all: its URI, or the platform's policy
    (`sources.Access`), refuses it before any request. Only a spec change helps, so it
    is `Invalid` and not retried; every other InputError of a source is about what the
    store holds or says, which can change without one, and is retried."""


#: An endpoint the platform's policy refuses (`EndpointRefused`): its own reason, not
#: the policy refusal's `authority.REASON` (Invalid, never retried), so an alert or a
#: metric by reason tells the two apart (before 2026-11-30 both were `NotAllowed`).
ENDPOINT_REASON = "EndpointNotAllowed"


class EndpointRefused(SourceRefused):
    """The Secret names an endpoint the platform's policy does not let the operator
    connect to (`sources.Access.source_endpoints`). Not `Invalid` like the spec's other
    refusals: the Secret, which the operator does not watch, can change without the
    spec, so it is retried slowly (`SLOW_RETRY_REASONS`), Pending before a pin and
    Degraded after one, as a `SecretInvalid` Secret is."""

    reason = ENDPOINT_REASON


class ResolveOverMemory(errors.ShardcacheError):
    """A resolve, or a periodic read (`read_workers`), needed more memory than the
    operator lends one (`resolve_children`: its child process's limit, or the operator
    container's memory ran out with it running). Degraded and retried with the backoff:
    the message names the setting."""


#: A source check that got no read worker in time (`read_workers`: other namespaces'
#: reads hold them): nothing is known of the store, so the timer changes no status.
CHECKS_BUSY = "ChecksBusy"


#: Failures only a change at the source fixes (data restored, a bucket created), or one
#: to the Secret, which the operator does not watch (an endpoint the platform refuses):
#: retried at the backoff's longest delay, not the first ones.
SLOW_RETRY_REASONS = frozenset({"InvalidData", "DigestMismatch", "SourceGone", ENDPOINT_REASON})


@dataclasses.dataclass(frozen=True)
class Event:
    type: str  # "Normal" | "Warning"
    reason: str
    message: str


@dataclasses.dataclass(frozen=True)
class Result:
    outcome: status.Outcome
    status: dict[str, Any]
    events: tuple[Event, ...]
    #: Seconds until the next try, or None when only a spec change can help.
    retry_in: float | None
    #: The manifests pinned by this reconcile of a mount now Ready, to hand to its
    #: sidecars (`manifest_handoff`): empty when every pin was kept.
    handed: tuple[Handed, ...] = ()


@dataclasses.dataclass(frozen=True)
class Handed:
    """A manifest pinned now: its source (`manifest_handoff.PRIMARY`, or a mixture
    source's name), digest, and handed parts (empty: too large to hand)."""

    source: str
    digest: str
    parts: tuple[bytes, ...]


@dataclasses.dataclass(frozen=True)
class Backoff:
    initial_seconds: float = 5.0
    max_seconds: float = 300.0

    def delay(self, retry: int) -> float:
        return float(min(self.max_seconds, self.initial_seconds * 2 ** max(0, retry)))


def retry_delay(outcome: status.Outcome, *, retry: int, backoff: Backoff) -> float | None:
    """Seconds until `outcome` is tried again, or None when only a spec change can help
    (Ready, Invalid). A failure only a change at the source fixes (`SLOW_RETRY_REASONS`)
    is tried at the backoff's cap (5 min by default, as often as the periodic check of
    a pinned source); every other Pending or Degraded one with the backoff from its
    start, and not before a store left alone is read again (`status.Failed.retry_after`)."""
    if not isinstance(outcome, status.Failed) or outcome.phase not in (
        status.Phase.DEGRADED,
        status.Phase.PENDING,
    ):
        return None
    if outcome.reason in SLOW_RETRY_REASONS:
        return backoff.max_seconds
    return max(backoff.delay(retry), outcome.retry_after or 0.0)


def source_identity(spec: specs.DatasetMountSpec) -> dict[str, str]:
    """The spec fields a pinned digest depends on; any change resolves again.

    The manifest version is one of them: a pin made by a shardcache whose manifests
    differ (version 2 had no per-shard sha256) is resolved again, never handed to
    sidecars that would refuse it as a changed dataset."""
    identity = {
        "uri": spec.source.uri,
        "format": spec.source.format,
        "manifestVersion": str(manifests.MANIFEST_VERSION),
    }
    if spec.source.version:
        identity["version"] = spec.source.version
    return identity


async def _options(
    spec: specs.DatasetMountSpec,
    namespace: str,
    read_secret: SecretReader,
    *,
    pinned: bool,
) -> tuple[Mapping[str, str] | None, status.Failed | None]:
    """The Secret's data as storage options, or why it cannot be had.

    Before a pin that means waiting (Pending); after one, sidecars cannot start
    without the Secret, so the mount is Degraded while its pin stays. A Secret whose
    keys can only fail (one of the key pair without the other, a newline around a
    value, a password in the endpoint) is `SecretInvalid`, retried like a missing one.
    """
    if spec.source.secret_ref is None:
        return None, None
    secret = spec.source.secret_ref.name
    phase = status.Phase.DEGRADED if pinned else status.Phase.PENDING
    try:
        options = await read_secret(namespace, secret)
    except PermissionError as exc:
        message = (
            f"{exc}: grant it with the chart's rbac.secretNamespaces (and "
            "rbac.secretNames), or a Role with verb get on this Secret"
        )
        return None, status.Failed(
            phase, "SecretForbidden", message, reachable=None, keeps_pin=pinned
        )
    if options is None:
        message = (
            f"Secret {namespace}/{secret} named in spec.source.secretRef.name does not exist: "
            f"create it with keys {contract.ENV_S3_ACCESS_KEY_ID}, "
            f"{contract.ENV_S3_SECRET_ACCESS_KEY} (and {contract.ENV_S3_ENDPOINT}, "
            f"{contract.ENV_S3_REGION} as needed)"
        )
        return None, status.Failed(
            phase, "SecretNotFound", message, reachable=None, keeps_pin=pinned
        )
    problem = s3_settings.problem(
        options,
        origin=f"Secret {namespace}/{secret} named in spec.source.secretRef.name",
        pair=True,
    )
    if problem is not None:
        return None, status.Failed(
            phase, "SecretInvalid", problem, reachable=None, keeps_pin=pinned
        )
    return options, None


def _credentials(
    spec: specs.DatasetMountSpec, namespace: str, options: Mapping[str, str] | None
) -> str:
    """What the source was read with, for a message about refused credentials."""
    ref = spec.source.secret_ref
    if ref is None:
        return "the request without credentials (spec.source names no secretRef)"
    secret = f"Secret {namespace}/{ref.name} (spec.source.secretRef.name)"
    if not (options or {}).get(contract.ENV_S3_ACCESS_KEY_ID):
        return (
            f"the request without credentials ({secret} has no "
            f"{contract.ENV_S3_ACCESS_KEY_ID} and {contract.ENV_S3_SECRET_ACCESS_KEY})"
        )
    return f"the credentials in {secret}"


def _rejected(credentials: str, exc: errors.AccessDeniedError, *, pinned: bool) -> status.Failed:
    """Refused credentials: fixed in the Secret or the bucket's policy, never in the
    spec, so retried with the backoff (Pending before a pin, Degraded after)."""
    message = (
        f"the object store refused {credentials}: {exc}; give the key pair read access "
        "to the source, or put one that has it in the Secret (retried with backoff)"
    )
    phase = status.Phase.DEGRADED if pinned else status.Phase.PENDING
    return status.Failed(phase, "CredentialsRejected", message, reachable=False, keeps_pin=pinned)


def _not_allowed(exc: EndpointRefused, *, pinned: bool) -> status.Failed:
    """An endpoint the platform's policy refuses: fixed in the Secret (or the policy),
    which the operator does not watch, so retried slowly (Pending before a pin,
    Degraded after, the pin kept)."""
    phase = status.Phase.DEGRADED if pinned else status.Phase.PENDING
    return status.Failed(phase, exc.reason, str(exc), reachable=None, keeps_pin=pinned)


def _pinned(spec: specs.DatasetMountSpec, previous: Mapping[str, Any]) -> status.Resolved | None:
    """The pin in `previous` if it belongs to the spec's current source."""
    if not previous.get("manifestDigest") or previous.get("resolvedSource") != source_identity(
        spec
    ):
        return None
    return status.Resolved(
        digest=str(previous["manifestDigest"]),
        format=str(previous.get("format") or spec.source.format),
        shards=int(previous.get("shards") or 0),
        rows=int(previous.get("rows") or 0),
        bytes=int(previous.get("bytes") or 0),
        reused=True,
    )


def recorded_shard(previous: Mapping[str, Any]) -> PinnedShard | None:
    """The pinned shard a source check looks for: the largest, which the pin recorded
    (status.largestShard); None for a pin that recorded none."""
    largest = shard_room.read_recorded(previous.get(status.LARGEST_SHARD))
    return None if largest is None else (largest.path, largest.bytes)


@dataclasses.dataclass(frozen=True)
class Checked:
    """One pinned source a check looks at: its spec fields as messages name them (None
    for spec.source, which its messages never named), its URI and its recorded shard."""

    where: str | None
    uri: str
    shard: PinnedShard | None


def checked_sources(spec: specs.DatasetMountSpec, previous: Mapping[str, Any]) -> list[Checked]:
    """What a check of a pinned mount looks at: spec.source, then each further source
    of its mixture whose pin `previous` keeps (a source without one is resolved by the
    reconcile, not checked)."""
    found = [Checked(None, spec.source.uri, recorded_shard(previous))]
    if spec.mixture is not None:
        before = _pins_by_name(previous)
        for index, source in enumerate(spec.mixture.sources):
            kept = _kept_pin(source, before)
            if kept is not None:
                where = f"spec.mixture.sources[{index}] ({source.name})"
                found.append(Checked(where, source.uri, recorded_shard(kept)))
    return found


async def _check(
    spec: specs.DatasetMountSpec,
    pin: status.Resolved,
    *,
    namespace: str,
    read_secret: SecretReader,
    probe: Prober,
    timeout: float,
    reads: source_reads.Gate,
    checked: Sequence[Checked],
) -> status.Outcome:
    """Keep `pin` if each source in `checked` still answers, and its recorded shard is
    still there; else Degraded (the first that does not, named by its spec fields),
    with the pin kept."""
    options, failure = await _options(spec, namespace, read_secret, pinned=True)
    if failure is not None:
        return failure
    for source in checked:
        failed = await _check_one(
            source,
            spec=spec,
            namespace=namespace,
            options=options,
            probe=probe,
            timeout=timeout,
            reads=reads,
        )
        if failed is not None:
            if source.where is None:
                return failed
            return dataclasses.replace(failed, message=f"{source.where}: {failed.message}")
    return pin


async def _check_one(
    source: Checked,
    *,
    spec: specs.DatasetMountSpec,
    namespace: str,
    options: Mapping[str, str] | None,
    probe: Prober,
    timeout: float,
    reads: source_reads.Gate,
) -> status.Failed | None:
    """Why `source` fails its check, or None when it passes."""
    uri, shard = source.uri, source.shard
    shown = uris.redact(uri)

    def check() -> None:
        if shard is None:  # a pin that recorded none (an older operator's): the root
            probe(uri, options)
        else:
            probe(uri, options, shard=shard)

    try:
        await reads.run(namespace, check, timeout=timeout, what=f"checking {shown}")
    except errors.AccessDeniedError as exc:
        return _rejected(_credentials(spec, namespace, options), exc, pinned=True)
    except EndpointRefused as exc:
        return _not_allowed(exc, pinned=True)
    except SourceRefused as exc:
        return status.Failed(
            status.Phase.INVALID, "InvalidSource", str(exc), reachable=None, keeps_pin=True
        )
    except errors.InputError as exc:
        message = (
            f"{exc}; {_PINNED_REFUSED}: restore the pinned data, or pin anew by changing the "
            "source's uri or version (or recreating the mount); tried again every few minutes"
        )
        return status.Failed(
            status.Phase.DEGRADED, "SourceGone", message, reachable=True, keeps_pin=True
        )
    except resolve_slots.AllBusy as exc:
        return status.Failed(
            status.Phase.DEGRADED, CHECKS_BUSY, str(exc), reachable=None, keeps_pin=True
        )
    except ResolveOverMemory as exc:
        message = f"checking {shown}: {exc}"
        return status.Failed(
            status.Phase.DEGRADED, "CheckOverMemory", message, reachable=None, keeps_pin=True
        )
    except errors.SourceError as exc:
        return status.Failed(
            status.Phase.DEGRADED,
            "SourceUnreachable",
            _unanswered(exc, pinned=True),
            reachable=False,
            keeps_pin=True,
            retry_after=_left_alone(exc),
        )
    except TimeoutError:
        message = f"{shown} did not answer within {timeout:g} s; {_PINNED_REFUSED}; {_LOOK_AT}"
        return status.Failed(
            status.Phase.DEGRADED, "SourceUnreachable", message, reachable=False, keeps_pin=True
        )
    except Exception as exc:  # report and carry on; the next check tries again
        logger.exception("checking %s failed unexpectedly", shown)
        message = f"unexpected error while checking {shown}: {_unexpected(exc, 'checking')}"
        return status.Failed(
            status.Phase.DEGRADED, "CheckFailed", message, reachable=None, keeps_pin=True
        )
    return None


#: What a pinned mount's failed check means for its pods (the webhook's verdict on a
#: Degraded mount).
_PINNED_REFUSED = "new pods are refused, running ones keep reading their cache"
#: Where to look when the store does not answer the operator.
_LOOK_AT = (
    "check the store's endpoint (the Secret's "
    f"{contract.ENV_S3_ENDPOINT}, or the store's default) and the network from the "
    "operator's pod (tried again)"
)


def _unanswered(exc: errors.SourceError, *, pinned: bool) -> str:
    """`SourceUnreachable`'s message: the store's error and where to look, unless the
    error says why itself (a store left alone, or the namespace's reads all running:
    neither is the network's doing)."""
    if isinstance(exc, quiet_stores.Unanswered | source_reads.Busy):
        return str(exc)
    return f"{exc}; {_PINNED_REFUSED}; {_LOOK_AT}" if pinned else f"{exc}; {_LOOK_AT}"


def _unexpected(exc: Exception, doing: str) -> str:
    """An error no branch foresaw, said with what to do: its class and text, and where
    its traceback is (a bug to report, or a library's error to name in one)."""
    return (
        f"{type(exc).__name__}: {exc}; the operator's log has its traceback "
        f'("{doing} ... failed unexpectedly"): please report it (tried again)'
    )


def _left_alone(exc: errors.SourceError) -> float | None:
    """Seconds until a store left alone is read again (`quiet_stores.Unanswered`): a
    retry sooner would fail the same way, and write a status that differs only in its
    count of seconds."""
    return exc.left if isinstance(exc, quiet_stores.Unanswered) else None


async def _resolve(
    spec: specs.DatasetMountSpec,
    *,
    namespace: str,
    read_secret: SecretReader,
    resolve: Resolver,
    timeout: float,
    reads: source_reads.Gate,
) -> status.Outcome:
    options, failure = await _options(spec, namespace, read_secret, pinned=False)
    if failure is not None:
        return failure
    return await _resolve_source(
        spec.source.uri,
        spec.source.format,
        spec.source.version,
        where="spec.source",
        options=options,
        credentials=_credentials(spec, namespace, options),
        resolve=resolve,
        timeout=timeout,
        namespace=namespace,
        reads=reads,
    )


async def _resolve_source(
    uri: str,
    fmt: str,
    version: str | None,
    *,
    where: str,
    options: Mapping[str, str] | None,
    credentials: str,
    resolve: Resolver,
    timeout: float,
    namespace: str,
    reads: source_reads.Gate,
) -> status.Outcome:
    """Resolve one source's manifest; `where` names its spec fields in messages and
    `credentials` what it is read with (`_credentials`). The read runs on `reads`'
    threads, counted against `namespace` (`source_reads`: a store that never answers
    holds its own namespace's slots, never another's).

    `Invalid` only when the operator does not read the source at all (`SourceRefused`);
    what the store holds or says is retried: refused credentials with the backoff,
    data that is missing or unusable (`InvalidData`, `DigestMismatch`) slowly."""
    shown = uris.redact(uri)
    try:
        manifest = await reads.run(
            namespace,
            lambda: resolve(uri, fmt, options),
            timeout=timeout,
            what=f"resolving the manifest of {shown}",
        )
    except EndpointRefused as exc:
        return _not_allowed(exc, pinned=False)
    except SourceRefused as exc:
        return status.Failed(status.Phase.INVALID, "InvalidSource", str(exc), reachable=None)
    except errors.AccessDeniedError as exc:
        return _rejected(credentials, exc, pinned=False)
    except errors.InputError as exc:
        message = f"{exc} (tried again every few minutes, until the data at the source is fixed)"
        return status.Failed(status.Phase.DEGRADED, "InvalidData", message, reachable=True)
    except resolve_slots.AllBusy as exc:
        # The operator's own resolves are busy: nothing is known of the store.
        return status.Failed(status.Phase.DEGRADED, "ResolvesBusy", str(exc), reachable=None)
    except errors.SourceError as exc:
        return status.Failed(
            status.Phase.DEGRADED,
            "SourceUnreachable",
            _unanswered(exc, pinned=False),
            reachable=False,
            retry_after=_left_alone(exc),
        )
    except TimeoutError:
        message = (
            f"resolving the manifest of {shown} took longer than {timeout:g} s; a listing "
            "this large needs the chart's operator.settings.resolveTimeoutSeconds raised"
        )
        return status.Failed(status.Phase.DEGRADED, "ResolveTimeout", message, reachable=False)
    except ResolveOverMemory as exc:
        message = f"resolving the manifest of {shown}: {exc} (retried with backoff)"
        return status.Failed(status.Phase.DEGRADED, "ResolveOverMemory", message, reachable=None)
    except Exception as exc:  # a bug or an unforeseen library error: report, retry, live on
        logger.exception("resolving %s failed unexpectedly", shown)
        message = f"unexpected error while resolving {shown}: {_unexpected(exc, 'resolving')}"
        return status.Failed(status.Phase.DEGRADED, "ResolveFailed", message, reachable=None)
    if version and manifest.digest != version:
        message = (
            f"{where}.version pins {version}, but {shown} has manifest "
            f"{manifest.digest} (manifest version {manifests.MANIFEST_VERSION}): restore "
            f"the pinned data (tried again every few minutes) or update {where}.version "
            f"(a digest from a shardcache before manifest version "
            f"{manifests.MANIFEST_VERSION} never matches)"
        )
        return status.Failed(status.Phase.DEGRADED, "DigestMismatch", message, reachable=True)
    largest = manifest.largest_shard
    return status.Resolved(
        digest=manifest.digest,
        format=manifest.format,
        shards=manifest.shard_count,
        rows=manifest.total_rows,
        bytes=manifest.total_bytes,
        largest=None if largest is None else shard_room.Largest(largest.path, largest.size),
        handed=_handed_parts(manifest),
    )


def _handed_parts(manifest: ManifestLike) -> tuple[bytes, ...]:
    """What a resolve gives of the manifest to hand to the sidecars: a child's summary
    carries it (`resolve_child.Summary.handed`), a manifest resolved in this process
    (tools, tests) is encoded here."""
    if isinstance(manifest, manifests.Manifest):
        return tuple(handed_manifests.encode(manifest) or ())
    parts = getattr(manifest, "handed", ())
    return tuple(parts) if isinstance(parts, tuple) else ()


def mixture_identity(source: specs.MixtureSourceSpec) -> dict[str, str]:
    """The fields a further source's pinned digest depends on; any change resolves it again."""
    identity = {"uri": source.uri, "format": source.format}
    if source.version:
        identity["version"] = source.version
    return identity


def _pins_by_name(previous: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {
        str(entry.get("name")): entry
        for entry in previous.get("mixture") or []
        if isinstance(entry, Mapping)
    }


def _kept_pin(
    source: specs.MixtureSourceSpec, before: Mapping[str, Mapping[str, Any]]
) -> dict[str, Any] | None:
    """`source`'s pin in `before` if it was resolved for its current identity."""
    old = before.get(source.name)
    if old is None or not old.get("manifestDigest"):
        return None
    return dict(old) if old.get("resolvedSource") == mixture_identity(source) else None


def _pinned_mixture(
    spec: specs.DatasetMountSpec, previous: Mapping[str, Any]
) -> list[dict[str, Any]] | None:
    """The pins in `previous` of the spec's further sources, in their order; None when
    one of them has none for its current uri, format and version."""
    assert spec.mixture is not None
    before = _pins_by_name(previous)
    pins: list[dict[str, Any]] = []
    for source in spec.mixture.sources:
        pin = _kept_pin(source, before)
        if pin is None:
            return None
        pins.append(pin)
    return pins


async def _resolve_mixture(
    spec: specs.DatasetMountSpec,
    previous: Mapping[str, Any],
    *,
    namespace: str,
    read_secret: SecretReader,
    resolve: Resolver,
    timeout: float,
    reads: source_reads.Gate,
    handed: list[Handed],
) -> tuple[list[dict[str, Any]], status.Failed | None, list[Pinned]]:
    """The pins of a mixture's further sources (status.mixture), each kept from
    `previous` while its identity holds, else resolved like spec.source; or the first
    failure, named by its source. And those resolved now, with their spec fields; what
    to hand of them is added to `handed`."""
    assert spec.mixture is not None
    before = _pins_by_name(previous)
    pins: list[dict[str, Any]] = []
    resolved: list[Pinned] = []
    options: Mapping[str, str] | None = None
    fetched = False
    for index, source in enumerate(spec.mixture.sources):
        kept = _kept_pin(source, before)
        if kept is not None:
            pins.append(kept)
            continue
        if not fetched:
            options, failure = await _options(spec, namespace, read_secret, pinned=False)
            if failure is not None:
                return pins, failure, resolved
            fetched = True
        where = f"spec.mixture.sources[{index}]"
        outcome = await _resolve_source(
            source.uri,
            source.format,
            source.version,
            where=where,
            options=options,
            credentials=_credentials(spec, namespace, options),
            resolve=resolve,
            timeout=timeout,
            namespace=namespace,
            reads=reads,
        )
        if isinstance(outcome, status.Failed):
            message = f"{where} ({source.name}): {outcome.message}"
            return pins, dataclasses.replace(outcome, message=message), resolved
        resolved.append((f"{where} ({source.name})", outcome))
        handed.append(Handed(source.name, outcome.digest, outcome.handed))
        pins.append(
            {
                "name": source.name,
                "manifestDigest": outcome.digest,
                "format": outcome.format,
                "shards": outcome.shards,
                "rows": outcome.rows,
                "bytes": outcome.bytes,
                "resolvedSource": mixture_identity(source),
                # Judged again against the limit while the pin is kept (ShardTooLargeToDecode).
                **(
                    {}
                    if outcome.largest is None
                    else {status.LARGEST_SHARD: outcome.largest.recorded()}
                ),
            }
        )
    return pins, None, resolved


def _events(outcome: status.Outcome, previous: Mapping[str, Any]) -> tuple[Event, ...]:
    """One Event per change of phase or reason: retries of the same failure stay quiet."""
    before = status.conditions_by_type(previous)
    # Ready carries the reason of every failure; ManifestResolved stays Pinned through
    # the failed checks of a kept pin, so it cannot tell a repeat from a first failure.
    old = before.get(status.READY_CONDITION) or {}
    if isinstance(outcome, status.Resolved):
        if outcome.reused and previous.get("phase") == status.Phase.READY:
            return ()
        message = status.conditions_for(outcome)[1].message
        if outcome.reused and previous.get("phase") == status.Phase.DEGRADED:
            return (Event("Normal", "SourceRecovered", message),)
        return (Event("Normal", "ManifestPinned", message),)
    if previous.get("phase") == outcome.phase and old.get("reason") == outcome.reason:
        return ()
    return (Event("Warning", outcome.reason, outcome.message),)


def _result(
    outcome: status.Outcome,
    obj: Mapping[str, Any],
    *,
    generation: int | None,
    now: str,
    identity: Mapping[str, str] | None,
    retry_in: float | None,
    mixture: list[dict[str, Any]] | None = None,
    spec: specs.DatasetMountSpec | None = None,
    pinned_now: Sequence[Pinned] = (),
    handed: tuple[Handed, ...] = (),
) -> Result:
    previous = obj.get("status") or {}
    new_status = status.build_status(
        outcome,
        previous=previous,
        generation=generation,
        now=now,
        resolved_source=identity,
        mixture=mixture,
        spec=spec,
    )
    events = _events(outcome, previous)
    if spec is not None and isinstance(outcome, status.Resolved):
        events += _window_events(spec, new_status, previous, generation)
    if spec is not None:
        # A failure keeps its pin, which is judged again too (a limit lowered while the
        # source is down); only a Ready mount's pins are new.
        new_pins = pinned_now if isinstance(outcome, status.Resolved) else ()
        events += _shard_room_events(spec, previous, new_status, new_pins)
    return Result(outcome, new_status, events, retry_in, handed)


def _shard_room_events(
    spec: specs.DatasetMountSpec,
    previous: Mapping[str, Any],
    new_status: Mapping[str, Any],
    pinned_now: Sequence[Pinned],
) -> tuple[Event, ...]:
    """Warnings of a shard the sidecar cannot decode in its memory limit, before any
    pod reads it (`status.decode_room_warnings`, one a source over the room),
    deduplicated by the ShardTooLargeToDecode condition (`build_status`) as `_events`
    by Ready.

    Each source over the room is said when the condition becomes True (from False,
    Unknown or none), whatever made it: a new pin, a limit lowered on a kept pin (judged
    again from status.largestShard). None while it stays True, as every reconcile
    judges it again, but a source pinned now over the room: a shard not said before."""
    if not status.has_condition(new_status, shard_room.REASON, "True"):
        return ()
    warnings = status.decode_room_warnings(spec, new_status)
    if status.has_condition(previous, shard_room.REASON, "True"):
        new = {where for where, _ in pinned_now}
        warnings = [(where, message) for where, message in warnings if where in new]
    return tuple(Event("Warning", shard_room.REASON, message) for _, message in warnings)


def _window_events(
    spec: specs.DatasetMountSpec,
    new_status: Mapping[str, Any],
    previous: Mapping[str, Any],
    generation: int | None,
) -> tuple[Event, ...]:
    """How many ranks' sample windows the memory tier holds (`sample_room.capacity`),
    once per generation that is Ready: a reconcile of an unchanged Ready mount (an
    operator restart) says nothing again."""
    if previous.get("phase") == status.Phase.READY and (
        previous.get("observedGeneration") == generation
    ):
        return ()
    said = sample_room.capacity(spec, new_status)
    return () if said is None else (Event(*said),)


async def reconcile(
    obj: Mapping[str, Any],
    *,
    read_secret: SecretReader,
    resolve: Resolver,
    probe: Prober,
    now: str,
    retry: int = 0,
    backoff: Backoff = Backoff(),
    timeout: float = 600.0,
    refusal: status.Failed | None = None,
    reads: source_reads.Gate | None = None,
) -> Result:
    """Resolve and pin the manifest of one DatasetMount object; never raises for its data.

    A pin for the same source (`status.resolvedSource`) is kept and only checked for
    reachability: listing again could only move the pin, which is what pinning forbids.
    Spec changes elsewhere (cache sizes, prefetch depth) therefore keep it.

    `refusal`: the platform's verdict on a valid spec (`authority`),
    which stops the reconcile before the source is read; a Pending one is retried
    with the backoff like any other.

    `reads`: where the source is read, counted per namespace: the operator's one
    `source_reads.Gate` (`context.Context.source_reads`); None, one of this call's own.
    """
    reads = reads or source_reads.Gate()
    metadata = obj.get("metadata") or {}
    namespace = str(metadata.get("namespace") or "")
    generation = metadata.get("generation")
    generation = generation if isinstance(generation, int) else None
    try:
        spec = specs.parse_spec(obj.get("spec"))
    except errors.InputError as exc:
        outcome: status.Outcome = status.Failed(
            status.Phase.INVALID, "InvalidSpec", str(exc), reachable=None
        )
        return _result(outcome, obj, generation=generation, now=now, identity=None, retry_in=None)
    identity = source_identity(spec)
    if refusal is not None:
        pending = refusal.phase in (status.Phase.DEGRADED, status.Phase.PENDING)
        return _result(
            refusal,
            obj,
            generation=generation,
            now=now,
            identity=identity,
            retry_in=backoff.delay(retry) if pending else None,
        )
    pin = _pinned(spec, obj.get("status") or {})
    if pin is not None:
        outcome = await _check(
            spec,
            pin,
            namespace=namespace,
            read_secret=read_secret,
            probe=probe,
            timeout=timeout,
            reads=reads,
            checked=checked_sources(spec, obj.get("status") or {}),
        )
        kept = _unchecked_restart(outcome, obj.get("status") or {}, generation, pin)
        if kept is not None:
            assert isinstance(outcome, status.Failed)
            logger.info("%s/%s not checked: %s", namespace, metadata.get("name"), outcome.message)
            outcome = kept
    else:
        outcome = await _resolve(
            spec,
            namespace=namespace,
            read_secret=read_secret,
            resolve=resolve,
            timeout=timeout,
            reads=reads,
        )
    mixture: list[dict[str, Any]] | None = None
    pinned_now: list[Pinned] = []
    handed: list[Handed] = []
    if isinstance(outcome, status.Resolved) and not outcome.reused:
        pinned_now.append(("spec.source", outcome))
        handed.append(Handed(manifest_handoff.PRIMARY, outcome.digest, outcome.handed))
    if spec.mixture is not None and isinstance(outcome, status.Resolved):
        # Ready only once every source is pinned: a pod must read the same data for each.
        mixture, failed, further = await _resolve_mixture(
            spec,
            obj.get("status") or {},
            namespace=namespace,
            read_secret=read_secret,
            resolve=resolve,
            timeout=timeout,
            reads=reads,
            handed=handed,
        )
        if failed is not None:
            outcome, mixture = failed, None
        pinned_now += further
    retry_in = retry_delay(outcome, retry=retry, backoff=backoff)
    return _result(
        outcome,
        obj,
        generation=generation,
        now=now,
        identity=identity,
        retry_in=retry_in,
        mixture=mixture,
        spec=spec,
        pinned_now=pinned_now,
        # Handed as soon as pinned, a mixture's other source failing or not: a pin kept
        # from the status is never resolved, so never handed, again.
        handed=tuple(handed),
    )


def _unchecked_restart(
    outcome: status.Outcome,
    previous: Mapping[str, Any],
    generation: int | None,
    pin: status.Resolved,
) -> status.Outcome | None:
    """What stands when `outcome` is a check that got no read worker (`CHECKS_BUSY`) in
    an operator restart's reconcile, not a spec update's (whose Secret, not part of the
    pin, may name another store): the status of this very generation, as the timer's
    check leaves it (`check_source`). Nothing is known of the store: a Ready mount stays
    Ready, its pods admitted (Degraded would let other namespaces' reads, holding every
    worker while the operator starts, refuse this one's pods), and a Degraded one keeps
    its reason, retried as before. None where the check's outcome stands."""
    if not (
        isinstance(outcome, status.Failed)
        and outcome.reason == CHECKS_BUSY
        and generation is not None
        and previous.get("observedGeneration") == generation
    ):
        return None
    if previous.get("phase") == status.Phase.READY:
        return pin
    before = status.conditions_by_type(previous)
    ready = before.get(status.READY_CONDITION) or {}
    if previous.get("phase") != status.Phase.DEGRADED or not ready.get("reason"):
        return None
    reachable = (before.get(status.SOURCE_REACHABLE) or {}).get("status")
    return status.Failed(
        status.Phase.DEGRADED,
        str(ready["reason"]),
        str(ready.get("message") or ""),
        reachable={"True": True, "False": False}.get(str(reachable)),
        keeps_pin=True,
    )


def current_pins(
    spec: specs.DatasetMountSpec, previous: Mapping[str, Any]
) -> list[tuple[str, str, str]]:
    """(source key, URI, digest) of each pin in status `previous`, when every source of
    the spec is pinned for what it is now (else a reconcile is under way: none)."""
    pin = _pinned(spec, previous)
    if pin is None:
        return []
    further: dict[str, str] = {}
    if spec.mixture is not None:
        kept = _pinned_mixture(spec, previous)
        if kept is None:
            return []
        further = {str(p["name"]): str(p["manifestDigest"]) for p in kept}
    return manifest_handoff.pinned_sources(spec, pin.digest, further)


async def resolve_again(
    spec: specs.DatasetMountSpec,
    source: str,
    *,
    namespace: str,
    read_secret: SecretReader,
    resolve: Resolver,
    timeout: float,
    reads: source_reads.Gate,
) -> status.Outcome:
    """Resolve pinned source `source` (`manifest_handoff.PRIMARY` or a mixture source's
    name) again, as it is now, for the manifest to hand of a pin kept without it
    (`manifest_backfill`); the caller compares the digest with the pin. Never raises for
    the source: a failure is `status.Failed`, as a reconcile's."""
    options, failure = await _options(spec, namespace, read_secret, pinned=True)
    if failure is not None:
        return failure
    if source == manifest_handoff.PRIMARY:
        uri, fmt, where = spec.source.uri, spec.source.format, "spec.source"
    else:
        assert spec.mixture is not None
        index, found = next((i, s) for i, s in enumerate(spec.mixture.sources) if s.name == source)
        uri, fmt, where = found.uri, found.format, f"spec.mixture.sources[{index}]"
    return await _resolve_source(
        uri,
        fmt,
        None,
        where=where,
        options=options,
        credentials=_credentials(spec, namespace, options),
        resolve=resolve,
        timeout=timeout,
        namespace=namespace,
        reads=reads,
    )


async def check_source(
    obj: Mapping[str, Any],
    *,
    read_secret: SecretReader,
    probe: Prober,
    now: str,
    timeout: float = 60.0,
    reads: source_reads.Gate | None = None,
) -> Result | None:
    """Periodic re-check that the source of a pinned DatasetMount still answers.

    Only reachability changes here (Ready <-> Degraded), never the pin. Returns None
    when the object is not pinned for its current source, or for one of its mixture's
    current sources: that is `reconcile`'s job; and when the check got no read worker
    (`CHECKS_BUSY`): the next check tries again. `reads`: as `reconcile`'s.
    """
    previous = obj.get("status") or {}
    if previous.get("phase") not in (status.Phase.READY, status.Phase.DEGRADED):
        return None
    try:
        spec = specs.parse_spec(obj.get("spec"))
    except errors.InputError:
        return None
    pin = _pinned(spec, previous)
    if pin is None:
        return None
    mixture: list[dict[str, Any]] | None = None
    if spec.mixture is not None:
        # A source edited or added since the last pin would be Ready with another
        # source's digest, or none: the webhook hands pods whatever status.mixture holds.
        mixture = _pinned_mixture(spec, previous)
        if mixture is None:
            return None
    namespace = str((obj.get("metadata") or {}).get("namespace") or "")
    outcome = await _check(
        spec,
        pin,
        namespace=namespace,
        read_secret=read_secret,
        probe=probe,
        timeout=timeout,
        reads=reads or source_reads.Gate(),
        checked=checked_sources(spec, previous),
    )
    if isinstance(outcome, status.Failed) and outcome.reason == CHECKS_BUSY:
        name = (obj.get("metadata") or {}).get("name")
        logger.info("%s/%s not checked: %s", namespace, name, outcome.message)
        return None
    observed = previous.get("observedGeneration")
    return _result(
        outcome,
        obj,
        generation=observed if isinstance(observed, int) else None,
        now=now,
        identity=source_identity(spec),
        retry_in=None,
        mixture=mixture,
    )
