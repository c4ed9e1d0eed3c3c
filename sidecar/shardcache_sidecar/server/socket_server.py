"""The control socket's server: a lean HTTP/1.1 protocol for the control routes, aiohttp
for everything else, on the one Unix socket.

Why: with eight or sixteen ranks on one sidecar every rank's control requests queue on
one event loop, and aiohttp's per-request machinery (its parser's message objects, the
request and response objects, routing, middleware, header writing, a task per request)
was about half of the sidecar's CPU per request (docs/benchmarks.md, "One node, many
ranks"). The trainer's client (`shardcache.unix_http`) speaks a small, regular subset of
HTTP/1.1: one request at a time on a kept-alive connection, a JSON body framed by
Content-Length, a plain path. This protocol parses exactly that, calls the route
(`control.TABLE`, `probes.TABLE`: the same calls aiohttp serves) and writes the answer in one write.

Anything else hands the connection over to aiohttp's own protocol, together with the
bytes read so far, and aiohttp serves that connection from then on: a route not in the
table (/metrics, /v1/status, an unknown path: its JSON 404), another
HTTP version, a chunked body, `Expect`, `Upgrade`, a target with a query string or
percent-escapes. So every client and tool that talked to the aiohttp server is served as
before, and the wire format (docs/wire-format.md) does not change: same routes, same
bodies, same errors.

What this protocol refuses itself, with a JSON error body (`protocol.error_body`, kind
`input`) and by closing that connection (its framing cannot be trusted after): a request
line or header line it cannot parse (400), a header block over `MAX_HEAD_BYTES` (431), a
body over `MAX_BODY_BYTES` (413). Every other connection goes on being served.

Connections are not timed out while idle: a rank keeps a few open for its lifetime, and
the kernel closes them when it exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
import os
from collections.abc import Callable, Iterable
from typing import cast

from shardcache.contract import protocol
from shardcache_sidecar.server import (
    control,
    eager,
    lifecycle,
    probes,
    replies,
    routing,
    service_times,
)

log = logging.getLogger("shardcache_sidecar.server")

#: A request's header block larger than this is refused (aiohttp's limit is 8 KiB per
#: line; a control request's whole block is about 150 bytes).
MAX_HEAD_BYTES = 64 * 1024
#: A request body larger than this is refused: aiohttp's default `client_max_size`, which
#: the control routes were served under (a notes batch of 10,000 leases is ~400 KB).
MAX_BODY_BYTES = 1024 * 1024
#: Pending connections the listening socket queues (aiohttp's UnixSite default).
BACKLOG = 128
#: The metrics label of a request refused before any route matched it (aiohttp's).
UNMATCHED = "unmatched"

_KEEP = b""
_CLOSE = b"Connection: close\r\n"
#: Characters after which a target is not a plain path (query, fragment, escapes), or
#: not one aiohttp's `{name}` would match: such requests are aiohttp's to serve.
_NOT_PLAIN = (b"?", b"%", b"#", b"{", b"}")


class Routes:
    """The routes as a lookup from (method, path) to (route, the path's id)."""

    def __init__(self, routes: Iterable[routing.Route]) -> None:
        self._table: dict[tuple[bytes, bytes], routing.Route] = {}
        for route in routes:
            parts = route.template.encode("ascii").split(b"/")
            variable = [i for i, part in enumerate(parts) if part.startswith(b"{")]
            # The one variable part, if any, is the 4th: /v1/readers/{reader_id}/...
            assert variable in ([], [3]), route.template
            if variable:
                parts[3] = b"{}"
            self._table[(route.method.encode("ascii"), b"/".join(parts))] = route

    def match(self, method: bytes, target: bytes) -> tuple[routing.Route, str] | None:
        """The route and the path's id ("" if none), or None: not ours to serve."""
        for char in _NOT_PLAIN:
            if char in target:
                return None
        parts = target.split(b"/")
        ident = b""
        if len(parts) > 3:
            ident = parts[3]
            if not ident:
                return None
            parts[3] = b"{}"
        route = self._table.get((method, b"/".join(parts)))
        if route is None:
            return None
        try:
            return route, ident.decode("ascii")
        except UnicodeDecodeError:
            return None


class _Refused(Exception):
    """A request this protocol cannot parse: answered with `status` and closed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _HandOver(Exception):
    """A request that is aiohttp's to serve."""


class _Request:
    __slots__ = ("close", "ident", "method", "route", "target")

    def __init__(
        self, route: routing.Route, ident: str, method: bytes, target: bytes, close: bool
    ) -> None:
        self.route, self.ident, self.method, self.target, self.close = (
            route,
            ident,
            method,
            target,
            close,
        )


class Parser:
    """Request heads into `_Request`s, for the routes given.

    A client sends the same header lines with every request but for Content-Length (the
    control client: Host, Accept, Connection, Content-Length, Content-Type), and a rank
    the same few request lines (its reader's `notes`, `acquire`), so what a request
    line and what a header block say are remembered by their bytes: a request's head is
    then two dict lookups. Why: at an idle sidecar every step of a request runs with
    cold caches, and matching the route (splitting, joining, scanning the target) cost
    more than the rest of the head (docs/benchmarks.md, "CPU per control request,
    session 17"). Only what parsed is remembered, at most `KEPT` lines (of at most
    `LINE_KEPT` bytes) and `KEPT` blocks: a line refused or of another HTTP version, and
    a block refused or handed over, are looked at again every time; a line whose route
    is not in the table is remembered as aiohttp's."""

    KEPT = 256
    #: A control request line is under 100 bytes: longer ones are parsed every time
    #: rather than kept (`KEPT` of them up to `MAX_HEAD_BYTES` each would be 16 MiB).
    LINE_KEPT = 512

    def __init__(self, routes: Routes) -> None:
        self.routes = routes
        self._lines: dict[bytes, tuple[bytes, bytes, tuple[routing.Route, str] | None]] = {}
        self._headers: dict[bytes, tuple[int, bool]] = {}

    def parse(self, head: bytes) -> tuple[_Request, int]:
        """The request and its body's length, from its header block (without the blank
        line). Raises `_Refused` for what is not HTTP, `_HandOver` for what is
        aiohttp's."""
        line_end = head.find(b"\r\n")
        line = head if line_end < 0 else head[:line_end]
        said_line = self._lines.get(line)
        if said_line is None:
            said_line = self._request_line(line)
            if len(line) <= self.LINE_KEPT:
                if len(self._lines) >= self.KEPT:
                    self._lines.clear()
                self._lines[line] = said_line
        method, target, matched = said_line
        block = b"" if line_end < 0 else head[line_end + 2 :]
        said = self._headers.get(block)
        if said is None:
            said = _header_block(block)
            if len(self._headers) >= self.KEPT:
                self._headers.clear()
            self._headers[block] = said
        length, close = said
        if matched is None:
            raise _HandOver
        if length > MAX_BODY_BYTES:
            raise _Refused(
                413,
                f"request body of {length} bytes: the control API takes at most {MAX_BODY_BYTES}",
            )
        return _Request(matched[0], matched[1], method, target, close), length

    def _request_line(self, line: bytes) -> tuple[bytes, bytes, tuple[routing.Route, str] | None]:
        """(method, target, the route and the path's id or None: aiohttp's route) of a
        request line. Raises `_Refused` for what is not HTTP, `_HandOver` for another
        HTTP version."""
        parts = line.split(b" ")
        if len(parts) != 3 or not parts[0] or not parts[1].startswith(b"/"):
            raise _Refused(400, f"malformed request line {line[:200]!r}")
        method, target, version = parts
        if version != b"HTTP/1.1":
            if version.startswith(b"HTTP/1."):
                raise _HandOver  # 1.0's keep-alive rules: aiohttp's
            raise _Refused(400, f"malformed request line {line[:200]!r}")
        return method, target, self.routes.match(method, target)


def _header_block(block: bytes) -> tuple[int, bool]:
    """(the body's length, whether the client closes after) from the header lines."""
    length: int | None = None
    close = False
    for line in block.split(b"\r\n") if block else ():
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip():
            raise _Refused(400, f"malformed header line {line[:200]!r}")
        key = name.lower()
        if key == b"content-length":
            text = value.strip()
            if not text.isdigit() or (length is not None and int(text) != length):
                raise _Refused(400, f"bad Content-Length {text[:40]!r}")
            length = int(text)
        elif key == b"connection":
            tokens = value.lower()
            if b"upgrade" in tokens:
                raise _HandOver
            close = b"close" in tokens
        elif key in (b"transfer-encoding", b"expect", b"upgrade"):
            raise _HandOver
    return length or 0, close


def _status_line(status: int) -> bytes:
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = "Unknown"
    return f"HTTP/1.1 {status} {phrase}\r\n".encode("ascii")


_STATUS_LINES = {status.value: _status_line(status.value) for status in http.HTTPStatus}


def response_bytes(reply: replies.Answer, *, close: bool) -> bytes:
    """The whole answer: status line, headers, JSON body."""
    status = _STATUS_LINES.get(reply.status) or _status_line(reply.status)
    return b"%sContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s" % (
        status,
        len(reply.body),
        _CLOSE if close else _KEEP,
        reply.body,
    )


class Connection(asyncio.Protocol):
    """One client connection: requests in order, one at a time, until it closes or is
    handed to aiohttp."""

    def __init__(self, server: Server) -> None:
        self._server = server
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        #: The request being answered (a task: the call may wait in the thread pool).
        self.task: asyncio.Future[None] | None = None
        self._paused = False
        #: True while `_next` starts a request's task: an answer written meanwhile was
        #: written inside `data_received`, without waiting (`service_times`).
        self._starting = False

    # --- asyncio.Protocol ---------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self._server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        # An answer still being computed is dropped when done (as aiohttp does: the
        # call is not cancelled, a lease it took is released by the hand-over timeout).
        self._transport = None
        self._server.connections.discard(self)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if self.task is None:
            self._next()
        elif len(self._buffer) > MAX_HEAD_BYTES + MAX_BODY_BYTES and self._transport:
            # A client that does not wait for answers: stop reading until we catch up.
            self._transport.pause_reading()
            self._paused = True

    # --- requests -----------------------------------------------------------------
    def _next(self) -> None:
        """Answer the next complete request in the buffer, if any."""
        transport = self._transport
        if transport is None or transport.is_closing() or self.task is not None:
            return
        if self._paused:
            transport.resume_reading()
            self._paused = False
        end = self._buffer.find(b"\r\n\r\n")
        # The limit holds for a block that arrived whole in one read too, not only for
        # one still coming: what is over it is neither parsed nor kept by the parser.
        # (Without the blank line yet, the buffer's last 3 bytes may be its start.)
        if end > MAX_HEAD_BYTES or (end < 0 and len(self._buffer) > MAX_HEAD_BYTES + 3):
            self._refuse(431, f"request header block over {MAX_HEAD_BYTES} bytes")
            return
        if end < 0:
            return
        try:
            request, length = self._server.parser.parse(bytes(self._buffer[:end]))
        except _Refused as exc:
            self._refuse(exc.status, str(exc))
            return
        except _HandOver:
            self._hand_over()
            return
        start = end + 4
        if len(self._buffer) < start + length:
            return  # the body is still coming
        raw = bytes(self._buffer[start : start + length])
        del self._buffer[: start + length]
        timer = self._server.timer
        clock = None if timer is None else service_times.Request(timer)
        self._starting = True
        # Most calls never wait: run them now instead of scheduling a first step.
        task = eager.start(self._answer(request, raw, clock))
        self._starting = False
        if task is None:
            self._after(request.close)
        else:
            self.task = task
            task.add_done_callback(lambda _: self._after(request.close))

    async def _answer(
        self, request: _Request, raw: bytes, clock: service_times.Request | None
    ) -> None:
        sidecar = self._server.sidecar
        if clock is not None:
            clock.start()
        try:
            reply = await request.route.call(sidecar, request.ident, raw)
        except Exception as exc:
            method, target = request.method.decode(), request.target.decode("latin-1")
            reply = replies.error_answer(replies.refusal(exc, method, target))
        sidecar.metrics.request(request.route.template, reply.status)
        transport = self._transport
        if transport is not None and not transport.is_closing():
            transport.write(response_bytes(reply, close=request.close))
        if clock is not None:
            clock.waited = not self._starting
            clock.done(request.route.template, reply.status)

    def _after(self, close: bool) -> None:
        """What follows an answer: closing, or the next request already buffered."""
        self.task = None
        transport = self._transport
        if transport is None:
            return
        if close:
            transport.close()
        elif self._buffer or self._paused:
            # A request sent before this answer (pipelined): on the next loop turn, so
            # a client sending many never nests these calls.
            asyncio.get_running_loop().call_soon(self._next)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def _refuse(self, status: int, message: str) -> None:
        transport = self._transport
        assert transport is not None
        log.warning("control socket: %s; closing the connection", message)
        self._server.sidecar.metrics.request(UNMATCHED, status)
        body = protocol.error_body(protocol.KIND_INPUT, protocol.CODE_BAD_REQUEST, message)
        transport.write(response_bytes(replies.answer(body, status), close=True))
        self._buffer.clear()
        transport.close()

    def _hand_over(self) -> None:
        """aiohttp serves this connection from now on, from the request in the buffer."""
        transport = self._transport
        assert transport is not None
        handler = self._server.fallback()
        data = bytes(self._buffer)
        self._buffer.clear()
        self._transport = None
        self._server.connections.discard(self)
        transport.set_protocol(handler)
        handler.connection_made(transport)
        if data:
            handler.data_received(data)


class Server:
    """The control socket: `Connection`s, handing over to `fallback` (aiohttp's
    protocol factory, `web.AppRunner.server`) what is not theirs."""

    def __init__(
        self, sidecar: lifecycle.Sidecar, fallback: Callable[[], asyncio.Protocol]
    ) -> None:
        self.sidecar = sidecar
        self.fallback = fallback
        self.parser = Parser(Routes(control.TABLE + probes.TABLE))
        self.connections: set[Connection] = set()
        self._server: asyncio.AbstractServer | None = None
        #: Slow requests and loop stalls are logged when DEBUG is on at start.
        self.timer: service_times.Timer | None = None

    async def start(self, path: str | os.PathLike[str]) -> None:
        loop = asyncio.get_running_loop()
        if service_times.enabled():
            self.timer = service_times.Timer(loop)
        self._server = await loop.create_unix_server(
            lambda: Connection(self), os.fspath(path), backlog=BACKLOG
        )

    async def close(self, timeout: float) -> None:
        """Stop listening; give answers in progress `timeout` seconds, then cancel them
        and close every connection still ours (aiohttp closes those it took over)."""
        if self._server is not None:
            self._server.close()
        if self.timer is not None:
            self.timer.close()
            self.timer = None
        pending = [c.task for c in self.connections if c.task is not None]
        if pending:
            _, late = await asyncio.wait(pending, timeout=timeout)
            for task in late:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*late, return_exceptions=True)
        for connection in list(self.connections):
            connection.close()
