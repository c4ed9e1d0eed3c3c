"""One HTTP/1.1 exchange over a Unix socket: the control channel's transport.

`http.client` spends about 200 µs of Python per request (header objects, an email
parser for the response), and a trainer's control calls run on threads that share the
GIL with its training loop: the warm path's notifications cost the loop more in GIL
waits than in their own time. This module writes the request in one `sendall` and
parses the answer with a few byte operations: what the control protocol needs
(docs/wire-format.md) and nothing else: one request per connection (`Connection:
close`), a body framed by Content-Length, chunked, or the end of the connection.

Errors are the standard library's (`OSError` for the socket, `http.client`'s
`HTTPException` subclasses for a malformed or cut answer), so callers treat this
transport exactly as they treated `http.client`.
"""

from __future__ import annotations

import http.client
import os
import socket
from pathlib import Path

#: Bytes read per recv(); control answers are a few hundred bytes.
RECV_BYTES = 65536
#: A header block larger than this is not a control answer.
MAX_HEADER_BYTES = 64 * 1024


def request_bytes(method: str, path: str, payload: bytes | None) -> bytes:
    """The whole request: request line, headers, body."""
    lines = [
        f"{method} {path} HTTP/1.1",
        "Host: localhost",
        "Accept: application/json",
        "Connection: close",
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


def exchange(
    socket_path: Path, method: str, path: str, payload: bytes | None, timeout: float
) -> tuple[int, bytes]:
    """Send one request on a new connection; (status, body) of the answer."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(os.fspath(socket_path))
        sock.sendall(request_bytes(method, path, payload))
        response = Response()
        while True:
            data = sock.recv(RECV_BYTES)
            if not data or response.feed(data):
                break
    finally:
        sock.close()
    body = response.finish()
    assert response.status is not None  # finish() raised otherwise
    return response.status, body
