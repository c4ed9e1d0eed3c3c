"""The probe routes, served on the control socket and on the TCP port alike.

GET /healthz   alive (200 while the process serves at all)
GET /readyz    200 once every readiness gate is open, else 503 with the reasons
GET /metrics   Prometheus text format
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from shardcache.contract import protocol
from shardcache_sidecar import metrics
from shardcache_sidecar.server import lifecycle, replies

ROUTES = web.RouteTableDef()


@ROUTES.get(protocol.HEALTHZ)
async def healthz(request: web.Request) -> web.Response:
    return replies.json_response({"status": "alive", "version": protocol.VERSION})


@ROUTES.get(protocol.READYZ)
async def readyz(request: web.Request) -> web.Response:
    report = request.app[lifecycle.SIDECAR].readiness.report()
    return replies.json_response(report, 200 if report["ready"] else 503)


@ROUTES.get(protocol.METRICS)
async def metrics_page(request: web.Request) -> web.Response:
    sidecar = request.app[lifecycle.SIDECAR]
    body = await asyncio.get_running_loop().run_in_executor(None, sidecar.metrics.render)
    return web.Response(body=body, headers={"Content-Type": metrics.CONTENT_TYPE})
