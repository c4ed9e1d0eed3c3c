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


def test_a_request_line_is_matched_against_the_routes_once_and_then_remembered(
    parser: socket_server.Parser, monkeypatch: pytest.MonkeyPatch
) -> None:
    matched: list[bytes] = []
    match = parser.routes.match

    def counting(method: bytes, target: bytes) -> tuple[object, str] | None:
        matched.append(target)
        return match(method, target)

    monkeypatch.setattr(parser.routes, "match", counting)
    for body in (b"{}", b'{"epoch": 0, "position": 1}', b"{}"):
        request, length = parser.parse(head("POST", "/v1/readers/r7/notes", body))
        assert (request.route.call, request.ident, length) == (control.post_notes, "r7", len(body))
    request, _ = parser.parse(head("POST", "/v1/readers/r8/notes", b"{}"))
    assert request.ident == "r8"
    assert matched == [b"/v1/readers/r7/notes", b"/v1/readers/r8/notes"]


def test_a_remembered_line_with_a_bad_header_block_is_refused_and_one_not_ours_handed_over(
    parser: socket_server.Parser,
) -> None:
    # What a line says is remembered; what the header block says is still checked
    # first, and a route not in the table is still aiohttp's, every time.
    good = head("POST", "/v1/readers/r7/notes", b"{}")
    parser.parse(good)
    line = good[: good.find(b"\r\n")]
    for _ in range(2):
        with pytest.raises(socket_server._Refused, match="malformed header line"):
            parser.parse(line + b"\r\nbroken")
    for _ in range(2):
        with pytest.raises(socket_server._HandOver):
            parser.parse(b"GET /metrics HTTP/1.1\r\nHost: x")
        with pytest.raises(socket_server._Refused, match="malformed header line"):
            parser.parse(b"GET /metrics HTTP/1.1\r\nbroken")


def test_the_remembered_lines_are_bounded(parser: socket_server.Parser) -> None:
    for i in range(3 * socket_server.Parser.KEPT):
        request, _ = parser.parse(head("DELETE", f"/v1/leases/l{i}", None))
        assert request.ident == f"l{i}"
    assert len(parser._lines) <= socket_server.Parser.KEPT


def test_a_long_request_line_is_served_but_not_remembered(parser: socket_server.Parser) -> None:
    ident = "r" * socket_server.Parser.LINE_KEPT
    request, _ = parser.parse(head("POST", f"/v1/readers/{ident}/notes", b"{}"))
    assert request.ident == ident
    assert parser._lines == {}
