"""Start-up of the operator process: settings, API client, kopf, health server.

The handlers' shared state is one `context.Context`, given to kopf as the operator's
memo; the registry holds only wiring.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
from typing import Any

import kopf

from shardcache_operator import configuration, context, handlers, health, kube, sources, webhook

logger = logging.getLogger(__name__)


def login(**_: Any) -> kopf.ConnectionInfo:
    # A registry of our own gets no default login handlers: use the kubernetes
    # client's config (in-cluster, or the kubeconfig `kube.configure` selected).
    return kube.connection_info()


def configure(settings: kopf.OperatorSettings, memo: context.Context, **_: Any) -> None:
    """kopf's settings: our persistence keys, quiet Events, the webhook server."""
    # Progress and the last-handled spec live in our own annotations; status is
    # ours alone (the CRD schema prunes anything else written there).
    settings.persistence.finalizer = handlers.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="shardcache.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="shardcache.io", key="last-handled-configuration"
    )
    # Only our explicit Events reach users, not every handler log line.
    settings.posting.level = logging.ERROR
    if memo.settings.webhook_enabled:
        settings.admission.server = webhook.server(memo.settings)
        settings.admission.managed = memo.settings.webhook_configuration


def build_registry(settings: configuration.Settings) -> kopf.OperatorRegistry:
    """Every handler of the operator, wired; `settings` decides timers and the webhook."""
    registry = kopf.OperatorRegistry()
    kopf.on.login(id="login", registry=registry)(login)
    kopf.on.startup(id="configure", registry=registry)(configure)
    handlers.register(registry, settings)
    if settings.webhook_enabled:
        webhook.register(registry)
    return registry


async def run(settings: configuration.Settings) -> None:
    """Run until SIGINT/SIGTERM; a standby replica waits in kopf's peering."""
    # Tenants' sources are read with the access the platform allows (docs/security.md).
    access = sources.Access(
        file_sources=settings.allow_file_sources,
        ambient_credentials=settings.allow_ambient_credentials,
    )
    memo = context.Context(
        settings=settings,
        api=kube.Api(kube.configure(settings.kubeconfig)),
        resolve=functools.partial(sources.resolve_manifest, access=access),
        probe=functools.partial(sources.probe_source, access=access),
    )
    ready = asyncio.Event()
    runner = await health.start(settings.health_addr, settings.health_port, ready, memo.metrics)
    # Equal priorities make kopf freeze every replica; a random one elects an active
    # replica and leaves the others on standby.
    priority = settings.priority if settings.priority is not None else random.randint(1, 2**30)
    try:
        await kopf.operator(
            registry=build_registry(settings),
            memo=memo,
            clusterwide=not settings.namespaces,
            namespaces=list(settings.namespaces),
            standalone=settings.standalone,
            peering_name=None if settings.standalone else settings.peering_name,
            priority=priority,
            ready_flag=ready,
        )
    finally:
        await runner.cleanup()
