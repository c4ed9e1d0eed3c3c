"""The control socket's two transports against a real sidecar process, byte by byte.

The lean HTTP/1.1 protocol (`shardcache_sidecar.server.socket_server`) answers the
control routes itself and hands every other request to aiohttp on the same connection.
These tests speak raw HTTP on the real socket: bad input gets a clear JSON error and
only its own connection closes, other connections keep being served, and requests the
lean protocol does not take (other routes, HTTP/1.0, chunked bodies, escapes) get
aiohttp's answers, the same as before.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from shardcache_sidecar.server import socket_server

from shardcache import plans, unix_http
from shardcache.contract import protocol
from tests.support import datasets
from tests.support.sidecar import SidecarProcess

pytestmark = pytest.mark.integration

SHARDS = [300, 200, 250]
PARAMS = {**protocol.params_to_json(plans.PlanParams(shuffle=False)), "position": 0}

Factory = Callable[..., SidecarProcess]


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarProcess]:
    uri, _ = datasets.write_local(tmp_path_factory.mktemp("ds"), SHARDS)
    proc = SidecarProcess(uri)
    proc.start(wait="ready")
    try:
        yield proc
    finally:
        proc.cleanup()


class Raw:
    """A connection to the control socket that sends exactly the bytes it is given."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10.0)
        self.sock.connect(os.fspath(path))

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def answer(self) -> tuple[int, Any, unix_http.Response]:
        """The next answer: (status, decoded JSON body or text, the parsed response)."""
        response = unix_http.Response()
        while True:
            data = self.sock.recv(65536)
            if not data or response.feed(data):
                break
        body = response.finish()
        assert response.status is not None
        try:
            return response.status, json.loads(body), response
        except ValueError:
            return response.status, body.decode(errors="replace"), response

    def request(
        self, method: str, path: str, body: object = None
    ) -> tuple[int, Any, unix_http.Response]:
        payload = None if body is None else json.dumps(body).encode()
        self.send(unix_http.request_bytes(method, path, payload, keep_alive=True))
        return self.answer()

    def closed_by_peer(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def raw(sidecar: SidecarProcess) -> Iterator[Callable[[], Raw]]:
    opened: list[Raw] = []

    def connect() -> Raw:
        opened.append(Raw(sidecar.socket_path))
        return opened[-1]

    yield connect
    for conn in opened:
        conn.close()


def register(conn: Raw, reader: str) -> None:
    status, body, _ = conn.request("PUT", protocol.reader_path(reader), PARAMS)
    assert status == 200, body


def metric(sidecar: SidecarProcess, route: str, status: int) -> float:
    code, text = sidecar.http_get("/metrics")
    assert code == 200
    prefix = "shardcache_control_requests_total{"
    for line in text.splitlines():
        if line.startswith(prefix) and f'route="{route}"' in line and f'status="{status}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_many_requests_on_one_kept_alive_connection_are_answered_in_order(
    raw: Callable[[], Raw],
) -> None:
    conn = raw()
    register(conn, "keep")
    for position in range(0, 300, 30):
        status, body, response = conn.request(
            "POST", protocol.position_path("keep"), {"epoch": 0, "position": position}
        )
        assert (status, body["position"]) == (200, position)
        assert response.reusable
    status, body, _ = conn.request("DELETE", protocol.reader_path("keep"))
    assert (status, body["removed"]) == (200, True)


def test_pipelined_requests_get_their_answers_in_order(raw: Callable[[], Raw]) -> None:
    conn = raw()
    register(conn, "pipe")
    path = protocol.position_path("pipe")
    conn.send(
        b"".join(
            unix_http.request_bytes(
                "POST", path, json.dumps({"epoch": 0, "position": p}).encode(), keep_alive=True
            )
            for p in (10, 20, 30)
        )
    )
    # One recv may hold several answers: read them off one buffer.
    got: list[int] = []
    buffer = b""
    while len(got) < 3:
        buffer += conn.sock.recv(65536)
        while b"\r\n\r\n" in buffer:
            head, rest = buffer.split(b"\r\n\r\n", 1)
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            if len(rest) < length:
                break
            got.append(json.loads(rest[:length])["position"])
            buffer = rest[length:]
    assert got == [10, 20, 30]


