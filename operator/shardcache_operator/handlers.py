"""kopf handlers for DatasetMounts: thin wrappers around `reconcile` and `status`.

Registered on an explicit registry by `register`, so importing this module has no
side effects and tests can build an operator with their own context.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import time
from collections.abc import Mapping
from typing import Any

import kopf
import pyarrow.fs as pafs

from shardcache import errors, manifests, source
from shardcache_operator import configuration, injection, kube, metrics, reconcile, specs, status

logger = logging.getLogger(__name__)

FINALIZER = "shardcache.io/finalizer"
#: Annotation on a DatasetMount: delete it without waiting for attached pods.
ANNOTATION_FORCE_DELETE = "shardcache.io/force-delete"
RESOURCE = (specs.GROUP, specs.VERSION, specs.PLURAL)
_FINISHED_POD_PHASES = ("Succeeded", "Failed")
#: kopf index of unfinished labelled pods, by (namespace, DatasetMount name).
INDEX = "attached_pods"


def resolve_manifest(
    uri: str, fmt: str, storage_options: Mapping[str, str] | None
) -> reconcile.ManifestLike:
    return manifests.resolve(uri, format=fmt, storage_options=storage_options)


def probe_source(uri: str, storage_options: Mapping[str, str] | None) -> None:
    """Two metadata requests at most: does the dataset's root still exist, non-empty?"""
    fs, root = source.filesystem(uri, storage_options=storage_options)

    def present() -> bool:
        info = fs.get_file_info(root)
        if info.type == pafs.FileType.File:
            return True
        if info.type == pafs.FileType.NotFound:
            return False
        # Object stores may keep an empty "directory" marker after the data is gone.
        selector = pafs.FileSelector(root, recursive=False, allow_not_found=True)
        return bool(fs.get_file_info(selector))

    if not source.with_retries(present, what=f"checking {uri}"):
        raise errors.InputError(f"nothing found at {uri!r} any more: the pinned data is gone")


@dataclasses.dataclass(frozen=True)
class Context:
    settings: configuration.Settings
    api: kube.Api
    resolve: reconcile.Resolver = resolve_manifest
    probe: reconcile.Prober = probe_source


def now_text() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def attached_count(index: Mapping[Any, Any], namespace: str, name: str) -> int:
    return len(list(index.get((namespace, name), [])))


