"""An HTTP-aware TCP proxy on loopback that injects faults in front of an S3 server.

Point a client at `proxy.endpoint_url` instead of the server's. The proxy reads each
HTTP/1.1 request head from the client (so it can count requests and pick faults per
request), streams the body on, and pumps the server's answers back as raw bytes. Clients
do not pipeline, so by the time a new request head arrives on a connection the previous
answer is complete, and the proxy may answer that request itself.

Faults (each takes effect from the next request, thread-safe):
  fail_next(n)            answer the next n requests with a 503 S3 error (SlowDown) body
  stall_next(n, seconds)  hold the next n requests that long before forwarding them
  refuse_connections()    close the listening socket and reset open connections, until
  accept_connections()    listens again on the same port
  break_next(n, kind, target_contains="")
                          answer the next n GETs whose target contains that text with the
                          server's real answer, broken as a real network breaks it:
      "reset"     the head and half the body, then a TCP reset
      "truncate"  the head (its Content-Length still the real one) and half the body,
                  then an orderly close
      "drip"      the body one byte every 2 s, far below any sane throughput
      "corrupt"   a 200 with the right Content-Length and other bytes (bit flips)

The S3 signature covers the Host header the client sent; the proxy forwards the head
unchanged, and the server checks the signature against that same header, so signed
requests pass through.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from collections.abc import Coroutine

HEAD_LIMIT = 64 * 1024
COPY_CHUNK = 64 * 1024
CLOSE_TIMEOUT_S = 10.0
# A drip: one byte every 2 s. S3 clients (the AWS SDK under pyarrow) give up on a body
# slower than 1 byte/s for their request timeout; a client with a timeout below 2 s must
# time out and retry rather than wait out the whole body.
DRIP_BYTES = 1
DRIP_INTERVAL_S = 2.0
BREAKS = ("reset", "truncate", "drip", "corrupt")

SLOWDOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n'
    b"<Error><Code>SlowDown</Code>"
    b"<Message>Please reduce your request rate (injected by the test fault proxy).</Message>"
    b"<Resource>/</Resource><RequestId>faultproxy</RequestId></Error>"
)


@dataclasses.dataclass
class RequestHead:
    method: str
    target: str
    headers: dict[str, str]
    raw: bytes

    @property
    def expects_continue(self) -> bool:
        return self.headers.get("expect", "").lower() == "100-continue"


def parse_request_head(raw: bytes) -> RequestHead:
    """Parse `METHOD target HTTP/1.x` and headers; header names are lower-cased."""
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise ValueError(f"expected an HTTP/1.x request line, found {lines[0]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise ValueError(f"expected 'Name: value' header, found {line!r}")
        headers[name.strip().lower()] = value.strip()
    return RequestHead(parts[0], parts[1], headers, raw)


def split_response(raw: bytes) -> tuple[bytes, int]:
    """(head, Content-Length) of a response head read up to its blank line."""
    for line in raw.decode("latin-1").split("\r\n")[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            return raw, int(value.strip())
    raise ValueError(f"response without Content-Length: {raw[:200]!r}")


def corrupted(body: bytes) -> bytes:
    """Same length, other bytes: one bit flipped in every 64th byte from the middle on."""
    out = bytearray(body)
    for i in range(len(out) // 2, len(out), 64):
        out[i] ^= 0x10
    return bytes(out)


def error_response(status: int, body: bytes) -> bytes:
    reason = {500: "Internal Server Error", 503: "Service Unavailable"}.get(status, "Error")
    head = (
        f"HTTP/1.1 {status} {reason}\r\n"
        "Content-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body


class FaultProxy:
    def __init__(self, upstream_host: str, upstream_port: int, host: str = "127.0.0.1") -> None:
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self.host = host
        self.port = 0
        self._lock = threading.Lock()
        self._fail_remaining = 0
        self._fail_status = 503
        self._stall_remaining = 0
        self._stall_seconds = 0.0
        self._requests_seen = 0
        self._faults_injected = 0
        self._stalls_injected = 0
        self._break_remaining = 0
        self._break_kind = ""
        self._break_target = ""
        self._breaks_injected = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    # -- control, from the test's thread -------------------------------------------------

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def requests_seen(self) -> int:
        """Request heads received from clients, faulted ones included."""
        with self._lock:
            return self._requests_seen

    @property
    def faults_injected(self) -> int:
        """Requests answered with an injected error status."""
        with self._lock:
            return self._faults_injected

    @property
    def stalls_injected(self) -> int:
        with self._lock:
            return self._stalls_injected

    def fail_next(self, count: int, status: int = 503) -> None:
        with self._lock:
            self._fail_remaining = count
            self._fail_status = status

    @property
    def breaks_injected(self) -> int:
        """Answers broken by `break_next`."""
        with self._lock:
            return self._breaks_injected

    def break_next(self, count: int, kind: str, target_contains: str = "") -> None:
        if kind not in BREAKS:
            raise ValueError(f"break kind must be one of {BREAKS}, found {kind!r}")
        with self._lock:
            self._break_remaining = count
            self._break_kind = kind
            self._break_target = target_contains

    def stall_next(self, count: int, seconds: float) -> None:
        with self._lock:
            self._stall_remaining = count
            self._stall_seconds = seconds

    def clear_faults(self) -> None:
        with self._lock:
            self._fail_remaining = 0
            self._stall_remaining = 0
            self._break_remaining = 0

    def start(self) -> None:
        self._thread.start()
        self._call(self._listen())

    def refuse_connections(self) -> None:
        self._call(self._stop_listening())

    def accept_connections(self) -> None:
        self._call(self._listen())

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        self._call(self._stop_listening())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=CLOSE_TIMEOUT_S)
        self._loop.close()

    def _call(self, coro: Coroutine[object, object, None]) -> None:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        future.result(timeout=CLOSE_TIMEOUT_S)

    # -- the proxy, on its own event loop ------------------------------------------------

    async def _listen(self) -> None:
        if self._server is not None:
            return
        # The first listen picks a free port; later ones (after refuse) reuse it, so the
        # client's endpoint stays valid.
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def _stop_listening(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for writer in list(self._writers):
            # abort() sends a reset: a client mid-request sees its connection fail now.
            writer.transport.abort()
        self._writers.clear()
        # Stalled requests too: nothing of a refused era may reach the server later.
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if server is not None:
            await server.wait_closed()

    def _take_fault(self) -> tuple[int, float]:
        """(error status or 0, stall seconds or 0) for the request just received."""
        with self._lock:
            self._requests_seen += 1
            if self._fail_remaining > 0:
                self._fail_remaining -= 1
                self._faults_injected += 1
                return self._fail_status, 0.0
            if self._stall_remaining > 0:
                self._stall_remaining -= 1
                self._stalls_injected += 1
                return 0, self._stall_seconds
            return 0, 0.0

    def _take_break(self, head: RequestHead) -> str:
        """The break to apply to the answer of `head`, or ""."""
        with self._lock:
            if (
                self._break_remaining > 0
                and head.method == "GET"
                and self._break_target in head.target
            ):
                self._break_remaining -= 1
                self._breaks_injected += 1
                return self._break_kind
            return ""

    async def _broken_answer(
        self, head: RequestHead, kind: str, writer: asyncio.StreamWriter
    ) -> None:
        """Fetch the real answer on a connection of its own, then send it on broken."""
        up_reader, up_writer = await asyncio.open_connection(self.upstream_host, self.upstream_port)
        try:
            up_writer.write(head.raw)
            await up_writer.drain()
            resp_head, length = split_response(await up_reader.readuntil(b"\r\n\r\n"))
            body = await up_reader.readexactly(length)
        finally:
            up_writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await up_writer.wait_closed()
        if kind == "corrupt":
            writer.write(resp_head + corrupted(body))
            await writer.drain()
            return
        if kind == "drip":
            writer.write(resp_head)
            for i in range(0, len(body), DRIP_BYTES):
                writer.write(body[i : i + DRIP_BYTES])
                await writer.drain()
                await asyncio.sleep(DRIP_INTERVAL_S)
            return
        writer.write(resp_head + body[: len(body) // 2])
        await writer.drain()
        if kind == "reset":
            writer.transport.abort()
        else:  # truncate: an orderly close, short of the promised length
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        pump: asyncio.Task[None] | None = None
        try:
            while True:
                try:
                    raw = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                    return
                if len(raw) > HEAD_LIMIT:
                    return
                try:
                    head = parse_request_head(raw)
                except ValueError:
                    return
                status, stall = self._take_fault()
                if stall:
                    await asyncio.sleep(stall)
                broken = "" if status else self._take_break(head)
                if broken:
                    # A GET has no body; the connection ends with this broken answer
                    # (a drip that finishes is a whole answer: the connection stays).
                    await self._broken_answer(head, broken, writer)
                    if broken in ("reset", "truncate"):
                        return
                    continue
                if status:
                    if not head.expects_continue:
                        await copy_body(head, reader, None)
                    writer.write(error_response(status, SLOWDOWN_BODY))
                    await writer.drain()
                    return
                if upstream is None:
                    upstream = await asyncio.open_connection(self.upstream_host, self.upstream_port)
                    pump = asyncio.create_task(pump_bytes(upstream[0], writer))
                upstream[1].write(head.raw)
                await copy_body(head, reader, upstream[1])
                await upstream[1].drain()
        except (ConnectionError, OSError):
            return
        finally:
            self._tasks.discard(task)
            self._writers.discard(writer)
            if pump is not None:
                pump.cancel()
                with contextlib.suppress(asyncio.CancelledError, ConnectionError, OSError):
                    await pump
            for stream in (upstream[1] if upstream else None, writer):
                if stream is not None:
                    stream.close()
                    with contextlib.suppress(ConnectionError, OSError):
                        await stream.wait_closed()


async def copy_body(
    head: RequestHead, reader: asyncio.StreamReader, writer: asyncio.StreamWriter | None
) -> None:
    """Copy (or, with writer None, drop) the request body that follows `head`."""
    if head.headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";")[0].strip(), 16)
            if writer is not None:
                writer.write(size_line)
            if size == 0:
                # Trailers, then the empty line that ends the body.
                while True:
                    line = await reader.readuntil(b"\r\n")
                    if writer is not None:
                        writer.write(line)
                    if line == b"\r\n":
                        return
            await copy_exactly(reader, writer, size + 2)
    else:
        await copy_exactly(reader, writer, int(head.headers.get("content-length", "0")))


async def copy_exactly(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter | None, count: int
) -> None:
    while count > 0:
        data = await reader.read(min(count, COPY_CHUNK))
        if not data:
            raise ConnectionError("client closed the connection inside a request body")
        count -= len(data)
        if writer is not None:
            writer.write(data)
            await writer.drain()


async def pump_bytes(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Server to client, unparsed: responses, 100 Continue included, pass as they come."""
    try:
        while data := await reader.read(COPY_CHUNK):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        # The server closed (or failed): the client must see the connection end too.
        writer.close()
