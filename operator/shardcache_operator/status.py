"""DatasetMount status: pure builders of the status dict, and its schema.

The reconcile core (`reconcile.py`) decides an `Outcome`; `build_status` turns it into
the status subresource: phase, the conditions (SourceReachable, ManifestResolved,
Ready, each with reason and message; DataStarved comes from `starvation`), the pinned digest and counts. Conditions keep
their `lastTransitionTime` while their status does not change, so re-reconciling an
unchanged object produces an identical status.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from typing import Any

from shardcache_operator import shard_room, specs


class Phase(enum.StrEnum):
    """status.phase, in the order a DatasetMount usually passes through them.

    The values are the wire format (status and the CRD's Phase printer column); a
    member compares equal to its value, so phases read back from the API compare
    without conversion.
    """

    PENDING = "Pending"  # not resolved yet, or waiting for its Secret
    READY = "Ready"  # manifest resolved and digest pinned: pods are admitted
    DEGRADED = "Degraded"  # the source failed; retried with backoff
    INVALID = "Invalid"  # the spec is wrong, or names a source not read: fix it
    TERMINATING = "Terminating"  # deleted, waiting for attached pods to finish


SOURCE_REACHABLE = "SourceReachable"
MANIFEST_RESOLVED = "ManifestResolved"
READY_CONDITION = "Ready"
#: Set by the stall check (`starvation`), never by a reconcile, which keeps it as it is.
DATA_STARVED = "DataStarved"
#: Set by the sidecar check (`sidecar_health`), never by a reconcile, which keeps it.
SIDECARS_HEALTHY = "SidecarsHealthy"
CONDITION_TYPES = (
    SOURCE_REACHABLE,
    MANIFEST_RESOLVED,
    READY_CONDITION,
    DATA_STARVED,
    SIDECARS_HEALTHY,
)
#: Conditions other checks than the reconcile own: a reconcile's status keeps them.
KEPT_BY_RECONCILE = (DATA_STARVED, SIDECARS_HEALTHY)


@dataclasses.dataclass(frozen=True)
class Condition:
    type: str
    status: str  # "True" | "False" | "Unknown", as Kubernetes spells them
    reason: str  # CamelCase, machine-readable
    message: str  # for humans: what happened and what to do


@dataclasses.dataclass(frozen=True)
class Resolved:
    """The source was listed and its manifest pinned."""

    digest: str
    format: str
    shards: int
    rows: int
    bytes: int
    #: True when the digest was already pinned and the source was not listed again.
    reused: bool = False
    #: The manifest's largest shard, where it was just listed (not stored: a reused pin
    #: does not know it).
    largest: shard_room.Largest | None = None


@dataclasses.dataclass(frozen=True)
class Failed:
    """Reconciling stopped short of a pinned manifest."""

    phase: Phase  # PENDING, DEGRADED or INVALID
    reason: str
    message: str
    # The flags are keyword-only: bare True/False at a call site would not say which.
    _: dataclasses.KW_ONLY
    #: Whether the source answered (False for network/auth failures, None if not tried).
    reachable: bool | None
    #: The pinned manifest stays valid (a later reachability check failed, not the
    #: resolution): ManifestResolved keeps its previous state.
    keeps_pin: bool = False


Outcome = Resolved | Failed


def phase_of(outcome: Outcome) -> Phase:
    return Phase.READY if isinstance(outcome, Resolved) else outcome.phase


def conditions_for(outcome: Outcome) -> list[Condition]:
    """The three conditions that describe `outcome`."""
    if isinstance(outcome, Resolved):
        how = "kept the pinned" if outcome.reused else "resolved"
        message = (
            f"{how} manifest {outcome.digest}: {outcome.shards} {outcome.format} shards, "
            f"{outcome.rows} rows, {specs.format_bytes(outcome.bytes)}"
        )
        return [
            Condition(SOURCE_REACHABLE, "True", "Listed", "the source answered"),
            Condition(MANIFEST_RESOLVED, "True", "Pinned", message),
            Condition(READY_CONDITION, "True", "ManifestPinned", "pods using it are admitted"),
        ]
    reachable = {True: "True", False: "False", None: "Unknown"}[outcome.reachable]
    source_reason = "Listed" if outcome.reachable else outcome.reason
    source_message = "the source answered" if outcome.reachable else outcome.message
    return [
        Condition(SOURCE_REACHABLE, reachable, source_reason, source_message),
        Condition(MANIFEST_RESOLVED, "False", outcome.reason, outcome.message),
        Condition(READY_CONDITION, "False", outcome.reason, outcome.message),
    ]


def merge_conditions(
    previous: Sequence[Mapping[str, Any]],
    current: Sequence[Condition],
    *,
    now: str,
    generation: int | None,
) -> list[dict[str, Any]]:
    """Conditions as stored: lastTransitionTime moves only when the status changes."""
    before = {c.get("type"): c for c in previous if isinstance(c, Mapping)}
    merged: list[dict[str, Any]] = []
    for condition in current:
        old = before.get(condition.type)
        changed = old is None or old.get("status") != condition.status
        since = now if changed or old is None else old.get("lastTransitionTime", now)
        entry: dict[str, Any] = {
            "type": condition.type,
            "status": condition.status,
            "reason": condition.reason,
            "message": condition.message,
            "lastTransitionTime": since,
        }
        if generation is not None:
            entry["observedGeneration"] = generation
        merged.append(entry)
    return merged


def with_condition(
    previous: Sequence[Mapping[str, Any]], condition: Condition, *, now: str
) -> list[dict[str, Any]]:
    """status.conditions with `condition` in place of its type's entry (appended where
    there is none), the others as they are: status is written as a merge patch, which
    replaces a list whole."""
    kept = [dict(c) for c in previous if isinstance(c, Mapping)]
    old = next((c for c in kept if c.get("type") == condition.type), None)
    (merged,) = merge_conditions([old] if old else [], [condition], now=now, generation=None)
    if old is not None and "observedGeneration" in old:
        # The generation the condition was computed for has not moved with a deletion.
        merged["observedGeneration"] = old["observedGeneration"]
    if old is None:
        return [*kept, merged]
    return [merged if c is old else c for c in kept]


def terminating_condition(pods: int, *, force_hint: str) -> Condition:
    """Ready while the mount waits for its pods to finish before it goes: no new pod is
    admitted, so Ready=True ("pods using it are admitted") would be wrong, and `kubectl
    wait --for=condition=Ready` would pass on a mount on its way out."""
    return Condition(
        READY_CONDITION,
        "False",
        "Terminating",
        f"being deleted: waiting for {pods} pod(s) using it to finish; new pods are "
        f"refused (recreate the DatasetMount once it is gone); {force_hint}",
    )


def build_status(
    outcome: Outcome,
    *,
    previous: Mapping[str, Any],
    generation: int | None,
    now: str,
    resolved_source: Mapping[str, Any] | None,
    mixture: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The full status dict for `outcome`.

    A failure keeps the previously pinned digest and counts: pods already running
    keep reading the dataset they started with, and the digest stays visible.
    `mixture`: the pins of a mixture's further sources (status.mixture), written with
    a resolved outcome; a failure keeps the previous ones. A resolved outcome without
    them (a mount with no mixture) sets a stored `mixture` to None, which deletes it:
    handlers write status as a merge patch, which keeps every key it leaves out.
    """
    current = conditions_for(outcome)
    if isinstance(outcome, Failed) and outcome.keeps_pin:
        for index, condition in enumerate(current):
            old = next(
                (
                    c
                    for c in previous.get("conditions") or []
                    if c.get("type") == condition.type == MANIFEST_RESOLVED
                ),
                None,
            )
            if old is not None:
                current[index] = Condition(
                    MANIFEST_RESOLVED,
                    str(old.get("status")),
                    str(old.get("reason")),
                    str(old.get("message")),
                )
    conditions = merge_conditions(
        previous.get("conditions") or [], current, now=now, generation=generation
    )
    conditions += [
        dict(c)
        for c in previous.get("conditions") or []
        if isinstance(c, Mapping) and c.get("type") in KEPT_BY_RECONCILE
    ]
    status: dict[str, Any] = {
        # The plain string: the status dict is serialized as JSON and YAML alike.
        "phase": phase_of(outcome).value,
        "conditions": conditions,
        "observedGeneration": generation,
    }
    if isinstance(outcome, Resolved):
        status.update(
            manifestDigest=outcome.digest,
            format=outcome.format,
            shards=outcome.shards,
            rows=outcome.rows,
            bytes=outcome.bytes,
            size=specs.format_bytes(outcome.bytes),
            resolvedSource=dict(resolved_source or {}),
        )
        if not outcome.reused or "resolvedAt" not in previous:
            status["resolvedAt"] = now
        else:
            status["resolvedAt"] = previous["resolvedAt"]
        if mixture is not None:
            status["mixture"] = [dict(entry) for entry in mixture]
        elif "mixture" in previous:
            status["mixture"] = None
    else:
        for key in ("manifestDigest", "format", "shards", "rows", "bytes", "size", "mixture"):
            if key in previous:
                status[key] = previous[key]
        if "resolvedSource" in previous:
            status["resolvedSource"] = previous["resolvedSource"]
        if "resolvedAt" in previous:
            status["resolvedAt"] = previous["resolvedAt"]
    if "attachedPods" in previous:
        status["attachedPods"] = previous["attachedPods"]
    return status


