"""DatasetMount status: pure builders of the status dict, and its schema.

The reconcile core (`reconcile.py`) decides an `Outcome`; `build_status` turns it into
the status subresource: phase, the conditions (SourceReachable, ManifestResolved,
Ready, ShardTooLargeToDecode, each with reason and message; DataStarved comes from
`starvation`, SidecarsHealthy from `sidecar_health`), the pinned digest and counts. Conditions keep
their `lastTransitionTime` while their status does not change, so re-reconciling an
unchanged object produces an identical status.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from typing import Any

from shardcache_operator import rfc3339, shard_room, specs


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
#: The pinned shards against the sidecar's decode room (`decode_room_condition`): True
#: when one is known too large, like the Event of the same name, but lasting.
SHARD_TOO_LARGE_TO_DECODE = shard_room.REASON
CONDITION_TYPES = (
    SOURCE_REACHABLE,
    MANIFEST_RESOLVED,
    READY_CONDITION,
    DATA_STARVED,
    SIDECARS_HEALTHY,
    SHARD_TOO_LARGE_TO_DECODE,
)
#: Conditions other checks than the reconcile own: a reconcile's status keeps them.
KEPT_BY_RECONCILE = (DATA_STARVED, SIDECARS_HEALTHY)


@dataclasses.dataclass(frozen=True)
class Condition:
    type: str
    status: str  # "True" | "False" | "Unknown", as Kubernetes spells them
    reason: str  # CamelCase, machine-readable
    message: str  # for humans: what happened and what to do


#: A manifest's gzipped JSON in the parts handed to the sidecars (`manifest_handoff`);
#: named here because `Resolved.bytes` hides the builtin inside the class.
HandedParts = tuple[bytes, ...]


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
    #: The manifest's gzipped JSON in the parts handed to the sidecars
    #: (`manifest_handoff`), where it was just listed and small enough; never stored.
    handed: HandedParts = dataclasses.field(default=(), repr=False, compare=False)


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
    #: Seconds before which a retry cannot do better (the store is left alone until
    #: then: `quiet_stores`), or None.
    retry_after: float | None = None


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


#: status.largestShard: the pinned manifest's largest shard (`shard_room.Largest`).
LARGEST_SHARD = "largestShard"


def _pins(pinned: Mapping[str, Any]) -> list[tuple[str, str, object]]:
    """(spec fields, format, stored largestShard) of each source pinned in `pinned`
    (a status): spec.source, then status.mixture's entries in the spec's order."""
    found: list[tuple[str, str, object]] = [
        ("spec.source", str(pinned.get("format")), pinned.get(LARGEST_SHARD))
    ]
    for index, entry in enumerate(pinned.get("mixture") or []):
        if isinstance(entry, Mapping):
            where = f"spec.mixture.sources[{index}] ({entry.get('name')})"
            found.append((where, str(entry.get("format")), entry.get(LARGEST_SHARD)))
    return found


def _unrecorded_text(unrecorded: Sequence[str]) -> str:
    """What decode_room_condition says of the sources (spec fields) whose pin recorded
    no largest shard."""
    if len(unrecorded) == 1:
        return (
            f"the pin of {unrecorded[0]} has no status.{LARGEST_SHARD} (pinned by an older "
            "operator; a kept pin is not listed again), so its shards were not judged: they "
            "are once the source is pinned again (a new uri, format or version)"
        )
    return (
        f"the pins of {', '.join(unrecorded)} have no status.{LARGEST_SHARD} (pinned by an "
        "older operator; a kept pin is not listed again), so their shards were not judged: "
        "each source's are once it is pinned again (a new uri, format or version)"
    )


@dataclasses.dataclass(frozen=True)
class _Judged:
    """The pins of a status against a decode room (`_judge`), each named by its spec
    fields (`_pins`)."""

    #: (spec fields, "spec fields: what to do") of each source over the room.
    over: list[tuple[str, str]]
    #: Sources of a judged format whose pin recorded no largest shard.
    unrecorded: list[str]
    within: list[str]
    #: Sources of a format not judged, with it.
    unjudged: list[str]


def _judge(space: shard_room.Room, pinned: Mapping[str, Any]) -> _Judged:
    found = _Judged([], [], [], [])
    for where, fmt, stored in _pins(pinned):
        if not shard_room.judged(fmt):
            found.unjudged.append(f"{where} ({fmt})")
            continue
        shard = shard_room.read_recorded(stored)
        if shard is None:
            found.unrecorded.append(where)
        elif shard_room.over(shard, space):
            found.over.append((where, f"{where}: {shard_room.refusal_text(fmt, shard, space)}"))
        else:
            spare = specs.format_bytes(space.bytes - shard.bytes)
            found.within.append(
                f"{where}: {shard.path!r} {specs.format_bytes(shard.bytes)} ({spare} to spare)"
            )
    return found


def _over_text(text: str, judged: _Judged) -> str:
    """`text` (a source over the room), then the sources not judged: raising the limit
    for those named may still leave one of them over it."""
    return "; ".join([text, _unrecorded_text(judged.unrecorded)] if judged.unrecorded else [text])


def decode_room_warnings(
    spec: specs.DatasetMountSpec, pinned: Mapping[str, Any]
) -> list[tuple[str, str]]:
    """(spec fields, Event message) of each source pinned in `pinned` whose largest
    shard is over the sidecar's decode room, as the True condition says it
    (`decode_room_condition`): one message a source, which keeps each under the 1024
    characters kopf cuts an Event's message to in its middle (a source's is about 550)."""
    space = shard_room.room(spec)
    if space is None:
        return []
    judged = _judge(space, pinned)
    return [(where, _over_text(text, judged)) for where, text in judged.over]


def decode_room_condition(spec: specs.DatasetMountSpec, pinned: Mapping[str, Any]) -> Condition:
    """ShardTooLargeToDecode for the sources pinned in `pinned` (a status with a
    manifestDigest) and the sidecar `spec` gives (`shard_room`).

    True/OverDecodeRoom naming each source whose largest shard is over the room, by how
    much and the limit to set, then any whose pin recorded no largest shard (not
    judged); otherwise False/WithinDecodeRoom, False/NoMemoryLimit, or
    False/DecodedSizeNotBounded when no source is of a format judged (JSON Lines);
    Unknown/ShardSizesNotRecorded for a judged format whose pin recorded no largest
    shard (made by an operator before status.largestShard: a kept pin is not listed
    again). Judged on stored sizes, so False says no shard is known too large, not that
    each fits once decoded: only the sidecar reads decoded sizes.
    """
    space = shard_room.room(spec)
    if space is None:
        return Condition(
            SHARD_TOO_LARGE_TO_DECODE,
            "False",
            "NoMemoryLimit",
            f"{shard_room.LIMIT_FIELD} is not set: the sidecar decodes a shard of any size",
        )
    judged = _judge(space, pinned)
    if judged.over:
        message = _over_text("; ".join(text for _, text in judged.over), judged)
        return Condition(SHARD_TOO_LARGE_TO_DECODE, "True", "OverDecodeRoom", message)
    if judged.unrecorded:
        return Condition(
            SHARD_TOO_LARGE_TO_DECODE,
            "Unknown",
            "ShardSizesNotRecorded",
            _unrecorded_text(judged.unrecorded),
        )
    parts = []
    if judged.within:
        parts.append(
            f"the largest shard of each source is within the {specs.format_bytes(space.bytes)} "
            f"the sidecar can decode a shard in ({shard_room.LIMIT_FIELD} {space.given} less "
            f"the sidecar process's base): {'; '.join(judged.within)}. Judged on stored "
            "sizes: a compressed shard may still decode larger, which only the sidecar reads"
        )
    if judged.unjudged:
        parts.append(
            f"not judged: {', '.join(judged.unjudged)}, whose decoded size its stored size "
            "does not bound"
        )
    reason = "WithinDecodeRoom" if judged.within else "DecodedSizeNotBounded"
    return Condition(SHARD_TOO_LARGE_TO_DECODE, "False", reason, "; ".join(parts))


def _largest_recorded(outcome: Outcome, previous: Mapping[str, Any]) -> dict[str, Any] | None:
    """status.largestShard for `outcome`: the manifest's just listed, the stored one for
    a kept pin or a failure (which keeps the pin: the same digest, so the same shards);
    None (deleted by the merge patch) when there is none or the stored one is not
    readable, which is not copied forward."""
    if isinstance(outcome, Resolved) and not outcome.reused:
        return None if outcome.largest is None else outcome.largest.recorded()
    kept = shard_room.read_recorded(previous.get(LARGEST_SHARD))
    return None if kept is None else kept.recorded()


def _kept_resolved_at(previous: Mapping[str, Any]) -> str | None:
    """The stored status.resolvedAt (`resolved_at`) when `rfc3339.parse` reads it; None
    when it is missing or not such a time, which is never copied forward: job pins read
    it to tell which pods were given the current pin."""
    found = resolved_at(previous)
    return found if rfc3339.parse(found) is not None else None


def build_status(
    outcome: Outcome,
    *,
    previous: Mapping[str, Any],
    generation: int | None,
    now: str,
    resolved_source: Mapping[str, Any] | None,
    mixture: Sequence[Mapping[str, Any]] | None = None,
    spec: specs.DatasetMountSpec | None = None,
) -> dict[str, Any]:
    """The full status dict for `outcome`.

    A failure keeps the previously pinned digest and counts: pods already running
    keep reading the dataset they started with, and the digest stays visible.
    `mixture`: the pins of a mixture's further sources (status.mixture), written with
    a resolved outcome; a failure keeps the previous ones. A resolved outcome without
    them (a mount with no mixture) sets a stored `mixture` to None, which deletes it:
    handlers write status as a merge patch, which keeps every key it leaves out.
    `spec`: the parsed spec, which ShardTooLargeToDecode is judged against
    (`decode_room_condition`) whenever the status holds a pin, the kept pin of a failure
    too (a raised limit clears it); without it (an invalid spec, a refusal, the periodic
    source check) the stored condition is kept as it is.
    status.resolvedAt moves only when a manifest is listed; a stored one that
    `rfc3339.parse` cannot read is not kept (`_kept_resolved_at`): a kept pin writes
    the time of this reconcile instead (job pins then call the pods created before it
    unknown, the safe side), a failure deletes it.
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
    status: dict[str, Any] = {
        # The plain string: the status dict is serialized as JSON and YAML alike.
        "phase": phase_of(outcome).value,
        "observedGeneration": generation,
    }
    kept_at = _kept_resolved_at(previous)
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
        status["resolvedAt"] = kept_at if outcome.reused and kept_at is not None else now
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
            status["resolvedAt"] = kept_at
    largest = _largest_recorded(outcome, previous)
    if largest is not None or LARGEST_SHARD in previous:
        status[LARGEST_SHARD] = largest
    kept_types = set(KEPT_BY_RECONCILE)
    if spec is not None and status.get("manifestDigest"):
        current.append(decode_room_condition(spec, status))
    else:
        kept_types.add(SHARD_TOO_LARGE_TO_DECODE)
    conditions = merge_conditions(
        previous.get("conditions") or [], current, now=now, generation=generation
    )
    conditions += [
        dict(c)
        for c in previous.get("conditions") or []
        if isinstance(c, Mapping) and c.get("type") in kept_types
    ]
    status["conditions"] = conditions
    if "attachedPods" in previous:
        status["attachedPods"] = previous["attachedPods"]
    return status


def conditions_by_type(status: Mapping[str, Any] | None) -> dict[str, Mapping[str, Any]]:
    """The conditions of `status`, by type."""
    return {c.get("type"): c for c in (status or {}).get("conditions") or []}


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
    largest = {
        "type": "object",
        "description": "The pinned manifest's largest shard at the source, which "
        "ShardTooLargeToDecode judges against the sidecar's memory limit.",
        "properties": {
            "path": _prop("string", "The shard's path in the manifest."),
            "bytes": _prop("integer", "Its size at the source.", format="int64"),
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
                "OOMKilled or crash-looped, ShardTooLargeToDecode once a pin was judged "
                "against the sidecar's memory limit). Ready is False with reason Terminating "
                "while the mount is being deleted.",
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
            LARGEST_SHARD: largest,
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
                        LARGEST_SHARD: {
                            **largest,
                            "description": "The source's largest shard at the source.",
                        },
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
