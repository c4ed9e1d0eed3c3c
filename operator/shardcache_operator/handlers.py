"""kopf handlers for DatasetMounts: thin wrappers around `reconcile` and `status`.

Handlers are module-level functions; what they share (API client, settings, metrics)
arrives as kopf's `memo`, a `context.Context`. `register` only wires them onto an
explicit registry, so importing this module has no side effects and tests build an
operator with their own context.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
import kopf

from shardcache import errors, uris
from shardcache_operator import (
    authority,
    configuration,
    context,
    crd_version,
    injection,
    kube,
    manifest_backfill,
    manifest_handoff,
    reconcile,
    rfc3339,
    sidecar_checks,
    skips,
    sources,
    specs,
    starvation,
    status,
)

logger = logging.getLogger(__name__)

RESOURCE = (specs.GROUP, specs.VERSION, specs.PLURAL)
#: kopf index of DatasetMount objects by (namespace, name), as kopf's watch last showed
#: them, for the handlers. Not for the webhook: kopf stops watching (and feeding indexes)
#: while peering pauses a replica, so the webhook reads `mount_watch`'s view instead.
MOUNT_INDEX = "datasetmounts"
#: Seconds kopf waits for a stopped timer to return before falling back to polling it
#: (kopf's default is a few zero-time loop cycles). The source check is async and
#: returns at once from its sleep; 0.1 s covers it finishing a probe's last step.
INSTANT_EXIT_TIMEOUT_SECONDS = 0.1
#: How often kopf re-checks a timer that did not exit instantly (kopf's default, 60 s,
#: held a deletion for a minute once: issue 18). The check-source timer probes with a
#: bounded timeout, so a short poll is enough.
CANCELLATION_POLLING_SECONDS = 1.0


def now_text() -> str:
    return rfc3339.now()


def apply_result(
    memo: context.Context,
    result: reconcile.Result,
    *,
    body: kopf.Body,
    patch: kopf.Patch,
    status_update: Mapping[str, Any],
) -> None:
    """Write `status_update`, record the phase and failure in metrics, post the Events."""
    if status_update:
        patch.status.update(status_update)
    memo.metrics.set_phase(
        body.metadata.namespace or "", body.metadata.name or "", status.phase_of(result.outcome)
    )
    if isinstance(result.outcome, status.Failed):
        memo.metrics.source_errors_total.labels(reason=result.outcome.reason).inc()
    for event in result.events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)


async def index_mount(
    *, namespace: str | None, name: str, body: kopf.Body, memo: context.Context, **kwargs: Any
) -> dict[tuple[str, str], dict[str, Any]]:
    """(namespace, name) -> the DatasetMount object (a plain dict, as the API serves it).

    Also hands the index itself to the handlers' `memo.mounts` (a live view; kopf
    passes every index to every handler, this one included). The pod-count writer is
    woken by `mount_watch` instead, and writes the mounts it shows: this index freezes
    while peering pauses the replica (`pod_counts`).
    """
    index = kwargs[MOUNT_INDEX]
    memo.mounts.index = index
    return {(namespace or "", name): dict(body)}


def _spec_of(memo: context.Context, obj: Mapping[str, Any]) -> specs.DatasetMountSpec | None:
    """`obj`'s spec, parsed once per (uid, generation) as for the webhook; None if invalid."""
    try:
        return memo.mounts.load(obj, known=len(memo.mounts.index)).spec
    except errors.InputError:
        return None


def refusal_of(body: Mapping[str, Any], memo: context.Context) -> status.Failed | None:
    """What the platform says of a mount with a valid spec: `Invalid` (until the spec
    changes) when its policy does not allow it, which the webhook would refuse every pod
    of; None when it may go on. An invalid spec is left to the reconcile."""
    spec = _spec_of(memo, body)
    if spec is None:
        return None
    settings = memo.settings
    found = authority.violations(spec, settings.policy(), default_image=settings.sidecar_image)
    if not found:
        return None
    return status.Failed(
        status.Phase.INVALID, authority.REASON, "; ".join(found), reachable=None, keeps_pin=True
    )


