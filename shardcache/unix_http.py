"""HTTP/1.1 exchanges over a Unix socket: the control channel's transport.

`http.client` spends about 200 µs of Python per request (header objects, an email
parser for the response), and a trainer's control calls run on threads that share the
GIL with its training loop: the warm path's notifications cost the loop more in GIL
waits than in their own time. This module writes the request in one `sendall` and
parses the answer with a few byte operations: what the control protocol needs
(docs/wire-format.md) and nothing else: a body framed by Content-Length, chunked, or
the end of the connection.

`Connections` keeps connections alive between requests (HTTP/1.1 persistent
connections): with eight ranks on one sidecar, accepting a new connection per request
and closing it again was about an eighth of the sidecar's CPU (docs/benchmarks.md).
`exchange` without it makes one request on a connection of its own (`Connection:
close`).

Errors are the standard library's (`OSError` for the socket, `http.client`'s
`HTTPException` subclasses for a malformed or cut answer), so callers treat this
transport exactly as they treated `http.client`.
"""

from __future__ import annotations

import http.client
import os
import socket
import threading
import weakref
from pathlib import Path

#: Bytes read per recv(); control answers are a few hundred bytes.
RECV_BYTES = 65536
#: A header block larger than this is not a control answer.
MAX_HEADER_BYTES = 64 * 1024


def request_bytes(
    method: str, path: str, payload: bytes | None, *, keep_alive: bool = False
) -> bytes:
    """The whole request: request line, headers, body."""
    lines = [
        f"{method} {path} HTTP/1.1",
        "Host: localhost",
        "Accept: application/json",
        f"Connection: {'keep-alive' if keep_alive else 'close'}",
        f"Content-Length: {0 if payload is None else len(payload)}",
    ]
    if payload is not None:
        lines.append("Content-Type: application/json")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii") + (payload or b"")


class Response:
    """An answer being read: the status once the header block is in, then the body."""

    def __init__(self) -> None:
        self._buffer = b""
        self.status: int | None = None
        self._length: int | None = None
        self._chunked = False
        self._body_start = 0
        self._close = False

    def feed(self, data: bytes) -> bool:
        """Add received bytes; True once the answer is complete (more bytes not needed)."""
        self._buffer += data
        if self.status is None:
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buffer) > MAX_HEADER_BYTES:
                    raise http.client.LineTooLong("header block")
                return False
            self._parse_head(self._buffer[:end])
            self._body_start = end + 4
        if self._length is not None:
            return len(self._buffer) - self._body_start >= self._length
        if self._chunked:
            return _dechunk(self._buffer[self._body_start :]) is not None
        return False  # framed by the end of the connection

    @property
    def has_data(self) -> bool:
        """Whether any byte of the answer arrived."""
        return bool(self._buffer)

    def finish(self) -> bytes:
        """The body, after `feed` said complete or the peer closed the connection."""
        if self.status is None:
            raise http.client.RemoteDisconnected(
                "the sidecar closed the connection without an answer"
                if not self._buffer
                else f"the answer ended inside its header block: {self._buffer[:200]!r}"
            )
        body = self._buffer[self._body_start :]
        if self._length is not None:
            if len(body) < self._length:
                raise http.client.IncompleteRead(body, self._length - len(body))
            return body[: self._length]
        if self._chunked:
            decoded = _dechunk(body)
            if decoded is None:
                raise http.client.IncompleteRead(body)
            return decoded
        return body

    @property
    def reusable(self) -> bool:
        """Whether the connection may carry another request after this complete answer:
        the body had its own framing (not the end of the connection), the server did
        not say it closes, and nothing followed the body."""
        if self.status is None or self._close:
            return False
        if self._length is not None:
            return len(self._buffer) - self._body_start == self._length
        return self._chunked and self._buffer.endswith(b"0\r\n\r\n")

    def _parse_head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise http.client.BadStatusLine(lines[0].decode("latin-1"))
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                raise http.client.HTTPException(f"malformed header line {line[:200]!r}")
            key = name.strip().lower()
            if key == b"content-length":
                text = value.strip()
                if not text.isdigit():
                    raise http.client.HTTPException(f"bad Content-Length {text[:40]!r}")
                self._length = int(text)
            elif key == b"transfer-encoding" and b"chunked" in value.lower():
                self._chunked = True
            elif key == b"connection" and b"close" in value.lower():
                self._close = True
        if parts[0] == b"HTTP/1.0":
            self._close = True  # 1.0 keeps a connection only when asked to; we never ask
        if self._chunked:
            self._length = None  # RFC 9112: chunked framing wins over a length
        self.status = int(parts[1])


