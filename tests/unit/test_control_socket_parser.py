"""The control socket's request-head parser: what it takes, hands over and refuses."""

from __future__ import annotations

import pytest
from shardcache_sidecar.server import control, probes, socket_server

from shardcache import unix_http

pytestmark = pytest.mark.unit


@pytest.fixture
def parser() -> socket_server.Parser:
    return socket_server.Parser(socket_server.Routes(control.TABLE + probes.TABLE))


def head(method: str, path: str, body: bytes | None) -> bytes:
    request = unix_http.request_bytes(method, path, body, keep_alive=True)
    return request[: request.find(b"\r\n\r\n")]


def test_each_request_gets_its_own_length_and_route_from_remembered_headers(
    parser: socket_server.Parser,
) -> None:
    for body in (b"{}", b'{"epoch": 0, "position": 1}', b"{}"):
        request, length = parser.parse(head("POST", "/v1/readers/r7/notes", body))
        assert length == len(body)
        assert (request.route.call, request.ident, request.close) == (
            control.post_notes,
            "r7",
            False,
        )
    request, length = parser.parse(head("PUT", "/v1/readers/other", b"{}"))
    assert (request.route.call, request.ident, length) == (control.put_reader, "other", 2)


def test_a_refused_header_block_is_refused_every_time(parser: socket_server.Parser) -> None:
    bad = b"POST /v1/readers/x/notes HTTP/1.1\r\nContent-Length: 2\r\nbroken"
    for _ in range(2):
        with pytest.raises(socket_server._Refused, match="malformed header line"):
            parser.parse(bad)


@pytest.mark.parametrize(
    "raw",
    [
        b"GET /metrics HTTP/1.1\r\nHost: x",
        b"GET /v1/status HTTP/1.1\r\nHost: x",
        b"GET /v1/manifest HTTP/1.0",
        b"GET /v1/manifest?x=1 HTTP/1.1",
        b"POST /v1/readers/%41/notes HTTP/1.1\r\nContent-Length: 2",
        b"POST /v1/readers/a/notes HTTP/1.1\r\nTransfer-Encoding: chunked",
        b"POST /v1/readers/a/notes HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2",
        b"GET /v1/readers//acquire HTTP/1.1",
        b"PATCH /v1/readers/a HTTP/1.1",
    ],
)
def test_what_is_not_a_plain_control_request_is_handed_to_aiohttp(
    parser: socket_server.Parser, raw: bytes
) -> None:
    with pytest.raises(socket_server._HandOver):
        parser.parse(raw)


def test_a_body_over_the_limit_is_refused_before_it_is_read(parser: socket_server.Parser) -> None:
    raw = b"POST /v1/readers/a/notes HTTP/1.1\r\nContent-Length: %d" % (
        socket_server.MAX_BODY_BYTES + 1
    )
    with pytest.raises(socket_server._Refused) as refused:
        parser.parse(raw)
    assert refused.value.status == 413