async def resolve(
    *,
    body: kopf.Body,
    patch: kopf.Patch,
    retry: int,
    namespace: str | None,
    name: str,
    memo: context.Context,
    **kwargs: Any,
) -> None:
    """Resolve and pin the manifest of a mount the platform allows (`refusal_of`);
    failures, refusals included, become status, Events and retries."""
    await hold_for_crd(body, memo, retry)
    started = time.monotonic()
    result = await reconcile.reconcile(
        body,
        read_secret=memo.api.read_secret,
        resolve=memo.resolve,
        probe=memo.probe,
        now=now_text(),
        retry=retry,
        backoff=memo.backoff,
        timeout=memo.settings.resolve_timeout_seconds,
        refusal=refusal_of(body, memo),
        reads=memo.source_reads,
    )
    if namespace and namespace in memo.settings.manifest_namespaces:
        # Before the status that makes the mount Ready: its pods then find them.
        await hand_manifests(memo, body, namespace, result.handed)
    new_status = dict(result.status)
    new_status["attachedPods"] = memo.pods.count(namespace or "", name)
    apply_result(memo, result, body=body, patch=patch, status_update=new_status)
    # A pin kept without its manifest (made before the namespace was listed, or its
    # ConfigMaps deleted) is handed by a task of the mount's; kopf resumes every mount
    # when the operator starts, so each is looked at once per process (and hourly once
    # handed, at its source checks: ConfigMaps deleted since).
    follow_manifests(memo, {**body, "status": new_status})
    memo.metrics.reconcile_duration.observe(time.monotonic() - started)
    memo.metrics.reconcile_total.labels(phase=status.phase_of(result.outcome).value).inc()
    if result.retry_in is not None:
        assert isinstance(result.outcome, status.Failed)
        raise kopf.TemporaryError(result.outcome.message, delay=result.retry_in)


async def hand_manifests(
    memo: context.Context, body: kopf.Body, namespace: str, handed: Sequence[reconcile.Handed]
) -> None:
    """Hand the manifests pinned now to the mount's sidecars (`manifest_handoff`); a
    failure is a Warning Event, never a failed reconcile."""
    owner = manifest_handoff.owner(body)
    for pin in handed:
        try:
            # Tried even where a write was refused within the hour: the parts are at
            # hand now, and a Role granted since saves a read of the dataset later.
            failure = await manifest_handoff.hand(
                memo.api,
                owner=owner,
                namespace=namespace,
                source=pin.source,
                digest=pin.digest,
                parts=pin.parts,
            )
        except PermissionError as exc:
            said = memo.backfills.refuse(namespace, exc, time.monotonic())
            if said is not None:
                logger.warning("%s/%s: %s", namespace, body.metadata.name, said)
                kopf.event(body, type="Warning", reason=manifest_handoff.REASON, message=said)
            continue
        key = (namespace, str(body.metadata.uid), pin.source, pin.digest)
        if failure is not None:
            logger.warning("%s/%s: %s", namespace, body.metadata.name, failure)
            kopf.event(body, type="Warning", reason=manifest_handoff.REASON, message=failure)
            # The mount's task hands it later, not at once: a write just failed.
            memo.backfills.failed(key, time.monotonic())
        else:
            memo.backfills.settle(key, time.monotonic())