def _dechunk(data: bytes) -> bytes | None:
    """The payload of a complete chunked body, or None while it is incomplete."""
    out: list[bytes] = []
    pos = 0
    while True:
        eol = data.find(b"\r\n", pos)
        if eol < 0:
            return None
        size_text = data[pos:eol].split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise http.client.HTTPException(f"bad chunk size {size_text[:40]!r}") from None
        start = eol + 2
        if size == 0:
            return b"".join(out)
        if len(data) < start + size + 2:
            return None
        out.append(data[start : start + size])
        pos = start + size + 2


def _receive(sock: socket.socket, response: Response) -> None:
    while True:
        data = sock.recv(RECV_BYTES)
        if not data or response.feed(data):
            return


def exchange(
    socket_path: Path,
    method: str,
    path: str,
    payload: bytes | None,
    timeout: float,
    *,
    connections: Connections | None = None,
) -> tuple[int, bytes]:
    """Send one request; (status, body) of the answer.

    On a kept-alive connection from `connections` if given, else on a new connection
    closed after the answer."""
    if connections is not None:
        return connections.exchange(method, path, payload, timeout)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(os.fspath(socket_path))
        sock.sendall(request_bytes(method, path, payload))
        response = Response()
        _receive(sock, response)
    finally:
        sock.close()
    body = response.finish()
    assert response.status is not None  # finish() raised otherwise
    return response.status, body


class Connections:
    """Idle kept-alive connections to one socket, reused by whichever thread asks next.

    A connection carries one request at a time: a thread takes an idle one (or opens
    one), makes its exchange, and puts it back only if the answer left it in a known
    state (`Response.reusable`). A reused connection the server closed while idle (its
    keep-alive timeout, a restart) fails before any answer arrives; the request is then
    sent once more on a new connection, as a browser does. Any other failure closes
    the connection and propagates.

    After a fork (DataLoader workers) the child must not talk on its parent's sockets:
    the first call in a new process drops the inherited ones.
    """

    def __init__(self, socket_path: Path, *, max_idle: int = 4) -> None:
        self.socket_path = socket_path
        self._max_idle = max_idle
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()
        # A client dropped without close() still closes its idle connections (quietly:
        # the interpreter would warn about each socket otherwise).
        weakref.finalize(self, _close_all, self._idle)

    def _take(self) -> socket.socket | None:
        with self._lock:
            if self._pid != os.getpid():
                # The parent's connections: closing our copies leaves the parent's open.
                _close_all(self._idle)
                self._pid = os.getpid()
            return self._idle.pop() if self._idle else None

    def _give_back(self, sock: socket.socket) -> None:
        with self._lock:
            if self._pid == os.getpid() and len(self._idle) < self._max_idle:
                self._idle.append(sock)
                return
        sock.close()

    def exchange(
        self, method: str, path: str, payload: bytes | None, timeout: float
    ) -> tuple[int, bytes]:
        request = request_bytes(method, path, payload, keep_alive=True)
        sock = self._take()
        if sock is not None:
            response = Response()
            try:
                sock.settimeout(timeout)
                sock.sendall(request)
                _receive(sock, response)
            except (BrokenPipeError, ConnectionResetError):
                sock.close()
                sock = None  # closed while idle: send it again on a new connection
            except BaseException:
                sock.close()
                raise
            else:
                if response.status is None and not response.has_data:
                    sock.close()
                    sock = None  # the server closed it while idle: the same
        if sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            response = Response()
            try:
                sock.settimeout(timeout)
                sock.connect(os.fspath(self.socket_path))
                sock.sendall(request)
                _receive(sock, response)
            except BaseException:
                sock.close()
                raise
        try:
            body = response.finish()
        except BaseException:
            sock.close()
            raise
        if response.reusable:
            self._give_back(sock)
        else:
            sock.close()
        assert response.status is not None  # finish() raised otherwise
        return response.status, body

    def close(self) -> None:
        """Close the idle connections (those in use close when their call ends)."""
        with self._lock:
            _close_all(self._idle)


def _close_all(sockets: list[socket.socket]) -> None:
    """Close and forget every socket in the list (in place: the finalizer holds it)."""
    while sockets:
        sockets.pop().close()
