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
from shardcache_sidecar.server import lifecycle, replies, routing

ROUTES = web.RouteTableDef()


_ALIVE = replies.answer({"status": "alive", "version": protocol.VERSION})


async def healthz(sidecar: lifecycle.Sidecar, _: str, raw: bytes) -> replies.Answer:
    return _ALIVE


async def readyz(sidecar: lifecycle.Sidecar, _: str, raw: bytes) -> replies.Answer:
    report = sidecar.readiness.report()
    return replies.answer(report, 200 if report["ready"] else 503)


#: The probes the control socket's lean transport answers too (`socket_server`);
#: /metrics renders in a thread and stays aiohttp's.
TABLE: tuple[routing.Route, ...] = (
    routing.Route("GET", protocol.HEALTHZ, healthz),
    routing.Route("GET", protocol.READYZ, readyz),
)
routing.add(ROUTES, TABLE)


@ROUTES.get(protocol.METRICS)
async def metrics_page(request: web.Request) -> web.Response:
    sidecar = request.app[lifecycle.SIDECAR]
    body = await asyncio.get_running_loop().run_in_executor(None, sidecar.metrics.render)
    return web.Response(body=body, headers={"Content-Type": metrics.CONTENT_TYPE})