def follow_manifests(memo: context.Context, body: Mapping[str, Any]) -> None:
    """Start the mount's task that hands the pins it keeps without their manifests
    (`manifest_backfill`), where manifests are handed and it has such a pin; `body` is
    the mount with the status its reconcile writes."""
    namespace = str((body.get("metadata") or {}).get("namespace") or "")
    if namespace not in memo.settings.manifest_namespaces:
        return
    if not manifest_backfill.wants_look(memo.backfills, body, time.monotonic()):
        return

    async def resolve_again(spec: specs.DatasetMountSpec, source: str) -> status.Outcome:
        return await reconcile.resolve_again(
            spec,
            source,
            namespace=namespace,
            read_secret=memo.api.read_secret,
            resolve=memo.resolve,
            timeout=memo.settings.resolve_timeout_seconds,
            reads=memo.source_reads,
        )

    async def say(kind: str, reason: str, message: str) -> None:
        # Through the API: this task outlives the handler that started it.
        event = kube.event_body(body, type=kind, reason=reason, message=message, now=now_text())
        try:
            await memo.api.post_event(event)
        except Exception as exc:  # the API server: the log says it all the same
            logger.info("posting the %s Event: %s", reason, exc)

    uid = str((body.get("metadata") or {}).get("uid") or "")
    memo.backfills.start(
        namespace,
        uid,
        lambda: manifest_backfill.follow(
            body,
            manifest_backfill.Means(
                memo.backfills,
                memo.api,
                resolve_again,
                say,
                count=lambda result: memo.metrics.manifest_looks_total.labels(result).inc(),
            ),
        ),
    )


async def hold_for_crd(body: kopf.Body, memo: context.Context, retry: int) -> None:
    """Retry later, saying why, while the installed CRD is older than the operator."""
    problem = await memo.crd.problem()
    if problem is None:
        return
    # An Event on the first try and then every tenth (about every 5 minutes): kopf's
    # log line comes with every retry.
    if retry % 10 == 0:
        kopf.event(body, type="Warning", reason=crd_version.REASON, message=problem)
    raise kopf.TemporaryError(problem, delay=crd_version.RECHECK_SECONDS)


async def check_crd(*, memo: context.Context, **_: Any) -> None:
    """At start-up: log the installed CRD's verdict before any mount is handled."""
    await memo.crd.problem()


async def check_source(
    *, body: kopf.Body, patch: kopf.Patch, memo: context.Context, **_: Any
) -> None:
    """Ready <-> Degraded as the source of a pinned mount goes away and comes back."""
    if await memo.crd.problem() is not None:
        return
    result = await reconcile.check_source(
        body,
        read_secret=memo.api.read_secret,
        probe=memo.probe,
        now=now_text(),
        timeout=memo.settings.resolve_timeout_seconds,
        reads=memo.source_reads,
    )
    if result is None:
        return
    before = body.get("status") or {}
    changed = {k: v for k, v in result.status.items() if before.get(k) != v}
    apply_result(memo, result, body=body, patch=patch, status_update=changed)
    # Ready again after the resume found it Degraded: its kept pins are looked at now.
    follow_manifests(memo, {**body, "status": {**before, **result.status}})


def has_checkpoint(*, spec: kopf.Spec, **_: Any) -> bool:
    """kopf's `when=` filter of check-skips: only mounts that write checkpoints."""
    return bool(spec.get("checkpoint"))


async def check_skips(
    *, body: kopf.Body, patch: kopf.Patch, namespace: str | None, memo: context.Context, **_: Any
) -> None:
    """status.lastSkip and a SkipApplied Event when sidecars restored with a skip."""
    if await memo.crd.problem() is not None:
        return
    try:
        spec = specs.parse_spec(body.get("spec"))
    except errors.InputError:
        return
    if spec.checkpoint is None:
        return
    options = None
    try:
        if spec.source.secret_ref is not None:
            options = await memo.api.read_secret(namespace or "", spec.source.secret_ref.name)
        uri = spec.checkpoint.uri
        read = memo.applied_skips or functools.partial(sources.applied_skips, access=memo.access)
        records = await memo.source_reads.run(
            namespace or "",
            # The operator's own pod connects: the same access as the source's reads.
            lambda: read(uri, options),
            timeout=memo.settings.resolve_timeout_seconds,
            what=f"reading the applied skips of {uris.redact(uri)}",
        )
    except (errors.ShardcacheError, OSError, PermissionError, TimeoutError) as exc:
        # The source checks report an unreachable store or Secret; this only reports skips.
        logger.debug("checking %s for applied skips: %s", spec.checkpoint.uri, exc)
        return
    update, events = skips.report(body.get("status") or {}, records)
    if update:
        patch.status.update(update)
    for reason, message in events:
        kopf.event(body, type="Normal", reason=reason, message=message)


