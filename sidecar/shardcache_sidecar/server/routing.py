"""A route as both transports of the control socket serve it.

A `Route` is a method, a path template and a call of (the sidecar, the id in the path,
the raw request body) answering a `replies.Answer`. `socket_server` looks the call up
and runs it itself; `aiohttp_handler` wraps the same call as an aiohttp handler, for the
TCP probe port and for connections `socket_server` hands over. One call, two transports:
what a route answers cannot differ between them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable

from aiohttp import web

from shardcache_sidecar.server import lifecycle, replies

#: A route's call: (the sidecar, the id in its path or "", the raw request body).
Call = Callable[[lifecycle.Sidecar, str, bytes], Awaitable[replies.Answer]]


@dataclasses.dataclass(frozen=True)
class Route:
    """One route of the control socket."""

    method: str
    #: aiohttp's canonical form, which is also the route's metrics label:
    #: `/v1/readers/{reader_id}/acquire`. At most one `{...}` part, the path's 4th.
    template: str
    call: Call


def aiohttp_handler(route: Route) -> Callable[[web.Request], Awaitable[web.Response]]:
    """`route.call` as an aiohttp handler (errors are the app's middleware's to answer)."""

    async def handle(request: web.Request) -> web.Response:
        ident = next(iter(request.match_info.values()), "")
        raw = await request.read()
        return replies.response(await route.call(request.app[lifecycle.SIDECAR], ident, raw))

    handle.__name__ = handle.__qualname__ = getattr(route.call, "__name__", "handle")
    return handle


def add(table: web.RouteTableDef, routes: tuple[Route, ...]) -> None:
    """Register `routes` in aiohttp's `table`."""
    for route in routes:
        table.route(route.method, route.template)(aiohttp_handler(route))