def test_a_malformed_request_line_gets_a_json_400_and_only_that_connection_closes(
    sidecar: SidecarProcess, raw: Callable[[], Raw]
) -> None:
    other = raw()
    register(other, "bystander")
    bad = raw()
    bad.send(b"THIS IS NOT HTTP\r\n\r\n")
    status, body, response = bad.answer()
    assert status == 400
    assert body["error"]["kind"] == protocol.KIND_INPUT
    assert "malformed request line" in body["error"]["message"]
    assert not response.reusable
    assert bad.closed_by_peer()
    # Everyone else is still served, on old connections and new ones.
    status, _, _ = other.request(
        "POST", protocol.position_path("bystander"), {"epoch": 0, "position": 5}
    )
    assert status == 200
    status, _, _ = raw().request("GET", protocol.MANIFEST)
    assert status == 200


@pytest.mark.parametrize(
    ("request_bytes", "status", "says"),
    [
        (b"POST /v1/readers/x/position HTTP/1.1\r\nno colon here\r\n\r\n", 400, "header line"),
        (
            b"POST /v1/readers/x/position HTTP/1.1\r\nContent-Length: ten\r\n\r\n",
            400,
            "Content-Length",
        ),
        (
            b"POST /v1/readers/x/notes HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
            400,
            "Content-Length",
        ),
        (b"GET /v1/manifest HTTP/9.9\r\n\r\n", 400, "request line"),
        (
            b"POST /v1/readers/x/notes HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % (2 * 1024 * 1024),
            413,
            "at most",
        ),
    ],
    ids=["header-without-colon", "length-not-a-number", "two-lengths", "http-9", "body-too-large"],
)
def test_an_unparseable_request_is_refused_with_a_json_error_and_closed(
    raw: Callable[[], Raw], request_bytes: bytes, status: int, says: str
) -> None:
    conn = raw()
    conn.send(request_bytes)
    got, body, _ = conn.answer()
    assert got == status
    assert body["error"]["kind"] == protocol.KIND_INPUT
    assert says in body["error"]["message"]
    assert conn.closed_by_peer()


def test_a_header_block_that_never_ends_is_refused(raw: Callable[[], Raw]) -> None:
    conn = raw()
    conn.send(b"GET /v1/manifest HTTP/1.1\r\nX-Filler: " + b"a" * (70 * 1024))
    status, body, _ = conn.answer()
    assert status == 431
    assert "header block" in body["error"]["message"]
    assert conn.closed_by_peer()


@pytest.mark.parametrize("path", [protocol.MANIFEST, protocol.STATUS], ids=["lean", "aiohttp"])
def test_a_header_block_over_the_limit_is_refused_when_it_arrives_whole(
    raw: Callable[[], Raw], path: str
) -> None:
    conn = raw()
    filler = b"a" * (socket_server.MAX_HEAD_BYTES + 1)
    conn.send(b"GET %s HTTP/1.1\r\nHost: x\r\nX-Filler: %s\r\n\r\n" % (path.encode(), filler))
    status, body, _ = conn.answer()
    assert status == 431, body
    assert "header block" in body["error"]["message"]
    assert conn.closed_by_peer()


def test_a_header_block_just_under_the_limit_is_served(raw: Callable[[], Raw]) -> None:
    start = b"GET /v1/manifest HTTP/1.1\r\nX-Filler: "
    filler = b"a" * (socket_server.MAX_HEAD_BYTES - len(start))
    conn = raw()
    conn.send(start + filler + b"\r\n\r\n")
    status, body, _ = conn.answer()
    assert status == 200, body
    assert len(body["shards"]) == len(SHARDS)


def test_a_request_cut_off_mid_body_disturbs_no_one(
    sidecar: SidecarProcess, raw: Callable[[], Raw]
) -> None:
    cut = raw()
    cut.send(b'POST /v1/readers/x/notes HTTP/1.1\r\nContent-Length: 100\r\n\r\n{"epo')
    cut.close()
    status, _, _ = raw().request("GET", protocol.MANIFEST)
    assert status == 200