def watches_stalls(*, body: kopf.Body, **_: Any) -> bool:
    """kopf's `when=` filter of check-stalls: mounts with pods, or still DataStarved."""
    state = body.get("status") or {}
    return bool(state.get("attachedPods")) or status.has_condition(
        state, status.DATA_STARVED, "True"
    )


async def check_stalls(
    *,
    body: kopf.Body,
    patch: kopf.Patch,
    namespace: str | None,
    name: str,
    memo: context.Context,
    **_: Any,
) -> None:
    """DataStarved and an Event naming the pods when a pod's loop waits on data."""
    if await memo.crd.problem() is not None:
        return
    ns = namespace or ""
    try:
        stall = specs.parse_spec(body.get("spec")).stall
    except errors.InputError:
        return
    endpoints = []
    if memo.pods.count(ns, name):
        pods = await memo.api.list_running_pods(ns, injection.LABEL_MOUNT)
        endpoints = [e for e in (starvation.endpoint(p, name) for p in pods) if e is not None]
    timeout = aiohttp.ClientTimeout(total=starvation.SCRAPE_TIMEOUT_SECONDS)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        fractions = await starvation.scrape(session, endpoints)
    key = (ns, name)
    previous = (body.get("status") or {}).get("conditions") or []
    starved_before = status.has_condition(body.get("status"), status.DATA_STARVED, "True")
    verdict = starvation.judge(
        memo.stalls.get(key, {}),
        fractions,
        now=time.monotonic(),
        stall=stall,
        starved_before=starved_before and key not in memo.stalls,
    )
    if verdict.above_since:
        memo.stalls[key] = verdict.above_since
    else:
        memo.stalls.pop(key, None)
    new = starvation.condition(verdict.starved, stall)
    conditions, flipped = starvation.conditions_with(previous, new, now=now_text())
    if conditions != [dict(c) for c in previous]:
        patch.status["conditions"] = conditions
    if flipped:
        kopf.event(
            body,
            type="Warning" if verdict.starved else "Normal",
            reason="DataStarved" if verdict.starved else "DataRecovered",
            message=new.message,
        )