def has_condition(status: Mapping[str, Any] | None, type_: str, value: str) -> bool:
    """Whether `status` has the condition `type_` with status `value` ("True"/"False")."""
    conditions = (status or {}).get("conditions") or []
    return any(c.get("type") == type_ and c.get("status") == value for c in conditions)


def resolved_at(status: object) -> str | None:
    """status.resolvedAt: when the mount's current pin was resolved (RFC 3339, as
    `build_status` writes it); None when `status` has none or is not a mapping."""
    found = status.get("resolvedAt") if isinstance(status, Mapping) else None
    return found if isinstance(found, str) else None


def is_ready(status: Mapping[str, Any] | None) -> bool:
    return bool(status) and status is not None and status.get("phase") == Phase.READY


def _prop(kind: str, description: str, **extra: Any) -> dict[str, Any]:
    return {"type": kind, "description": description, **extra}


def schema() -> dict[str, Any]:
    """OpenAPI schema of the status subresource (used by `crd.build`)."""
    condition = {
        "type": "object",
        "description": "One aspect of the DatasetMount's state.",
        "required": ["type", "status"],
        "properties": {
            "type": _prop(
                "string",
                f"{', '.join(CONDITION_TYPES[:-1])} or {CONDITION_TYPES[-1]}.",
                enum=list(CONDITION_TYPES),
            ),
            "status": _prop("string", "True, False or Unknown.", enum=["True", "False", "Unknown"]),
            "reason": _prop("string", "Machine-readable CamelCase reason of the last change."),
            "message": _prop("string", "What happened, and what to do about it."),
            "lastTransitionTime": _prop(
                "string", "When the status last changed.", format="date-time"
            ),
            "observedGeneration": _prop(
                "integer", "metadata.generation this condition was computed for.", format="int64"
            ),
        },
    }
    source = {
        "type": "object",
        "description": "The spec.source fields the pinned digest was resolved from; a change "
        "of any of them resolves the manifest again.",
        "properties": {
            "uri": _prop("string", "spec.source.uri at resolution."),
            "format": _prop("string", "spec.source.format at resolution."),
            "version": _prop("string", "spec.source.version at resolution, if set."),
            "manifestVersion": _prop(
                "string",
                "The manifest format version of the pin (shardcache.manifests); a pin of "
                "another version is resolved again.",
            ),
        },
    }
    return {
        "type": "object",
        "description": "Observed state, written by the operator.",
        "properties": {
            "phase": _prop(
                "string",
                "Pending (not resolved yet, or waiting for its Secret or for credentials "
                "the store accepts), Ready (digest pinned, pods admitted), Degraded (source "
                "failing or its data not what was pinned, retried with backoff), Invalid "
                "(fix the spec: the operator will not read its source), Terminating "
                "(deleted, pods still attached).",
                enum=[phase.value for phase in Phase],
            ),
            "conditions": {
                "type": "array",
                # Named from CONDITION_TYPES: the description once left out DataStarved.
                "description": f"{', '.join(CONDITION_TYPES[:-1])} and {CONDITION_TYPES[-1]}, "
                "each with a reason and a message (DataStarved only once the stall checks "
                "judged the mount's pods, SidecarsHealthy only once an injected sidecar was "
                "OOMKilled or crash-looped). Ready is False with reason Terminating while the "
                "mount is being deleted.",
                "items": condition,
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
            },
            "manifestDigest": _prop(
                "string",
                "sha256 digest of the pinned manifest; every pod reads exactly this dataset.",
            ),
            "format": _prop("string", "Shard format of the pinned manifest."),
            "shards": _prop("integer", "Number of shards in the pinned manifest.", format="int64"),
            "rows": _prop("integer", "Rows in the pinned manifest.", format="int64"),
            "bytes": _prop("integer", "Bytes of all shards at the source.", format="int64"),
            "size": _prop("string", "bytes in binary units (for kubectl get)."),
            "attachedPods": _prop(
                "integer",
                "Pods labelled with this mount that have not finished.",
                format="int64",
            ),
            "observedGeneration": _prop(
                "integer", "metadata.generation the status was computed for.", format="int64"
            ),
            "resolvedAt": _prop(
                "string", "When the manifest was last resolved.", format="date-time"
            ),
            "resolvedSource": source,
            "mixture": {
                "type": "array",
                "description": "The pinned manifest of each of spec.mixture.sources; the "
                "mount is Ready only when every source is pinned.",
                "items": {
                    "type": "object",
                    "description": "One further source's pin.",
                    "properties": {
                        "name": _prop("string", "The source's name in spec.mixture.sources."),
                        "manifestDigest": _prop(
                            "string", "sha256 digest of the source's pinned manifest."
                        ),
                        "format": _prop("string", "Shard format of the source."),
                        "shards": _prop("integer", "Shards of the source.", format="int64"),
                        "rows": _prop("integer", "Rows of the source.", format="int64"),
                        "bytes": _prop("integer", "Bytes of the source.", format="int64"),
                        "resolvedSource": {
                            "type": "object",
                            "description": "The source's uri, format and version at "
                            "resolution; a change resolves it again.",
                            "properties": {
                                "uri": _prop("string", "The source's uri."),
                                "format": _prop("string", "The source's format."),
                                "version": _prop("string", "The source's version, if set."),
                            },
                        },
                    },
                },
            },
            "lastSkip": {
                "type": "object",
                "description": "The newest skip the sidecars applied when they restored a "
                "checkpoint (`shardcache skip`; docs/debugging.md).",
                "properties": {
                    "step": _prop("integer", "The checkpoint restored.", format="int64"),
                    "batches": _prop("integer", "Batches skipped after it.", format="int64"),
                    "reason": _prop("string", "The note given with the request."),
                    "requestedAt": _prop(
                        "string", "When the skip was requested.", format="date-time"
                    ),
                    "appliedAt": _prop(
                        "string", "When a sidecar last applied it.", format="date-time"
                    ),
                    "ranges": {
                        "type": "array",
                        "description": "The positions each rank skipped.",
                        "items": {
                            "type": "object",
                            "description": "One rank's skipped range of an epoch.",
                            "properties": {
                                "rank": _prop("integer", "The rank.", format="int64"),
                                "epoch": _prop("integer", "The epoch.", format="int64"),
                                "start": _prop(
                                    "integer", "First position skipped.", format="int64"
                                ),
                                "stop": _prop(
                                    "integer",
                                    "Position after the last one skipped.",
                                    format="int64",
                                ),
                            },
                        },
                    },
                },
            },
        },
    }