def register(registry: kopf.OperatorRegistry, ctx: Context) -> None:
    """Add the DatasetMount handlers to `registry`."""
    backoff = reconcile.Backoff(
        initial_seconds=ctx.settings.backoff_initial_seconds,
        max_seconds=ctx.settings.backoff_max_seconds,
    )

    # Explicit ids: the index id is the kwarg name handlers receive it under, and handler
    # ids become annotation keys (progress storage), where "<locals>" is not allowed.
    @kopf.index(
        "",
        "v1",
        "pods",
        id=INDEX,
        labels={injection.LABEL_MOUNT: kopf.PRESENT},
        registry=registry,
    )
    def attached_pods(
        *, namespace: str | None, name: str, meta: kopf.Meta, status: kopf.Status, **_: Any
    ) -> dict[tuple[str, str], str]:
        """(namespace, DatasetMount name) -> names of unfinished pods that use it."""
        if status.get("phase") in _FINISHED_POD_PHASES:
            return {}
        try:
            mounts = injection.requested_mounts(meta)
        except Exception:  # a malformed label on someone's pod must not stop indexing
            return {}
        return {(namespace or "", mount): name for mount in mounts}

    @kopf.on.resume(*RESOURCE, id="resolve", registry=registry)
    @kopf.on.create(*RESOURCE, id="resolve", registry=registry)
    @kopf.on.update(*RESOURCE, id="resolve", field="spec", registry=registry)
    async def resolve(
        body: kopf.Body,
        patch: kopf.Patch,
        retry: int,
        namespace: str | None,
        name: str,
        **kwargs: Any,
    ) -> None:
        """Resolve and pin the manifest; failures become status, Events and retries."""
        ns = namespace or ""
        started = time.monotonic()
        result = await reconcile.reconcile(
            body,
            read_secret=ctx.api.read_secret,
            resolve=ctx.resolve,
            probe=ctx.probe,
            now=now_text(),
            retry=retry,
            backoff=backoff,
            timeout=ctx.settings.resolve_timeout_seconds,
        )
        new_status = dict(result.status)
        new_status["attachedPods"] = attached_count(kwargs[INDEX], ns, name)
        patch.status.update(new_status)
        metrics.RECONCILE_DURATION.observe(time.monotonic() - started)
        metrics.RECONCILE_TOTAL.labels(phase=new_status["phase"]).inc()
        metrics.PHASES.set(ns, name, new_status["phase"])
        if isinstance(result.outcome, status.Failed):
            metrics.SOURCE_ERRORS_TOTAL.labels(reason=result.outcome.reason).inc()
        for event in result.events:
            kopf.event(body, type=event.type, reason=event.reason, message=event.message)
        if result.retry_in is not None:
            assert isinstance(result.outcome, status.Failed)
            raise kopf.TemporaryError(result.outcome.message, delay=result.retry_in)

    @kopf.timer(
        *RESOURCE,
        interval=ctx.settings.source_check_seconds,
        initial_delay=ctx.settings.source_check_seconds,
        id="check-source",
        registry=registry,
    )
    async def check_source(
        *,
        body: kopf.Body,
        patch: kopf.Patch,
        namespace: str | None,
        name: str,
        **_: Any,
    ) -> None:
        """Ready <-> Degraded as the source of a pinned mount goes away and comes back."""
        result = await reconcile.check_source(
            body,
            read_secret=ctx.api.read_secret,
            probe=ctx.probe,
            now=now_text(),
            timeout=ctx.settings.resolve_timeout_seconds,
        )
        if result is None:
            return
        before = body.get("status") or {}
        changed = {k: v for k, v in result.status.items() if before.get(k) != v}
        if changed:
            patch.status.update(changed)
        metrics.PHASES.set(namespace or "", name, result.status["phase"])
        if isinstance(result.outcome, status.Failed):
            metrics.SOURCE_ERRORS_TOTAL.labels(reason=result.outcome.reason).inc()
        for event in result.events:
            kopf.event(body, type=event.type, reason=event.reason, message=event.message)

    @kopf.timer(
        *RESOURCE,
        interval=ctx.settings.pods_interval_seconds,
        initial_delay=ctx.settings.pods_interval_seconds,
        id="count-pods",
        registry=registry,
    )
    def count_pods(
        *,
        body: kopf.Body,
        patch: kopf.Patch,
        namespace: str | None,
        name: str,
        **kwargs: Any,
    ) -> None:
        """Keep status.attachedPods current (the Pods printer column)."""
        ns = namespace or ""
        count = attached_count(kwargs[INDEX], ns, name)
        metrics.ATTACHED_PODS.labels(namespace=ns, datasetmount=name).set(count)
        if (body.get("status") or {}).get("attachedPods") != count:
            patch.status["attachedPods"] = count

    @kopf.on.delete(*RESOURCE, id="finalize", registry=registry)
    def finalize(
        *,
        body: kopf.Body,
        patch: kopf.Patch,
        namespace: str | None,
        name: str,
        annotations: kopf.Annotations,
        **kwargs: Any,
    ) -> None:
        """Hold the finalizer while unfinished pods still use this mount.

        Running sidecars carry everything they need in their env, so they would keep
        working; the wait makes a deletion visible instead of silently leaving pods
        on a dataset that is no longer declared. Node cache files are not removed:
        they are content-addressed and the disk tier's LRU reclaims them.
        """
        ns = namespace or ""
        count = attached_count(kwargs[INDEX], ns, name)
        forced = annotations.get(ANNOTATION_FORCE_DELETE) == "true"
        if count and not forced:
            patch.status["phase"] = status.TERMINATING
            patch.status["attachedPods"] = count
            message = (
                f"waiting for {count} pod(s) using DatasetMount {ns}/{name} to finish; "
                f"annotate it {ANNOTATION_FORCE_DELETE}=true to delete it now"
            )
            if (body.get("status") or {}).get("phase") != status.TERMINATING:
                kopf.event(body, type="Normal", reason="WaitingForPods", message=message)
            metrics.PHASES.set(ns, name, status.TERMINATING)
            raise kopf.TemporaryError(message, delay=ctx.settings.deletion_poll_seconds)
        metrics.PHASES.set(ns, name, None)
        logger.info("DatasetMount %s/%s released (%d attached pods)", ns, name, count)