async def finalize(
    *,
    body: kopf.Body,
    patch: kopf.Patch,
    namespace: str | None,
    name: str,
    annotations: kopf.Annotations,
    memo: context.Context,
    **kwargs: Any,
) -> None:
    """Hold the finalizer while unfinished pods still use this mount.

    Running sidecars carry everything they need in their env, so they would keep
    working; the wait makes a deletion visible instead of silently leaving pods
    on a dataset that is no longer declared. Node cache files are not removed:
    they are content-addressed and shared by the namespace's other mounts, whose
    sidecars' LRU evicts them; once the namespace itself is gone, the node-cache
    DaemonSet's reclaim removes its directory (`node_reclaim`).

    Async: it reads memory only, and a sync handler cost a hop to kopf's thread pool
    and back for each of 500 mounts deleted at once (issue 18).
    """
    ns = namespace or ""
    count = memo.pods.count(ns, name)
    forced = annotations.get(specs.ANNOTATION_FORCE_DELETE) == "true"
    if count and not forced:
        # Not under an older CRD: a status write prunes the object to its schema
        # (crd_version); the wait, its Event and the finalizer go on all the same.
        force_hint = f"annotate it {specs.ANNOTATION_FORCE_DELETE}=true to delete it now"
        if await memo.crd.problem() is None:
            patch.status["phase"] = status.Phase.TERMINATING.value
            patch.status["attachedPods"] = count
            previous = (body.get("status") or {}).get("conditions") or []
            ready = status.terminating_condition(count, force_hint=force_hint)
            conditions = status.with_condition(previous, ready, now=now_text())
            if conditions != [dict(c) for c in previous]:
                patch.status["conditions"] = conditions
        message = (
            f"waiting for {count} pod(s) using DatasetMount {ns}/{name} to finish; {force_hint}"
        )
        # Once: the phase says it was posted, and where the status cannot be written (an
        # older CRD) this process remembers it, else it came every deletion poll.
        told = (ns, str(body.metadata.uid))
        phase = (body.get("status") or {}).get("phase")
        if phase != status.Phase.TERMINATING and told not in memo.deletions_told:
            kopf.event(body, type="Normal", reason="WaitingForPods", message=message)
            memo.deletions_told.add(told)
        memo.metrics.set_phase(ns, name, status.Phase.TERMINATING)
        raise kopf.TemporaryError(message, delay=memo.settings.deletion_poll_seconds)
    memo.metrics.set_phase(ns, name, None)
    memo.backfills.forget(ns, str(body.metadata.uid))
    memo.deletions_told.discard((ns, str(body.metadata.uid)))
    logger.info("DatasetMount %s/%s released (%d attached pods)", ns, name, count)


def register(registry: kopf.OperatorRegistry, settings: configuration.Settings) -> None:
    """Wire the DatasetMount handlers onto `registry`; `settings` gives timer intervals.

    Pods are not watched through kopf (see `pod_watch`), and pod counts have no timer:
    the pod watch and `mount_watch` wake the one `pod_counts` writer `app.run` starts,
    so an idle cluster costs no wake-ups per mount.

    Explicit ids: handler ids become annotation keys (progress storage), so they stay
    stable whatever the functions are called.
    """
    kopf.on.startup(id="check-crd", registry=registry)(check_crd)
    kopf.index(*RESOURCE, id=MOUNT_INDEX, registry=registry)(index_mount)
    kopf.on.resume(*RESOURCE, id="resolve", registry=registry)(resolve)
    kopf.on.create(*RESOURCE, id="resolve", registry=registry)(resolve)
    kopf.on.update(*RESOURCE, id="resolve", field="spec", registry=registry)(resolve)
    kopf.timer(
        *RESOURCE,
        interval=settings.source_check_seconds,
        initial_delay=settings.source_check_seconds,
        id="check-source",
        registry=registry,
    )(check_source)
    # Only mounts with spec.checkpoint have skips to look for: kopf starts no timer for
    # the others, so idle mounts cost nothing here.
    kopf.timer(
        *RESOURCE,
        interval=settings.skips_interval_seconds,
        initial_delay=settings.skips_interval_seconds,
        id="check-skips",
        when=has_checkpoint,
        registry=registry,
    )(check_skips)
    # Only mounts with pods (or a DataStarved to clear): idle mounts cost nothing.
    # 0 seconds: no stall checks at all (DataStarved is never set).
    if settings.stall_check_seconds > 0:
        kopf.timer(
            *RESOURCE,
            interval=settings.stall_check_seconds,
            initial_delay=settings.stall_check_seconds,
            id="check-stalls",
            when=watches_stalls,
            registry=registry,
        )(check_stalls)
    # Only mounts with pods (or a SidecarsHealthy=False to clear), as check-stalls.
    kopf.timer(
        *RESOURCE,
        interval=sidecar_checks.INTERVAL_SECONDS,
        initial_delay=sidecar_checks.INTERVAL_SECONDS,
        id="check-sidecars",
        when=sidecar_checks.watches_sidecars,
        registry=registry,
    )(sidecar_checks.check_sidecars)
    kopf.on.delete(*RESOURCE, id="finalize", registry=registry)(finalize)
