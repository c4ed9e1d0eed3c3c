"""/healthz, /readyz and /metrics of the operator process (aiohttp, plain HTTP)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp.web

from shardcache_operator import metrics


def _no_note() -> str | None:
    return None


def application(
    ready: asyncio.Event,
    meters: metrics.Metrics,
    *,
    note: Callable[[], str | None] = _no_note,
) -> aiohttp.web.Application:
    """`ready` is set once kopf has started (watching, peering) and, where the operator
    serves the webhook, its server listens (`app.run`). `note` says what the operator
    does not do while ready: an installed CRD older than itself stops its reconciling but
    not its webhook, which the chart's Service reaches through ready replicas only, so
    the answer stays 200 and the body says why and what to run (`crd_version`)."""

    async def healthz(_: aiohttp.web.Request) -> aiohttp.web.Response:
        # Answering at all proves the event loop is not stuck.
        return aiohttp.web.Response(text="ok\n")

    async def readyz(_: aiohttp.web.Request) -> aiohttp.web.Response:
        if ready.is_set():
            problem = note()
            if problem:
                return aiohttp.web.Response(text=f"ready (webhook only): {problem}\n")
            return aiohttp.web.Response(text="ready\n")
        return aiohttp.web.Response(status=503, text="starting\n")

    async def metrics_view(_: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.Response(
            body=meters.exposition(), headers={"Content-Type": metrics.CONTENT_TYPE}
        )

    app = aiohttp.web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_view)
    return app


async def start(
    addr: str,
    port: int,
    ready: asyncio.Event,
    meters: metrics.Metrics,
    *,
    note: Callable[[], str | None] = _no_note,
) -> aiohttp.web.AppRunner:
    """Serve on addr:port until the returned runner is cleaned up."""
    runner = aiohttp.web.AppRunner(application(ready, meters, note=note), access_log=None)
    await runner.setup()
    await aiohttp.web.TCPSite(runner, addr, port).start()
    return runner
