"""Start-up of the operator process: settings, API client, kopf, health server.

The handlers' shared state is one `context.Context`, given to kopf as the operator's
memo; the registry holds only wiring.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

import kopf

from shardcache.node import quotas
from shardcache_operator import (
    configuration,
    context,
    crd_version,
    handlers,
    health,
    kube,
    mount_watch,
    namespace_uids,
    pod_watch,
    read_workers,
    resolve_children,
    resolve_slots,
    served_namespaces,
    sources,
    specs,
    webhook,
)

logger = logging.getLogger(__name__)


def login(**_: Any) -> kopf.ConnectionInfo:
    # A registry of our own gets no default login handlers: use the kubernetes
    # client's config (in-cluster, or the kubeconfig `kube.configure` selected).
    return kube.connection_info()


def configure(settings: kopf.OperatorSettings, memo: context.Context, **_: Any) -> None:
    """kopf's settings: our persistence keys, quiet Events, the webhook server."""
    # Progress and the last-handled spec live in our own annotations; status is
    # ours alone (the CRD schema prunes anything else written there).
    settings.persistence.finalizer = specs.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="shardcache.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="shardcache.io", key="last-handled-configuration"
    )
    # Only our explicit Events reach users, not every handler log line.
    settings.posting.level = logging.ERROR
    # No access-log line per admission review (a burst is thousands): formatting them
    # cost the webhook server as much as TLS. Errors are still logged.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    # Deleting a DatasetMount stops its check-source timer; never wait a minute for it.
    settings.background.instant_exit_timeout = handlers.INSTANT_EXIT_TIMEOUT_SECONDS
    settings.background.cancellation_polling = handlers.CANCELLATION_POLLING_SECONDS
    settings.scanning.disabled = scanning_disabled(memo.settings.namespaces)
    if memo.settings.webhook_enabled:
        settings.admission.server = webhook.Server(webhook.server(memo.settings), memo)
        settings.admission.managed = memo.settings.webhook_configuration


def scanning_disabled(namespaces: tuple[str, ...]) -> bool:
    """Whether kopf's cluster scanning is off: for exact namespace names.

    kopf lists namespaces to resolve patterns; the chart grants a namespaced release no
    `list namespaces` (least privilege), and kopf retried that listing for about a
    minute, an ERROR per try, before serving the names as given: no mount reconciled
    while /readyz said ready. Off, kopf serves exactly these names at once. It then also
    stops watching CRDs, which it needs only to follow versions added at run time.
    Cluster-wide, kopf lists no namespaces anyway and keeps its CRD watch.
    """
    return bool(namespaces) and served_namespaces.exact(namespaces)


def build_registry(settings: configuration.Settings) -> kopf.OperatorRegistry:
    """Every handler of the operator, wired; `settings` decides timers and the webhook."""
    registry = kopf.OperatorRegistry()
    kopf.on.login(id="login", registry=registry)(login)
    kopf.on.startup(id="configure", registry=registry)(configure)
    handlers.register(registry, settings)
    if settings.webhook_enabled:
        webhook.register(registry)
    return registry


async def _ready_when(
    started: asyncio.Event, listening: asyncio.Event | None, ready: asyncio.Event
) -> None:
    """Set `ready` once kopf has started and, with the webhook, its server listens."""
    await started.wait()
    if listening is not None:
        await listening.wait()
    ready.set()