def test_a_bad_json_body_is_a_400_and_the_connection_keeps_serving(raw: Callable[[], Raw]) -> None:
    conn = raw()
    register(conn, "badjson")
    conn.send(
        unix_http.request_bytes(
            "POST", protocol.position_path("badjson"), b"{not json", keep_alive=True
        )
    )
    status, body, response = conn.answer()
    assert status == 400
    assert body["error"]["kind"] == protocol.KIND_INPUT
    assert "not JSON" in body["error"]["message"]
    assert response.reusable
    status, body, _ = conn.request(
        "POST", protocol.position_path("badjson"), {"epoch": 0, "position": 1}
    )
    assert (status, body["position"]) == (200, 1)


@pytest.mark.parametrize(
    "body",
    [b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000],
    ids=["arrays", "objects"],
)
def test_a_json_body_nested_too_deeply_is_a_400_and_the_connection_keeps_serving(
    raw: Callable[[], Raw], body: bytes
) -> None:
    conn = raw()
    register(conn, "deepjson")
    conn.send(
        unix_http.request_bytes("POST", protocol.position_path("deepjson"), body, keep_alive=True)
    )
    status, answer, response = conn.answer()
    assert status == 400, answer
    assert (answer["error"]["kind"], answer["error"]["code"]) == (
        protocol.KIND_INPUT,
        protocol.CODE_BAD_REQUEST,
    )
    assert "nested more than" in answer["error"]["message"]
    assert response.reusable
    status, answer, _ = conn.request(
        "POST", protocol.position_path("deepjson"), {"epoch": 0, "position": 1}
    )
    assert (status, answer["position"]) == (200, 1)


def test_an_unknown_reader_is_a_404_in_the_wire_error_shape(raw: Callable[[], Raw]) -> None:
    status, body, _ = raw().request(
        "POST", protocol.position_path("nobody"), {"epoch": 0, "position": 0}
    )
    assert status == 404
    assert body["error"]["code"] == protocol.CODE_UNKNOWN_READER


def test_other_routes_on_the_same_connection_are_served_by_aiohttp_and_then_the_control_routes_again(
    raw: Callable[[], Raw],
) -> None:
    conn = raw()
    register(conn, "mixed")
    status, text, _ = conn.request("GET", protocol.METRICS)
    assert status == 200
    assert "shardcache_control_requests_total" in text
    status, body, _ = conn.request("GET", protocol.STATUS)
    assert status == 200
    assert "mixed" in [r["id"] for r in body["readers"]]
    status, body, _ = conn.request("GET", "/v1/nowhere")
    assert (status, body["error"]["code"]) == (404, protocol.CODE_UNKNOWN_ROUTE)
    status, body, _ = conn.request(
        "POST", protocol.position_path("mixed"), {"epoch": 0, "position": 7}
    )
    assert (status, body["position"]) == (200, 7)


def test_an_http_1_0_request_is_answered(raw: Callable[[], Raw]) -> None:
    conn = raw()
    conn.send(b"GET /v1/manifest HTTP/1.0\r\n\r\n")
    status, body, _ = conn.answer()
    assert status == 200
    assert len(body["shards"]) == len(SHARDS)


def test_a_chunked_body_is_served_like_a_framed_one(raw: Callable[[], Raw]) -> None:
    conn = raw()
    register(conn, "chunky")
    payload = json.dumps({"epoch": 0, "position": 42}).encode()
    conn.send(
        b"POST /v1/readers/chunky/position HTTP/1.1\r\nHost: localhost\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n0\r\n\r\n" % (len(payload), payload)
    )
    status, body, _ = conn.answer()
    assert status == 200, body
    assert body["position"] == 42


