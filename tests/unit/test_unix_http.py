"""The control channel's HTTP/1.1 exchange: requests written, answers framed and parsed."""

from __future__ import annotations

import http.client
import socket
import threading
import time
from pathlib import Path

import pytest

from shardcache import unix_http

pytestmark = pytest.mark.unit


def _parse(*pieces: bytes) -> tuple[int | None, bytes, bool]:
    response = unix_http.Response()
    done = False
    for piece in pieces:
        done = response.feed(piece)
    return response.status, response.finish(), done


def test_request_carries_length_type_and_close_and_the_body() -> None:
    raw = unix_http.request_bytes("POST", "/v1/readers/r/pinned", b'{"shard": 3}')
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /v1/readers/r/pinned HTTP/1.1"
    assert b"Content-Length: 12" in lines and b"Connection: close" in lines
    assert b"Content-Type: application/json" in lines
    assert body == b'{"shard": 3}'
    bare = unix_http.request_bytes("GET", "/v1/manifest", None)
    assert bare.endswith(b"Content-Length: 0\r\n\r\n") and b"Content-Type" not in bare


def test_answer_framed_by_content_length_is_complete_without_waiting_for_close() -> None:
    status, body, done = _parse(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Le",
        b'ngth: 8\r\n\r\n{"a": 1',
        b"}",
    )
    assert (status, body, done) == (200, b'{"a": 1}', True)


def test_chunked_answer_is_reassembled() -> None:
    status, body, done = _parse(
        b'HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n{"a"\r\n',
        b"3;ext=1\r\n: 2\r\n1\r\n}\r\n0\r\n\r\n",
    )
    assert (status, body, done) == (404, b'{"a": 2}', True)


def test_answer_without_length_ends_with_the_connection() -> None:
    status, body, done = _parse(b"HTTP/1.0 200 OK\r\n\r\nhello", b" world")
    assert (status, body, done) == (200, b"hello world", False)


@pytest.mark.parametrize(
    ("pieces", "error"),
    [
        ((b"",), http.client.RemoteDisconnected),
        ((b"HTTP/1.1 200 OK\r\nContent-Len",), http.client.RemoteDisconnected),
        ((b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",), http.client.IncompleteRead),
        ((b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab",),
         http.client.IncompleteRead),
        ((b"SSH-2.0-OpenSSH\r\n\r\n",), http.client.BadStatusLine),
        ((b"HTTP/1.1 200 OK\r\nContent-Length: ten\r\n\r\n",), http.client.HTTPException),
        ((b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",), http.client.HTTPException),
    ],
)  # fmt: skip
def test_a_cut_or_malformed_answer_is_an_http_error_the_client_retries(
    pieces: tuple[bytes, ...], error: type[Exception]
) -> None:
    with pytest.raises(error):
        _parse(*pieces)


def test_an_endless_header_block_is_refused() -> None:
    response = unix_http.Response()
    with pytest.raises(http.client.LineTooLong):
        response.feed(b"HTTP/1.1 200 OK\r\nX: " + b"a" * (unix_http.MAX_HEADER_BYTES + 1))


def test_exchange_over_a_real_unix_socket(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)
    seen: list[bytes] = []

    def answer() -> None:
        conn, _ = server.accept()
        with conn:
            data = b""
            while not data.endswith(b"{}"):
                data += conn.recv(4096)
            seen.append(data)
            # The answer arrives in two writes; the client must not stop at the first.
            conn.sendall(b'HTTP/1.1 201 Created\r\nContent-Length: 12\r\n\r\n{"ok":')
            conn.sendall(b" true}")

    thread = threading.Thread(target=answer)
    thread.start()
    try:
        status, body = unix_http.exchange(path, "PUT", "/v1/readers/x", b"{}", timeout=5.0)
    finally:
        thread.join(timeout=5)
        server.close()
    assert (status, body) == (201, b'{"ok": true}')
    assert seen[0].startswith(b"PUT /v1/readers/x HTTP/1.1\r\n")


def serve(path: Path, answers_per_connection: list[int]) -> tuple[threading.Thread, list[bytes]]:
    """A server that answers that many requests on each connection it accepts in turn,
    then closes it; what it received, per connection."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(4)
    received: list[bytes] = []

    def run() -> None:
        with server:
            for count in answers_per_connection:
                conn, _ = server.accept()
                with conn:
                    seen = b""
                    for n in range(count):
                        while seen.count(b"\r\n\r\n") <= n:
                            data = conn.recv(4096)
                            if not data:  # the client closed it: no more requests here
                                break
                            seen += data
                        else:
                            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                            continue
                        break
                    received.append(seen)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, received


def test_kept_alive_connections_carry_several_requests(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    thread, received = serve(path, [3])
    connections = unix_http.Connections(path)
    try:
        for _ in range(3):
            assert connections.exchange("GET", "/healthz", None, 5.0) == (200, b"ok")
    finally:
        connections.close()
        thread.join(timeout=5)
    # One connection, three requests on it, each asking to keep it.
    assert len(received) == 1 and received[0].count(b"GET /healthz HTTP/1.1\r\n") == 3
    assert received[0].count(b"Connection: keep-alive\r\n") == 3


def test_a_connection_the_server_closed_while_idle_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    # The server answers one request per connection and closes it (its keep-alive
    # timeout, a restart): the next request goes out again on a new connection.
    thread, received = serve(path, [1, 1])
    connections = unix_http.Connections(path)
    try:
        assert connections.exchange("GET", "/a", None, 5.0) == (200, b"ok")
        time.sleep(0.1)  # the server has closed it by now
        assert connections.exchange("GET", "/b", None, 5.0) == (200, b"ok")
    finally:
        connections.close()
        thread.join(timeout=5)
    assert [r.split(b" ", 2)[1] for r in received] == [b"/a", b"/b"]


def test_an_answer_framed_by_the_end_of_the_connection_is_not_reused() -> None:
    response = unix_http.Response()
    response.feed(b"HTTP/1.1 200 OK\r\n\r\nbody")
    assert not response.reusable
    closing = unix_http.Response()
    assert closing.feed(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok")
    assert not closing.reusable
    kept = unix_http.Response()
    assert kept.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    assert kept.reusable