async def run(settings: configuration.Settings) -> None:
    """Run until SIGINT/SIGTERM; a standby replica waits in kopf's peering."""
    # Tenants' sources are read with the access the platform allows (docs/security.md).
    access = sources.access(settings)
    # Each resolve in a child process with a memory limit, killed at its timeout and
    # when the operator stops (`resolve_children`, docs/security.md).
    children = resolve_slots.capacity_for(
        settings.resolve_children,
        memory_limit=quotas.read().memory_limit,
        resolve_memory=settings.resolve_memory,
        read_workers=settings.read_workers,
    )
    logger.info("resolve children at once, across namespaces: %s", children or "no cap")
    resolver = resolve_children.Resolver(
        memory=settings.resolve_memory,
        timeout=settings.resolve_timeout_seconds,
        access=access,
        children=children,
        hand_namespaces=frozenset(settings.manifest_namespaces),
    )
    # The periodic reads of tenants' stores (source checks, applied skips), in worker
    # processes with the same memory limit (`read_workers`, docs/security.md).
    reads = read_workers.Pool(
        memory=settings.resolve_memory, access=access, workers=settings.read_workers
    )
    memo = context.Context(
        settings=settings,
        api=kube.Api(kube.configure(settings.kubeconfig)),
        access=access,
        resolve=resolver,
        probe=reads.probe,
        applied_skips=reads.applied_skips,
        crd=crd_version.Gate(crd_version.read_installed),
    )
    ready = asyncio.Event()
    runner = await health.start(
        settings.health_addr, settings.health_port, ready, memo.metrics, note=memo.crd.message
    )
    # kopf raises its ready flag when its startup handlers are done, before its root
    # tasks start, the webhook server among them: /readyz said ready while pods of a
    # DatasetMount were refused ("connection refused" calling the webhook), and the
    # chart's Service sends the webhook's requests only to ready replicas.
    started = asyncio.Event()
    readiness = asyncio.create_task(
        _ready_when(started, memo.webhook_listening if settings.webhook_enabled else None, ready),
        name="readiness",
    )
    # Equal priorities make kopf freeze every replica; a random one elects an active
    # replica and leaves the others on standby.
    priority = settings.priority if settings.priority is not None else random.randint(1, 2**30)
    # The pod watch (label-selected, not through kopf: see pod_watch) and the one task
    # that writes every pod count, woken by it.
    watcher = pod_watch.Watcher(
        memo.pods,
        memo.metrics,
        lambda: memo.pod_counts.touch(memo.pods, memo.mounts),
        namespaces=settings.namespaces,
    )
    # What the webhook admits pods from and the pod-count writer writes to, on every
    # replica: kopf's own watch (and so its index) stops while peering pauses this
    # replica, and a paused index keeps deleted mounts and misses new ones (`mount_watch`).
    mounts = mount_watch.Watcher(
        memo.mounts,
        namespaces=settings.namespaces,
        changed=lambda: memo.pod_counts.touch(memo.pods, memo.mounts),
    )
    tasks = [
        asyncio.create_task(watcher.run(kube.connection_info), name="pod-watch"),
        asyncio.create_task(mounts.run(kube.connection_info), name="mount-watch"),
        asyncio.create_task(
            memo.pod_counts.run(
                memo.api.write_attached_pods,
                memo.metrics,
                interval=settings.pods_interval_seconds,
                # A status write under an older CRD prunes what it lacks (crd_version).
                hold=memo.crd.problem,
                recheck=crd_version.RECHECK_SECONDS,
            ),
            name="pod-counts",
        ),
    ]
    if settings.webhook_enabled:
        # The UIDs the webhook keys each namespace's node disk directory by, on every
        # replica (the webhook answers on each).
        namespaces = namespace_uids.Watcher(memo.namespaces, namespaces=settings.namespaces)
        tasks.append(
            asyncio.create_task(namespaces.run(kube.connection_info), name="namespace-watch")
        )
    try:
        # Handlers count pods (the finalizer releases a mount with none): never from an
        # index that has not listed them yet.
        await watcher.synced.wait()
        await kopf.operator(
            registry=build_registry(settings),
            memo=memo,
            clusterwide=not settings.namespaces,
            namespaces=list(settings.namespaces),
            standalone=settings.standalone,
            peering_name=None if settings.standalone else settings.peering_name,
            priority=priority,
            ready_flag=started,
        )
    finally:
        memo.backfills.close()
        resolver.close()
        reads.close()
        readiness.cancel()
        for task in tasks:
            task.cancel()
        await runner.cleanup()