def test_a_chunked_body_over_the_limit_is_a_413_and_the_sidecar_keeps_serving(
    raw: Callable[[], Raw],
) -> None:
    """A chunked body is aiohttp's to frame (no Content-Length for the lean protocol to
    refuse): aiohttp's `client_max_size` is the same limit, and it holds while the
    body arrives, not once it is whole."""
    conn = raw()
    register(conn, "huge")
    piece = b"x" * (64 * 1024)
    conn.send(
        b"POST /v1/readers/huge/position HTTP/1.1\r\nHost: localhost\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n%s\r\n"
        % (len(piece), piece)
        * (socket_server.MAX_BODY_BYTES // len(piece) + 1)
    )
    status, body, _ = conn.answer()
    assert status == 413, body
    assert body["error"]["kind"] == protocol.KIND_INPUT
    status, _, _ = raw().request("GET", protocol.MANIFEST)
    assert status == 200


def test_a_percent_escaped_reader_id_means_the_same_reader(raw: Callable[[], Raw]) -> None:
    conn = raw()
    register(conn, "esc")
    status, body, _ = conn.request(
        "POST", "/v1/readers/%65sc/position", {"epoch": 0, "position": 3}
    )
    assert (status, body["reader"], body["position"]) == (200, "esc", 3)


@pytest.mark.parametrize(
    "target", [b"/v1/readers/nl\n", b"/v1/readers/nl%0A"], ids=["raw", "escaped"]
)
def test_a_reader_id_ending_in_a_newline_is_refused_and_not_registered(
    raw: Callable[[], Raw], target: bytes
) -> None:
    payload = json.dumps(PARAMS).encode()
    conn = raw()
    head = b"PUT %s HTTP/1.1\r\nHost: localhost\r\nContent-Length: %d\r\n\r\n"
    conn.send(head % (target, len(payload)) + payload)
    status, body, _ = conn.answer()
    assert status == 400, body
    assert body["error"]["kind"] == protocol.KIND_INPUT
    assert "reader id" in body["error"]["message"]
    status, body, _ = raw().request("GET", protocol.STATUS)
    assert not [r["id"] for r in body["readers"] if r["id"].startswith("nl")]


def test_the_lean_transport_counts_its_requests_by_route(
    sidecar: SidecarProcess, raw: Callable[[], Raw]
) -> None:
    route = protocol.position_path("{reader_id}")
    before = metric(sidecar, route, 200)
    conn = raw()
    register(conn, "counted")
    for position in range(5):
        conn.request("POST", protocol.position_path("counted"), {"epoch": 0, "position": position})
    assert metric(sidecar, route, 200) == before + 5


def test_connection_close_is_honoured(raw: Callable[[], Raw]) -> None:
    conn = raw()
    conn.send(b"GET /v1/manifest HTTP/1.1\r\nConnection: close\r\n\r\n")
    status, _, response = conn.answer()
    assert status == 200
    assert not response.reusable
    assert conn.closed_by_peer()


def test_healthz_on_the_socket_says_alive_and_the_version(
    raw: Callable[[], Raw],
) -> None:
    status, body, _ = raw().request("GET", protocol.HEALTHZ)
    assert (status, body) == (200, {"status": "alive", "version": protocol.VERSION})


def test_control_routes_are_answered_by_the_lean_protocol_and_the_rest_by_aiohttp(
    raw: Callable[[], Raw],
) -> None:
    # aiohttp names itself in a Server header; the lean protocol writes none. This is
    # what tells the two apart on the wire, so the control routes must not regress to
    # aiohttp's path unnoticed.
    def head_of(conn: Raw, method: str, path: str) -> bytes:
        conn.send(unix_http.request_bytes(method, path, None, keep_alive=True))
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.sock.recv(65536)
        head, rest = data.split(b"\r\n\r\n", 1)
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        while len(rest) < length:
            rest += conn.sock.recv(65536)
        return head.lower()

    conn = raw()
    assert b"\r\nserver:" not in head_of(conn, "GET", protocol.MANIFEST)
    assert b"\r\nserver:" in head_of(conn, "GET", protocol.STATUS)
    assert b"\r\nserver:" not in head_of(raw(), "GET", protocol.HEALTHZ)
