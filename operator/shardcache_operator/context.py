"""What every kopf handler of the operator needs, handed to it as kopf's `memo`.

`app.run` builds one `Context` and passes it to `kopf.operator(memo=...)`; kopf gives
each handler a shallow copy (docs.kopf.dev, "In-memory containers"), so the API
client, settings, metrics, the webhook's mount store and the pod-count writer are
shared and handlers hold no state of their own.
Tests build a Context with fakes and fresh metrics.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from shardcache_operator import (
    configuration,
    crd_version,
    event_gates,
    manifest_backfill,
    metrics,
    mount_parts,
    mounts,
    namespace_lists,
    namespace_uids,
    pod_counts,
    pod_watch,
    reconcile,
    sidecar_health,
    source_reads,
    sources,
)


class Api(Protocol):
    """The API reads handlers make (`kube.Api` in the operator)."""

    async def read_secret(self, namespace: str, name: str) -> Mapping[str, str] | None: ...

    async def read_datasetmount(self, namespace: str, name: str) -> dict[str, Any] | None: ...

    async def read_namespace_uid(self, name: str) -> str | None: ...

    async def write_attached_pods(self, namespace: str, name: str, count: int) -> None: ...

    async def list_running_pods(
        self, namespace: str, label_selector: str
    ) -> list[dict[str, Any]]: ...

    async def list_unfinished_pods(
        self, namespace: str, label_selector: str
    ) -> list[dict[str, Any]]: ...

    async def post_event(self, body: Mapping[str, Any]) -> None: ...

    async def put_config_map(self, body: Mapping[str, Any]) -> None: ...

    async def delete_config_map(self, namespace: str, name: str) -> None: ...

    async def read_config_map(self, namespace: str, name: str) -> dict[str, Any] | None: ...


#: (checkpoint URI, storage options) -> the applied-skip records (`skips.read_applied`).
SkipsReader = Callable[[str, Mapping[str, str] | None], list[dict[str, Any]]]


@dataclasses.dataclass(frozen=True)
class Context:
    settings: configuration.Settings
    api: Api
    metrics: metrics.Metrics = dataclasses.field(default_factory=metrics.Metrics)
    #: What tenants' sources are read with (the chart's `policy.*`): `app.run` gives
    #: `sources.access(settings)`, the one it gives `resolve` and `probe`; the applied
    #: skips' reads use it too. Tests: the defaults' (no file://, no ambient identity).
    access: sources.Access = dataclasses.field(default_factory=sources.Access)
    #: In-process by default (tests); `app.run` gives a `resolve_children.Resolver`.
    resolve: reconcile.Resolver = sources.resolve_manifest
    #: In-process by default (tests); `app.run` gives a `read_workers.Pool`'s.
    probe: reconcile.Prober = sources.probe_source
    #: The applied skips under a checkpoint URI: `app.run` gives a `read_workers.Pool`'s;
    #: None (tests): `sources.applied_skips` in-process, with `access`.
    applied_skips: SkipsReader | None = None
    #: Where `resolve`, `probe` and the skips' reads run: threads of their own, a few per
    #: namespace at once, never the loop's executor that API reads and the webhook use.
    source_reads: source_reads.Gate = dataclasses.field(default_factory=source_reads.Gate)
    #: Watched DatasetMounts, API reads of the others, parsed specs: for the webhook.
    mounts: mounts.Store = dataclasses.field(default_factory=mounts.Store)
    #: Each served namespace's UID, which keys its node disk directory, for the webhook.
    namespaces: namespace_uids.Store = dataclasses.field(default_factory=namespace_uids.Store)
    #: Unfinished opted-in pods per DatasetMount, from the operator's pod watch.
    pods: pod_watch.Index = dataclasses.field(default_factory=pod_watch.Index)
    #: Event-driven writes of status.attachedPods.
    pod_counts: pod_counts.Writer = dataclasses.field(default_factory=pod_counts.Writer)
    #: (namespace, mount) -> pod -> when (monotonic) it was first seen above the mount's
    #: stall threshold (`starvation.judge`); lost on restart, so a new leader waits
    #: spec.stall.forSeconds again before it sets DataStarved (one already set stays).
    stalls: dict[tuple[str, str], dict[str, float]] = dataclasses.field(default_factory=dict)
    #: Each mount's volumes and sidecar as injected, built once for a burst's pods.
    parts: mount_parts.Cache = dataclasses.field(default_factory=mount_parts.Cache)
    #: Set once the webhook server listens (`webhook.Server`): kopf's ready flag goes
    #: up before its root tasks, the webhook server among them, even start.
    webhook_listening: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    #: Whether the installed CRD is as new as the operator; `app.run` gives it the API
    #: read, tests none (nothing to check).
    crd: crd_version.Gate = dataclasses.field(default_factory=crd_version.Gate)
    #: The webhook's Events posted per DatasetMount and cause, so that a controller's
    #: pods meeting the same cause post one, with a count (`event_gates`).
    events: event_gates.Gate = dataclasses.field(default_factory=event_gates.Gate)
    #: The dead sidecars of each namespace's pods by mount, one LIST per namespace per
    #: check-sidecars round (`sidecar_checks`).
    sidecar_lists: namespace_lists.Shared[dict[str, sidecar_health.Health]] = dataclasses.field(
        default_factory=lambda: namespace_lists.Shared(sidecar_health.LIST_MAX_AGE_SECONDS)
    )

    #: Deletions this process posted WaitingForPods for, by (namespace, uid).
    deletions_told: set[tuple[str, str]] = dataclasses.field(default_factory=set)
    #: The pins this process knows are handed, and the backfills of those that are not
    #: (`manifest_backfill`).
    backfills: manifest_backfill.Ledger = dataclasses.field(
        default_factory=manifest_backfill.Ledger
    )

    def __post_init__(self) -> None:
        # The parsed specs the webhook and the handlers share get the platform's
        # cache.nodePath where they name none (chart value nodeCache.path).
        self.mounts.default_node_path = self.settings.default_node_path

    @property
    def backoff(self) -> reconcile.Backoff:
        """Retry delays of failed reconciles, from the settings."""
        return reconcile.Backoff(
            initial_seconds=self.settings.backoff_initial_seconds,
            max_seconds=self.settings.backoff_max_seconds,
        )
