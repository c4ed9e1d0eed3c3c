"""The reconcile core: DatasetMount object in, status + events + retry delay out.

No kopf and no API client here: reading the Secret and resolving the manifest come in
as callables, so tests drive this with a real S3-compatible server and the kopf
handlers (`handlers.py`) stay thin. It never raises for a bad DatasetMount or a
failing source: every failure becomes a phase, a condition and an Event.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from shardcache import errors
from shardcache import spec as spec_model
from shardcache_operator import status

logger = logging.getLogger(__name__)

#: (namespace, name) -> the Secret's decoded data, or None when it does not exist;
#: raises PermissionError when the operator may not read it (RBAC).
SecretReader = Callable[[str, str], Awaitable[Mapping[str, str] | None]]


class ManifestLike(Protocol):
    @property
    def digest(self) -> str: ...
    @property
    def format(self) -> str: ...
    @property
    def shards(self) -> tuple[Any, ...]: ...
    @property
    def total_rows(self) -> int: ...
    @property
    def total_bytes(self) -> int: ...


#: Blocking manifest resolution: (uri, format, storage_options) -> manifest.
Resolver = Callable[[str, str, Mapping[str, str] | None], ManifestLike]


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


@dataclasses.dataclass(frozen=True)
class Backoff:
    initial_seconds: float = 5.0
    max_seconds: float = 300.0

    def delay(self, retry: int) -> float:
        return float(min(self.max_seconds, self.initial_seconds * 2 ** max(0, retry)))


def source_identity(spec: spec_model.DatasetMountSpec) -> dict[str, str]:
    """The spec fields a pinned digest depends on; any change resolves again."""
    identity = {"uri": spec.source.uri, "format": spec.source.format}
    if spec.source.version:
        identity["version"] = spec.source.version
    return identity


async def _resolve(
    obj: Mapping[str, Any],
    *,
    read_secret: SecretReader,
    resolve: Resolver,
    timeout: float,
) -> tuple[status.Outcome, dict[str, str] | None]:
    metadata = obj.get("metadata") or {}
    namespace = str(metadata.get("namespace") or "")
    try:
        spec = spec_model.parse_spec(obj.get("spec"))
    except errors.InputError as exc:
        return status.Failed(status.INVALID, "InvalidSpec", str(exc), None), None
    identity = source_identity(spec)
    previous = obj.get("status") or {}
    if previous.get("manifestDigest") and previous.get("resolvedSource") == identity:
        # Pinned for this source already: listing again could only move the pin, which
        # is exactly what pinning forbids. Spec changes elsewhere (cache sizes) keep it.
        return (
            status.Resolved(
                digest=str(previous["manifestDigest"]),
                format=str(previous.get("format") or spec.source.format),
                shards=int(previous.get("shards") or 0),
                rows=int(previous.get("rows") or 0),
                bytes=int(previous.get("bytes") or 0),
                reused=True,
            ),
            identity,
        )
    options: Mapping[str, str] | None = None
    if spec.source.secret_ref is not None:
        secret = spec.source.secret_ref.name
        try:
            options = await read_secret(namespace, secret)
        except PermissionError as exc:
            message = (
                f"{exc}: grant it with the chart's rbac.secretNamespaces (and "
                "rbac.secretNames), or a Role with verb get on this Secret"
            )
            return status.Failed(status.PENDING, "SecretForbidden", message, None), identity
        if options is None:
            return (
                status.Failed(
                    status.PENDING,
                    "SecretNotFound",
                    f"Secret {namespace}/{secret} named in spec.source.secretRef.name does "
                    "not exist: create it with keys AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY "
                    "(and AWS_ENDPOINT_URL, AWS_REGION as needed)",
                    None,
                ),
                identity,
            )
    uri = spec.source.uri
    try:
        manifest = await asyncio.wait_for(
            asyncio.to_thread(resolve, uri, spec.source.format, options), timeout
        )
    except errors.InputError as exc:
        return status.Failed(status.INVALID, "InvalidSource", str(exc), None), identity
    except errors.SourceError as exc:
        return status.Failed(status.DEGRADED, "SourceUnreachable", str(exc), False), identity
    except TimeoutError:
        message = f"resolving the manifest of {uri} took longer than {timeout:g} s"
        return status.Failed(status.DEGRADED, "ResolveTimeout", message, False), identity
    except Exception as exc:  # a bug or an unforeseen library error: report, retry, live on
        logger.exception("resolving %s failed unexpectedly", uri)
        message = f"unexpected error while resolving {uri}: {exc!r}"
        return status.Failed(status.DEGRADED, "ResolveFailed", message, None), identity
    if spec.source.version and manifest.digest != spec.source.version:
        message = (
            f"spec.source.version pins {spec.source.version}, but {uri} has manifest "
            f"{manifest.digest}: restore the pinned data or update spec.source.version"
        )
        return status.Failed(status.INVALID, "DigestMismatch", message, True), identity
    return (
        status.Resolved(
            digest=manifest.digest,
            format=manifest.format,
            shards=len(manifest.shards),
            rows=manifest.total_rows,
            bytes=manifest.total_bytes,
        ),
        identity,
    )


def _events(outcome: status.Outcome, previous: Mapping[str, Any]) -> tuple[Event, ...]:
    """One Event per change of phase or reason: retries of the same failure stay quiet."""
    before = {c.get("type"): c for c in previous.get("conditions") or []}
    old = before.get(status.MANIFEST_RESOLVED) or {}
    if isinstance(outcome, status.Resolved):
        if outcome.reused and previous.get("phase") == status.READY:
            return ()
        message = status.conditions_for(outcome)[1].message
        return (Event("Normal", "ManifestPinned", message),)
    if previous.get("phase") == outcome.phase and old.get("reason") == outcome.reason:
        return ()
    return (Event("Warning", outcome.reason, outcome.message),)


async def reconcile(
    obj: Mapping[str, Any],
    *,
    read_secret: SecretReader,
    resolve: Resolver,
    now: str,
    retry: int = 0,
    backoff: Backoff = Backoff(),
    timeout: float = 600.0,
) -> Result:
    """Resolve and pin the manifest of one DatasetMount object; never raises for its data."""
    outcome, identity = await _resolve(
        obj, read_secret=read_secret, resolve=resolve, timeout=timeout
    )
    previous = obj.get("status") or {}
    generation = (obj.get("metadata") or {}).get("generation")
    new_status = status.build_status(
        outcome,
        previous=previous,
        generation=generation if isinstance(generation, int) else None,
        now=now,
        resolved_source=identity,
    )
    retry_in: float | None = None
    if isinstance(outcome, status.Failed) and outcome.phase in (status.DEGRADED, status.PENDING):
        retry_in = backoff.delay(retry)
    return Result(outcome, new_status, _events(outcome, previous), retry_in)
