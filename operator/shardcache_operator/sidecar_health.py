"""Which injected sidecars of a DatasetMount keep dying, as a condition and Events.

A sidecar that cannot live in its memory limit is OOMKilled at every start: its pod
stays Pending (the sidecar is an init container that must start first) while the mount
said Ready and nothing on it said why (exploration s18-xnode, defect 3). The spec check
(`specs`, SIDECAR_MEMORY_FLOOR) refuses limits no sidecar can start in; this reports the
ones that still die: a limit too small for its dataset's shards, a crash at start.

The pod watch sees metadata only (`pod_watch`: a full pod per event cost most of the
operator's CPU in a burst), so a timer lists each mount's unfinished pods instead, as
check-stalls does, only for mounts with pods or a SidecarsHealthy=False to clear.
Decisions here are pure; `sidecar_checks` is the handler.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from shardcache import contract
from shardcache_operator import status

CONDITION = status.SIDECARS_HEALTHY
#: Warning Event reasons, one per kind of death (also the condition's reason).
OOM_KILLED = "SidecarOOMKilled"
CRASH_LOOPING = "SidecarCrashLooping"
#: Pods named in the condition's message; the rest are counted.
NAMED_PODS = 5


@dataclasses.dataclass(frozen=True)
class Trouble:
    """One injected sidecar container that was killed or keeps failing."""

    pod: str
    container: str
    #: The kubelet's reason of its last termination (OOMKilled, Error) or CrashLoopBackOff.
    reason: str
    restarts: int
    #: limits.memory of the container as injected; None without one.
    memory_limit: str | None

    @property
    def event_reason(self) -> str:
        return OOM_KILLED if self.reason == "OOMKilled" else CRASH_LOOPING

    def describe(self) -> str:
        limit = self.memory_limit or "none"
        return (
            f"pod {self.pod} container {self.container}: {self.reason} "
            f"({self.restarts} restart(s), memory limit {limit})"
        )


def _sidecars(pod: Mapping[str, Any], mount: str) -> dict[str, Mapping[str, Any]]:
    """The pod's containers injected for `mount`, by name (found by their env, as
    `starvation.endpoint` finds their port)."""
    spec = pod.get("spec") or {}
    found: dict[str, Mapping[str, Any]] = {}
    for container in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        env = {e.get("name"): e.get("value") for e in container.get("env") or []}
        if env.get(contract.ENV_MOUNT) == mount:
            found[str(container.get("name"))] = container
    return found


def _reason(container_status: Mapping[str, Any]) -> str | None:
    """Why this container died, or None while it has not: OOMKilled now or at its last
    termination (the kubelet keeps lastState until the next one), else crash-looping
    (a restart back-off after a failed start, with the last termination's reason)."""
    state = container_status.get("state") or {}
    last = (container_status.get("lastState") or {}).get("terminated") or {}
    now = state.get("terminated") or {}
    if "OOMKilled" in (now.get("reason"), last.get("reason")):
        return "OOMKilled"
    if (state.get("waiting") or {}).get("reason") == "CrashLoopBackOff":
        return str(last.get("reason") or "CrashLoopBackOff")
    return None


def troubles(pod: Mapping[str, Any], mount: str) -> list[Trouble]:
    """The injected sidecars of `mount` in `pod` that were OOMKilled or crash-loop."""
    sidecars = _sidecars(pod, mount)
    state = pod.get("status") or {}
    found = []
    for container_status in [
        *(state.get("initContainerStatuses") or []),
        *(state.get("containerStatuses") or []),
    ]:
        name = str(container_status.get("name"))
        reason = _reason(container_status) if name in sidecars else None
        if reason is None:
            continue
        limits = (sidecars[name].get("resources") or {}).get("limits") or {}
        memory = limits.get("memory")
        found.append(
            Trouble(
                pod=str((pod.get("metadata") or {}).get("name")),
                container=name,
                reason=reason,
                restarts=int(container_status.get("restartCount") or 0),
                memory_limit=str(memory) if memory is not None else None,
            )
        )
    return found


def condition(found: Sequence[Trouble]) -> status.Condition:
    """SidecarsHealthy for the mount's troubles now (none: True)."""
    if not found:
        return status.Condition(
            CONDITION, "True", "SidecarsRunning", "no injected sidecar was killed or crash-loops"
        )
    shown = "; ".join(t.describe() for t in found[:NAMED_PODS])
    more = len(found) - NAMED_PODS
    if more > 0:
        shown += f"; and {more} more"
    oom = any(t.reason == "OOMKilled" for t in found)
    advice = (
        "raise spec.sidecar.resources.limits.memory (or lower cache/prefetch sizes)"
        if oom
        else "see the sidecar's log (kubectl logs <pod> -c <container> --previous)"
    )
    return status.Condition(
        CONDITION,
        "False",
        OOM_KILLED if oom else CRASH_LOOPING,
        f"{len(found)} sidecar(s) killed or crash-looping: {shown}; {advice}",
    )


def conditions_with(
    previous: Iterable[Mapping[str, Any]], new: status.Condition, *, now: str
) -> list[dict[str, Any]]:
    """status.conditions with SidecarsHealthy set to `new`; absent until a sidecar first
    dies, so mounts whose sidecars are fine cost no status write."""
    kept = [dict(c) for c in previous if isinstance(c, Mapping)]
    if new.status == "True" and not any(c.get("type") == CONDITION for c in kept):
        return kept
    return status.with_condition(kept, new, now=now)


def event_message(trouble: Trouble, mount: str) -> str:
    """The Warning Event's message on the DatasetMount for one dead sidecar."""
    what = (
        "was OOMKilled: its memory limit holds neither the sidecar nor its shards' decodes"
        if trouble.reason == "OOMKilled"
        else f"keeps failing ({trouble.reason}): see its log with --previous"
    )
    limit = trouble.memory_limit or "none"
    return (
        f"the {mount} sidecar container {trouble.container} of pod {trouble.pod} {what} "
        f"({trouble.restarts} restart(s), memory limit {limit})"
    )
