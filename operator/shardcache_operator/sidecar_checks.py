"""The check-sidecars timer: SidecarsHealthy and Warning Events for injected sidecars
that were OOMKilled or crash-loop, a Normal Event once they run again (decisions in
`sidecar_health`)."""

from __future__ import annotations

import datetime
import time
from typing import Any

import kopf

from shardcache_operator import context, injection, rfc3339, sidecar_health, status

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
    """Set SidecarsHealthy from the namespace's unfinished pods (one LIST shared by its
    mounts' checks: `namespace_lists`), post one Warning Event per dead sidecar (at most
    one per `event_gates.INTERVAL_SECONDS` for each) and one Normal Event when the
    condition turns True again."""
    if await memo.crd.problem() is not None:
        return
    ns = namespace or ""
    health = sidecar_health.Health()
    if memo.pods.count(ns, name):
        by_mount = await memo.sidecar_lists.get(ns, lambda: _assess(memo, ns))
        health = by_mount.get(name, health)
    previous = (body.get("status") or {}).get("conditions") or []
    new = sidecar_health.condition(health.troubles, health.recovered)
    now = rfc3339.now()
    conditions = sidecar_health.conditions_with(previous, new, now=now)
    if conditions != [dict(c) for c in previous]:
        patch.status["conditions"] = conditions
    uid = str((body.get("metadata") or {}).get("uid") or "")
    # Gated like the Warnings: a status patch that failed is retried next round, and
    # must not post the same Normal Event again.
    recovery = (ns, name, uid, new.reason, "")
    if sidecar_health.recovers(previous, new) and (
        memo.events.admit(recovery, now=time.monotonic()) is not None
    ):
        kopf.info(body, reason=new.reason, message=new.message)
    for trouble in health.troubles:
        key = (ns, name, uid, trouble.event_reason, f"{trouble.pod}/{trouble.container}")
        if memo.events.admit(key, now=time.monotonic()) is None:
            continue
        kopf.event(
            body,
            type="Warning",
            reason=trouble.event_reason,
            message=sidecar_health.event_message(trouble, name),
        )


async def _assess(memo: context.Context, namespace: str) -> dict[str, sidecar_health.Health]:
    """The namespace's dead sidecars by mount, from one LIST of its unfinished opted-in
    pods (the selector matches every opted-in pod; mounts are told apart by env)."""
    pods = await memo.api.list_unfinished_pods(namespace, injection.LABEL_MOUNT)
    return sidecar_health.assess(pods, datetime.datetime.now(datetime.UTC))
