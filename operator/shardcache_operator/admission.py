"""Admission decisions for pods: which mounts to inject, or why the pod is refused.

Pure: the DatasetMounts come from a `lookup` callable, so the same code serves the
kopf webhook handler (`webhook.py`) and AdmissionReview tests without a cluster.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any

from shardcache import errors
from shardcache_operator import (
    authority,
    injection,
    job_pins,
    mount_parts,
    pod_updates,
    sample_room,
    specs,
    status,
    volume_room,
)

#: Returns the DatasetMount object (as the API serves it) or None when it does not exist.
Lookup = Callable[[str, str], Mapping[str, Any] | None]

REFUSE = "Refuse"
ADMIT = "Admit"


class LookupFailed(Exception):
    """The DatasetMount could not be read (the API failed); the pod is refused. Its text
    ends the refusal: what went wrong and what to do (`lookup_failures.explain`)."""


@dataclasses.dataclass(frozen=True)
class Decision:
    allowed: bool
    #: The pod after injection (equal to the input when nothing was injected).
    pod: dict[str, Any]
    #: RFC 6902 operations from the admitted pod to `pod`.
    patch: list[dict[str, Any]]
    #: Why the pod is refused (empty when allowed).
    message: str = ""
    warnings: tuple[str, ...] = ()
    injected: tuple[str, ...] = ()
    #: Warning Events to post on DatasetMounts: (mount name, reason, message).
    events: tuple[tuple[str, str, str], ...] = ()


#: The Event reason on a DatasetMount whose pod had no probe/metrics port left in range.
REASON_NO_METRICS_PORT = "NoMetricsPort"
#: The Event reason on a DatasetMount whose pod got its job's pin, not the mount's
#: current one (`job_pins`): a Normal Event, the promise kept.
REASON_JOB_PIN = "JobPinKept"
#: The Warning Event reason on a DatasetMount whose pod was refused because its job's
#: live pods were injected by a webhook from before job pins, before the mount's current
#: pin: what they read is not known (`job_pins.PinUnknown`).
REASON_JOB_PIN_UNKNOWN = "JobPinUnknown"
#: Event reasons posted as Normal; the others are Warnings.
NORMAL_REASONS = frozenset({REASON_JOB_PIN})


def no_port_reason(where: str, defaults: injection.SidecarDefaults) -> str:
    first, last = defaults.metrics_port, defaults.metrics_port_last
    return (
        f"{where}: no free port for its sidecar's probes and metrics in {first}-{last}, the "
        "range the chart's NetworkPolicy opens to Prometheus and the operator (chart value "
        "networkPolicy.metricsPorts): the pod's containers and its other mounts' sidecars "
        "use them all, and a sidecar outside it could never be scraped. Free a port in the "
        "range, or widen networkPolicy.metricsPorts"
    )


def _refusal(reason: str, name: str, deleting: bool) -> str:
    """What a pod refused for a mount not Ready can do. A mount being deleted is never
    Ready again (its finalizer only waits for its pods), so waiting for Ready would be
    endless: it is recreated once gone, or the pod goes without it."""
    if deleting:
        return (
            f"{reason}: it will not be Ready again; recreate it once `kubectl get dsm {name}` "
            f"finds none (it goes when its pods finish), or remove {name} from the pod's "
            f"{injection.LABEL_MOUNT} label to start the pod without the cache"
        )
    return (
        f"{reason}; wait until `kubectl get dsm {name}` shows Ready, "
        "or set spec.admission.policy: Admit to start pods without the cache"
    )


def _ready_message(obj: Mapping[str, Any]) -> str:
    for condition in (obj.get("status") or {}).get("conditions") or []:
        if condition.get("type") == status.READY_CONDITION and condition.get("message"):
            return str(condition["message"])
    return "the operator has not resolved its manifest yet"


def decide(
    pod: Mapping[str, Any],
    *,
    namespace: str,
    lookup: Lookup,
    defaults: injection.SidecarDefaults,
    namespace_uid: str | None = None,
    missing_policy: str = REFUSE,
    load: Callable[[Mapping[str, Any]], specs.DatasetMount] = specs.load,
    policy: authority.Policy = authority.DEFAULT,
    parts: mount_parts.Cache | None = None,
    siblings: Mapping[str, Mapping[str, frozenset[str]]] | None = None,
    unpinned: Mapping[str, Mapping[str, str | None]] | None = None,
) -> Decision:
    """Inject the mounts the pod asks for, or refuse it naming the mount and the reason.

    `missing_policy` applies to DatasetMounts that do not exist; for existing ones
    that are not Ready, their own spec.admission.policy decides. A DatasetMount that
    asks for more than the platform's `policy` allows is refused whatever its state.
    `load` parses a mount object (the webhook's caches parsed specs per generation);
    `parts` keeps each mount's built volumes and sidecar for the next pod.
    `siblings`: for a pod of a job (`job_pins.job_of`), mount -> pin text -> the job's
    live pods given it (`job_pins.Siblings`); such a pod gets its job's pin.
    `unpinned`: mount -> the job's live pods injected without a pin -> creationTimestamp.
    `namespace_uid`: the namespace's UID, which keys its node disk directory
    (`injection.Mount.namespace_uid`; the webhook reads it, `namespace_uids`).
    """
    unchanged = dict(pod)
    metadata = pod.get("metadata") or {}
    try:
        wanted = injection.requested_mounts(metadata)
    except errors.InputError as exc:
        return Decision(False, unchanged, [], message=str(exc))
    already = set(injection.injected_mounts(pod))
    job = job_pins.job_of(metadata)
    mounts: list[injection.Mount] = []
    warnings: list[str] = []
    events: list[tuple[str, str, str]] = []
    for name in wanted:
        if name in already:
            continue
        where = f"DatasetMount {namespace}/{name}"
        try:
            obj = lookup(namespace, name)
        except LookupFailed as exc:
            # The reason says what to do: retrying does not help a missing permission.
            return Decision(False, unchanged, [], message=f"{where} could not be read: {exc}")
        if obj is None:
            reason = f"{where} does not exist: create it, or remove {name} from the pod's "
            reason += f"{injection.LABEL_MOUNT} label"
            if missing_policy == REFUSE:
                return Decision(False, unchanged, [], message=reason)
            warnings.append(f"{reason}; admitted without the cache for {name}")
            continue
        try:
            mount = load(obj)
        except errors.InputError as exc:
            return Decision(False, unchanged, [], message=f"{where} is invalid: {exc}")
        refused = authority.violations(mount.spec, policy, default_image=defaults.image)
        if refused:
            return Decision(False, unchanged, [], message=f"{where}: {'; '.join(refused)}")
        generation = (obj.get("metadata") or {}).get("generation")
        observed = (obj.get("status") or {}).get("observedGeneration")
        deleting = bool((obj.get("metadata") or {}).get("deletionTimestamp"))
        if deleting:
            reason = f"{where} is being deleted"
        elif (
            mount.phase == status.Phase.READY and generation is not None and observed != generation
        ):
            # The spec changed and the operator has not caught up: the pinned digest may
            # belong to the old source.
            reason = f"{where} is not Ready (generation {generation} is not reconciled yet)"
        elif mount.phase != status.Phase.READY:
            reason = (
                f"{where} is not Ready (phase {mount.phase or 'unknown'}: {_ready_message(obj)})"
            )
        else:
            reason = ""
        if reason:
            if mount.spec.admission.policy == REFUSE:
                return Decision(False, unchanged, [], message=_refusal(reason, name, deleting))
            warnings.append(f"{reason}; admitted without the cache for {name}")
            continue
        pinned = obj.get("status") or {}
        tight = sample_room.warning(where, mount.spec, pinned, pod)
        if tight:
            warnings.append(tight)
        crowded = volume_room.warning(where, mount.spec, pinned, pod)
        if crowded:
            warnings.append(crowded)
        chosen = injection.Mount(
            name=name,
            spec=mount.spec,
            digest=mount.manifest_digest,
            namespace=namespace,
            namespace_uid=namespace_uid,
            source_digests=mount.source_digests,
        )
        if job is not None:
            try:
                chosen, moved = _job_pinned(
                    chosen,
                    where,
                    job,
                    metadata,
                    (siblings or {}).get(name) or {},
                    job_pins.unpinned(
                        (unpinned or {}).get(name) or {}, status.resolved_at(obj.get("status"))
                    ),
                )
            except job_pins.PinUnknown as exc:
                events.append((name, REASON_JOB_PIN_UNKNOWN, str(exc)))
                return Decision(False, unchanged, [], message=str(exc), events=tuple(events))
            except errors.InputError as exc:
                return Decision(False, unchanged, [], message=str(exc), events=tuple(events))
            if moved:
                warnings.append(moved)
                events.append((name, REASON_JOB_PIN, moved))
        mounts.append(chosen)
    room = injection.metrics_ports_free(pod, defaults) if mounts else 0
    for left in mounts[room:]:
        reason = no_port_reason(f"DatasetMount {namespace}/{left.name}", defaults)
        # As for a mount that is not Ready: its own admission policy decides whether
        # the pod waits (refused, the controller retries) or starts without the cache.
        if left.spec.admission.policy == REFUSE:
            message = (
                f"{reason}; or set spec.admission.policy: Admit to start pods without the cache"
            )
            events.append((left.name, REASON_NO_METRICS_PORT, message))
            return Decision(False, unchanged, [], message=message, events=tuple(events))
        message = f"{reason}; admitted without the cache for {left.name}"
        warnings.append(message)
        events.append((left.name, REASON_NO_METRICS_PORT, message))
    mounts = mounts[:room]
    if not mounts:
        # Admitted without the cache, but never with a pin of the author's own: the pod
        # watch would serve it to the job's later pods.
        kept = injection.without_unearned_pins(pod)
        if kept is None:
            return Decision(True, unchanged, [], warnings=tuple(warnings), events=tuple(events))
        return Decision(
            True,
            kept,
            injection.json_patch(pod, kept),
            warnings=tuple(warnings),
            events=tuple(events),
        )
    try:
        injected = injection.inject(pod, mounts, defaults=defaults, cache=parts)
    except errors.InputError as exc:
        names = ", ".join(m.name for m in mounts)
        return Decision(False, unchanged, [], message=f"cannot inject DatasetMount {names}: {exc}")
    return Decision(
        True,
        injected,
        injection.json_patch(pod, injected),
        warnings=tuple(warnings),
        injected=tuple(m.name for m in mounts),
        events=tuple(events),
    )


def _job_pinned(
    mount: injection.Mount,
    where: str,
    job: job_pins.Job,
    metadata: Mapping[str, Any],
    siblings: Mapping[str, frozenset[str]],
    unpinned: job_pins.Unpinned,
) -> tuple[injection.Mount, str]:
    """`mount` as the pod of `job` gets it: with its job's pin where that is not the
    mount's current one, and then the message saying so (else ""). InputError: refused."""
    current = job_pins.pin_of(mount.spec, mount.digest, mount.source_digests)
    pod = str(metadata.get("name") or f"{metadata.get('generateName') or ''}*")
    served = job_pins.serve(
        where, pod=pod, job=job, current=current, siblings=siblings, unpinned=unpinned
    )
    if served.pin is None:
        return mount, ""
    further = served.pin.sources[1:]
    chosen = dataclasses.replace(
        mount,
        spec=job_pins.apply(mount.spec, served.pin, where),
        digest=served.pin.digest,
        source_digests={s.name: s.digest for s in further if s.name and s.digest},
        current_pins=False,
    )
    return chosen, served.message


def decide_update(old: Mapping[str, Any], new: Mapping[str, Any]) -> Decision:
    """An UPDATE of a pod (or of its `ephemeralcontainers`): admitted as sent, or refused
    when it would reach what only the injected sidecar holds (`pod_updates`). Never a
    patch and never a DatasetMount read: the injection happened at CREATE."""
    message = pod_updates.refusal(old, new)
    return Decision(message is None, dict(new), [], message=message or "")


def review(
    request: Mapping[str, Any],
    *,
    lookup: Lookup,
    defaults: injection.SidecarDefaults,
    missing_policy: str = REFUSE,
    policy: authority.Policy = authority.DEFAULT,
    namespace_uid: str | None = None,
) -> dict[str, Any]:
    """An AdmissionReview v1 response to an AdmissionReview v1 request for a pod: its
    CREATE (injection) or an UPDATE (`decide_update`)."""
    if is_update(request):
        return respond(request, decide_update(old_pod_of(request), pod_of(request)))
    decision = admit(
        pod_of(request),
        namespace=namespace_of(request),
        namespace_uid=namespace_uid,
        lookup=lookup,
        defaults=defaults,
        missing_policy=missing_policy,
        policy=policy,
    )
    return respond(request, decision)


def admit(pod: Mapping[str, Any], *, namespace: str, **options: Any) -> Decision:
    """`decide`, except that a pod the API server would not have stored (a field of
    the wrong type) is refused with a message naming it, never an exception that
    would answer 500 (tests/unit/test_fuzz_admission.py)."""
    try:
        return decide(pod, namespace=namespace, **options)
    except errors.InputError as exc:
        return Decision(False, dict(pod), [], message=f"the pod cannot be admitted: {exc}")


def pod_of(request: Mapping[str, Any]) -> dict[str, Any]:
    return dict((request.get("request") or {}).get("object") or {})


def old_pod_of(request: Mapping[str, Any]) -> dict[str, Any]:
    """The pod before an UPDATE (empty for a CREATE)."""
    return dict((request.get("request") or {}).get("oldObject") or {})


def is_update(request: Mapping[str, Any]) -> bool:
    """Whether the review is of an UPDATE: of the pod, or of a subresource such as its
    ephemeral containers (the webhook sees no other subresource)."""
    return (request.get("request") or {}).get("operation") == "UPDATE"


def namespace_of(request: Mapping[str, Any]) -> str:
    """The pod's namespace: the request's (pods created with generateName have none)."""
    body = request.get("request") or {}
    metadata = (body.get("object") or {}).get("metadata") or {}
    return str(body.get("namespace") or metadata.get("namespace") or "")


def respond(request: Mapping[str, Any], decision: Decision) -> dict[str, Any]:
    """The AdmissionReview v1 response carrying `decision` (its JSON patch as is)."""
    body = request.get("request") or {}
    response: dict[str, Any] = {"uid": body.get("uid", ""), "allowed": decision.allowed}
    if decision.warnings:
        response["warnings"] = list(decision.warnings)
    if not decision.allowed:
        response["status"] = {"code": 403, "message": decision.message}
    elif decision.patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(decision.patch).encode()).decode()
    return {
        "apiVersion": request.get("apiVersion", "admission.k8s.io/v1"),
        "kind": "AdmissionReview",
        "response": response,
    }
