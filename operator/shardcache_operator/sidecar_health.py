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

The kubelet keeps a container's last termination (`lastState.terminated`) until the
next one, for the pod's life: a sidecar OOMKilled once kept SidecarsHealthy=False until
its pod ended. A sidecar counts healthy again once it has run, ready, for
`SETTLE_SECONDS` since its last start (`state.running.startedAt`: a new restart moves
it); until then it is still trouble, so a crash loop's short runs between deaths do not
flip the condition to True and back.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from shardcache_operator import pod_updates, rfc3339, status

CONDITION = status.SIDECARS_HEALTHY
#: Warning Event reasons, one per kind of death (also the condition's reason).
OOM_KILLED = "SidecarOOMKilled"
CRASH_LOOPING = "SidecarCrashLooping"
#: The condition's True reasons: every dead sidecar ran ready for `SETTLE_SECONDS`
#: since (named), or none is known to have died.
RECOVERED = "SidecarsRecovered"
RUNNING = "SidecarsRunning"
#: How long a sidecar that died must have run ready since its last start to count
#: healthy again. The kubelet itself takes a container that ran 10 minutes as
#: recovered (it resets the restart back-off then); this is also beyond the longest
#: crash-loop back-off (5 minutes), and long enough for a sidecar that dies once its
#: readers' shards are decoded, not at start, to have met that load again.
SETTLE_SECONDS = 600.0
#: How long one namespace's LIST answers the check of its mounts: the check's
#: interval (`sidecar_checks.INTERVAL_SECONDS`), so a namespace costs one LIST a round
#: however many mounts it has, and a check reads pods at most one round old.
LIST_MAX_AGE_SECONDS = 30.0
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


@dataclasses.dataclass(frozen=True)
class Health:
    """The injected sidecars of one mount that died: still in trouble, or recovered
    (ran ready for `SETTLE_SECONDS` since)."""

    troubles: tuple[Trouble, ...] = ()
    recovered: tuple[Trouble, ...] = ()


def _failed(terminated: Mapping[str, Any]) -> bool:
    """Whether a termination was a death (OOMKilled, or a non-zero exit)."""
    if not terminated:
        return False
    return terminated.get("reason") == "OOMKilled" or terminated.get("exitCode") not in (0, None)


def _settled(container_status: Mapping[str, Any], now: datetime.datetime) -> bool:
    """Whether the container has run, ready, for SETTLE_SECONDS since its last start."""
    running = (container_status.get("state") or {}).get("running") or {}
    if not running or container_status.get("ready") is not True:
        return False
    started = rfc3339.parse(running.get("startedAt"))
    if started is None:
        return False  # no start time: not known to have run long enough
    return (now - started).total_seconds() >= SETTLE_SECONDS


def _judge(container_status: Mapping[str, Any], now: datetime.datetime) -> tuple[str, bool] | None:
    """(why the container died, whether it has settled since), or None while it has
    not died: OOMKilled now or at its last termination (the kubelet keeps lastState
    until the next one), crash-looping (a restart back-off after a failed start, with
    the last termination's reason), or restarted after a failed run and not yet
    settled."""
    state = container_status.get("state") or {}
    last = (container_status.get("lastState") or {}).get("terminated") or {}
    current = state.get("terminated") or {}
    if current.get("reason") == "OOMKilled":
        return "OOMKilled", False
    if (state.get("waiting") or {}).get("reason") == "CrashLoopBackOff":
        return str(last.get("reason") or "CrashLoopBackOff"), False
    if _failed(last):
        return str(last.get("reason") or "Error"), _settled(container_status, now)
    return None


def _sidecars_by_mount(pod: Mapping[str, Any]) -> dict[str, dict[str, Mapping[str, Any]]]:
    """Every injected sidecar of the pod: mount -> container name -> container.

    Init containers only, as the injection has always placed them: the trainers (the
    pod's `containers`) carry $SHARDCACHE_MOUNT too, and a trainer's own OOMKill or
    crash loop was reported as the mount's sidecar, with advice to raise the sidecar's
    memory limit (`pod_updates.injected_containers` tells them apart the same way).
    """
    found: dict[str, dict[str, Mapping[str, Any]]] = {}
    for name, container in pod_updates.injected_containers(pod).items():
        mount = pod_updates.served_mount(container)
        if mount:
            found.setdefault(mount, {})[name] = container
    return found


def assess(pods: Iterable[Mapping[str, Any]], now: datetime.datetime) -> dict[str, Health]:
    """The dead sidecars of every mount in `pods` (one namespace's LIST), by mount:
    the mounts of a namespace share one LIST per round (`sidecar_checks`)."""
    troubled: dict[str, list[Trouble]] = {}
    recovered: dict[str, list[Trouble]] = {}
    for pod in pods:
        by_mount = _sidecars_by_mount(pod)
        if not by_mount:
            continue
        mount_of = {name: m for m, containers in by_mount.items() for name in containers}
        state = pod.get("status") or {}
        for container_status in [
            *(state.get("initContainerStatuses") or []),
            *(state.get("containerStatuses") or []),
        ]:
            name = str(container_status.get("name"))
            mount = mount_of.get(name)
            judged = _judge(container_status, now) if mount is not None else None
            if mount is None or judged is None:
                continue
            reason, settled = judged
            limits = (by_mount[mount][name].get("resources") or {}).get("limits") or {}
            memory = limits.get("memory")
            trouble = Trouble(
                pod=str((pod.get("metadata") or {}).get("name")),
                container=name,
                reason=reason,
                restarts=int(container_status.get("restartCount") or 0),
                memory_limit=str(memory) if memory is not None else None,
            )
            (recovered if settled else troubled).setdefault(mount, []).append(trouble)
    return {
        mount: Health(tuple(troubled.get(mount, ())), tuple(recovered.get(mount, ())))
        for mount in {*troubled, *recovered}
    }


def troubles(
    pod: Mapping[str, Any], mount: str, *, now: datetime.datetime | None = None
) -> list[Trouble]:
    """The injected sidecars of `mount` in `pod` that were OOMKilled or crash-loop,
    and have not run ready for SETTLE_SECONDS since."""
    when = now or datetime.datetime.now(datetime.UTC)
    return list(assess([pod], when).get(mount, Health()).troubles)


def _named(found: Sequence[Trouble]) -> str:
    shown = "; ".join(t.describe() for t in found[:NAMED_PODS])
    more = len(found) - NAMED_PODS
    if more > 0:
        shown += f"; and {more} more"
    return shown


def condition(found: Sequence[Trouble], recovered: Sequence[Trouble] = ()) -> status.Condition:
    """SidecarsHealthy for the mount's troubles now (none: True, naming the sidecars
    that died and have run ready since)."""
    if not found and recovered:
        return status.Condition(
            CONDITION,
            "True",
            RECOVERED,
            f"{len(recovered)} sidecar(s) that were killed or crash-looped have run ready "
            f"for {SETTLE_SECONDS:.0f} s since their last restart: {_named(recovered)}",
        )
    if not found:
        return status.Condition(
            CONDITION, "True", RUNNING, "no injected sidecar was killed or crash-loops"
        )
    shown = _named(found)
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


def recovers(previous: Iterable[Mapping[str, Any]], new: status.Condition) -> bool:
    """Whether `new` turns a SidecarsHealthy=False back to True (one Normal Event)."""
    was = next((c for c in previous if isinstance(c, Mapping) and c.get("type") == CONDITION), None)
    return was is not None and was.get("status") == "False" and new.status == "True"


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
