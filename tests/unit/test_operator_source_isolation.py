"""One namespace's sources cannot starve another's through the operator (docs/security.md,
"Starve other namespaces through the operator's reads").

Tenant A's DatasetMounts name a store that never answers (a bucket endpoint of its own
that trickles its reply: every socket timeout passes). Their resolves time out, but the
threads reading them cannot be stopped. Before, those threads were the event loop's
default executor's, which the operator's API reads and the webhook share: as many hung
resolves as it has workers (min(32, CPUs + 4)) left tenant B's resolve and every API
read queued behind them. The handlers are called as kopf calls them, with the loop's
real default executor.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import kopf
import kubernetes
import pytest
from shardcache_operator import configuration, context, handlers, kube, reconcile, specs

from tests.unit.test_operator_handlers import FakeApi, FakeManifest, capture_events

pytestmark = pytest.mark.unit

#: Seconds a resolve may take (the operator's RESOLVE_TIMEOUT_SECONDS, 600 by default).
TIMEOUT = 2.0
#: The workers of an event loop's default executor (`concurrent.futures.ThreadPoolExecutor`).
EXECUTOR_WORKERS = min(32, (os.cpu_count() or 1) + 4)


@dataclasses.dataclass
class Stores:
    """Tenant A's store answers nothing until `released`; tenant B's answers at once."""

    released: threading.Event = dataclasses.field(default_factory=threading.Event)

    def resolve(self, uri: str, fmt: str, options: Mapping[str, str] | None) -> FakeManifest:
        if uri.startswith("s3://tenant-a/"):
            self.released.wait()
        return FakeManifest()

    def probe(self, uri: str, options: Mapping[str, str] | None) -> None:
        if uri.startswith("s3://tenant-a/"):
            self.released.wait()


@contextlib.contextmanager
def hanging() -> Iterator[Stores]:
    """Stores whose hung reads end with the test body: before its loop closes, which
    waits for its default executor's threads."""
    held = Stores()
    try:
        yield held
    finally:
        held.released.set()


def mount(namespace: str, name: str, bucket: str) -> kopf.Body:
    return kopf.Body(
        {
            "apiVersion": "shardcache.io/v1alpha1",
            "kind": "DatasetMount",
            "metadata": {"name": name, "namespace": namespace, "generation": 1, "uid": name},
            "spec": {"source": {"uri": f"s3://{bucket}/data/", "secretRef": {"name": "creds"}}},
        }
    )


def operator(stores: Stores, *, timeout: float = TIMEOUT) -> context.Context:
    settings = configuration.Settings(resolve_timeout_seconds=timeout)
    return context.Context(
        settings=settings, api=FakeApi(), resolve=stores.resolve, probe=stores.probe
    )


async def resolve(ctx: context.Context, body: kopf.Body) -> kopf.Patch:
    """kopf's call of the resolve handler: the status patch it writes, retry or not."""
    patch = kopf.Patch()
    metadata = body["metadata"]
    # A failure is retried (TemporaryError); its status is in the patch.
    with contextlib.suppress(kopf.TemporaryError):
        await handlers.resolve(
            body=body,
            patch=patch,
            retry=0,
            namespace=metadata["namespace"],
            name=metadata["name"],
            memo=ctx,
        )
    return patch


async def hang_tenant_a(ctx: context.Context) -> list[kopf.Patch]:
    """As many of tenant A's mounts as the default executor has workers, and one more,
    resolved until each gives up."""
    bodies = [mount("tenant-a", f"data-{i}", "tenant-a") for i in range(EXECUTOR_WORKERS + 1)]
    return list(await asyncio.gather(*(resolve(ctx, body) for body in bodies)))


async def test_a_namespace_whose_store_never_answers_does_not_delay_another_namespaces_resolve() -> (
    None
):
    capture_events()
    with hanging() as stores:
        ctx = operator(stores)
        hung = await hang_tenant_a(ctx)
        assert {patch.status["phase"] for patch in hung} == {"Degraded"}
        patch = await resolve(ctx, mount("tenant-b", "data", "tenant-b"))
    assert patch.status["phase"] == "Ready", patch.status.get("conditions")


async def test_a_namespace_whose_store_never_answers_leaves_the_operators_api_reads_free() -> None:
    """The reads the webhook makes at admission (a namespace's UID) and the handlers
    (Secrets, Events) run on the loop's default executor; tenant A's hung reads must not
    hold it."""
    capture_events()

    class Namespaces:
        def read_namespace(self, name: str, **_: Any) -> Any:
            return kubernetes.client.V1Namespace(
                metadata=kubernetes.client.V1ObjectMeta(name=name, uid="uid-of-" + name)
            )

    api = kube.Api(kubernetes.client.ApiClient())
    api._core = Namespaces()  # type: ignore[assignment]
    with hanging() as stores:
        await hang_tenant_a(operator(stores))
        try:
            uid = await asyncio.wait_for(api.read_namespace_uid("tenant-b"), TIMEOUT)
        except TimeoutError:
            uid = None  # queued behind tenant A's reads
    assert uid == "uid-of-tenant-b"


async def test_a_pinned_mounts_checks_of_a_store_that_never_answers_do_not_hold_the_executor() -> (
    None
):
    """The periodic source check of one pinned mount leaves a hung probe behind at each
    round; as many rounds as the executor has workers, then tenant B's resolve."""
    capture_events()
    pinned = dict(mount("tenant-a", "data", "tenant-a"))
    source = reconcile.source_identity(specs.parse_spec(pinned["spec"]))
    pinned["status"] = {
        "phase": "Ready",
        "manifestDigest": FakeManifest().digest,
        "resolvedSource": source,
    }
    with hanging() as stores:
        ctx = operator(stores, timeout=0.5)
        checked = kopf.Patch()
        for _ in range(EXECUTOR_WORKERS + 1):
            checked = kopf.Patch()
            await handlers.check_source(body=kopf.Body(pinned), patch=checked, memo=ctx)
        assert checked.status["phase"] == "Degraded"
        patch = await resolve(ctx, mount("tenant-b", "data", "tenant-b"))
    assert patch.status["phase"] == "Ready", patch.status.get("conditions")
