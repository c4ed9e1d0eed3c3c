"""The check-sidecars timer: SidecarsHealthy and Warning Events for injected sidecars
that were OOMKilled or crash-loop (decisions in `sidecar_health`)."""

from __future__ import annotations

import datetime
import time
from typing import Any

import kopf

from shardcache_operator import context, injection, sidecar_health, status

#: Seconds between checks of one mount's pods: a crash loop backs off 10 s, 20 s, 40 s
#: and on, so this sees the first deaths within a minute.
INTERVAL_SECONDS = 30.0


def watches_sidecars(*, body: kopf.Body, **_: Any) -> bool:
    """kopf's `when=` filter: mounts with pods, or with a SidecarsHealthy to clear."""
    state = body.get("status") or {}
    return bool(state.get("attachedPods")) or status.has_condition(
        state, status.SIDECARS_HEALTHY, "False"
    )


async def check_sidecars(
    *,
    body: kopf.Body,
    patch: kopf.Patch,
    namespace: str | None,
    name: str,
    memo: context.Context,
    **_: Any,
) -> None:
    """List the mount's unfinished pods, set SidecarsHealthy, post one Warning Event per
    dead sidecar (at most one per `event_gates.INTERVAL_SECONDS` for each)."""
    if await memo.crd.problem() is not None:
        return
    ns = namespace or ""
    found: list[sidecar_health.Trouble] = []
    if memo.pods.count(ns, name):
        pods = await memo.api.list_unfinished_pods(ns, injection.LABEL_MOUNT)
        found = [t for pod in pods for t in sidecar_health.troubles(pod, name)]
    previous = (body.get("status") or {}).get("conditions") or []
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    conditions = sidecar_health.conditions_with(previous, sidecar_health.condition(found), now=now)
    if conditions != [dict(c) for c in previous]:
        patch.status["conditions"] = conditions
    uid = str((body.get("metadata") or {}).get("uid") or "")
    for trouble in found:
        key = (ns, name, uid, trouble.event_reason, f"{trouble.pod}/{trouble.container}")
        if memo.events.admit(key, now=time.monotonic()) is None:
            continue
        kopf.event(
            body,
            type="Warning",
            reason=trouble.event_reason,
            message=sidecar_health.event_message(trouble, name),
        )
