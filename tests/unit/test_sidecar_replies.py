"""Which error becomes which HTTP status and wire `kind`: retry later, or fix the input."""

from __future__ import annotations

import concurrent.futures
import json

import pytest
from shardcache_sidecar.server import replies

from shardcache import errors
from shardcache.contract import protocol

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("exc", "status", "kind", "code"),
    [
        (
            errors.ManifestMismatchError("digest"),
            409,
            protocol.KIND_INPUT,
            protocol.CODE_MANIFEST_MISMATCH,
        ),
        (errors.AccessDeniedError("key"), 400, protocol.KIND_INPUT, protocol.CODE_ACCESS_DENIED),
        (errors.InputError("bad"), 400, protocol.KIND_INPUT, protocol.CODE_BAD_REQUEST),
        (errors.SourceError("gone"), 502, protocol.KIND_SOURCE, protocol.CODE_SOURCE_FAILED),
        (TimeoutError("slow"), 504, protocol.KIND_CACHE, protocol.CODE_TIMEOUT),
        (errors.CacheError("full"), 503, protocol.KIND_CACHE, protocol.CODE_INTERNAL),
        (RuntimeError("bug"), 500, protocol.KIND_CACHE, protocol.CODE_INTERNAL),
    ],
)
def test_each_error_maps_to_its_status_kind_and_code(
    exc: BaseException, status: int, kind: str, code: str
) -> None:
    rejected = replies.request_error(exc)
    assert (rejected.status, rejected.kind, rejected.code) == (status, kind, code)


def test_refused_credentials_answer_access_denied_with_the_status_of_other_bad_input() -> None:
    refused = errors.AccessDeniedError("s3://b/ds/part-0.parquet: AccessDenied")
    rejected = replies.request_error(refused)
    assert (rejected.status, rejected.kind, rejected.code) == (
        400,
        protocol.KIND_INPUT,
        protocol.CODE_ACCESS_DENIED,
    )
    assert rejected.message == str(refused)
    # Any other input error keeps its code.
    assert replies.request_error(errors.InputError("bad")).code == protocol.CODE_BAD_REQUEST


def test_an_unexpected_error_names_its_type_in_the_message() -> None:
    assert replies.request_error(KeyError("x")).message == "internal error: KeyError: 'x'"


def test_an_error_response_is_the_wire_error_body() -> None:
    response = replies.error_response(
        replies.RequestError(404, protocol.KIND_INPUT, protocol.CODE_UNKNOWN_READER, "who?")
    )
    assert response.status == 404
    assert response.content_type == "application/json"
    assert (
        response.body
        == replies.json_response(
            protocol.error_body(protocol.KIND_INPUT, protocol.CODE_UNKNOWN_READER, "who?")
        ).body
    )


@pytest.mark.parametrize("raw", [b"[" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000])
def test_a_body_nested_too_deeply_is_bad_input_not_an_internal_error(raw: bytes) -> None:
    with pytest.raises(errors.InputError, match="nested more than") as info:
        replies.json_object(raw)
    rejected = replies.request_error(info.value)
    assert (rejected.status, rejected.kind, rejected.code) == (
        400,
        protocol.KIND_INPUT,
        protocol.CODE_BAD_REQUEST,
    )


def test_an_acquire_timeout_answers_504_with_its_own_message_naming_the_shard() -> None:
    message = (
        "shard 2 (part-00002.parquet) is not resident after the acquire timeout of 20 s: "
        "fetching its source bytes from the store since 2026-11-26T12:00:00Z (20.0 s)"
    )
    rejected = replies.request_error(errors.AcquireTimeoutError(message))
    assert (rejected.status, rejected.kind, rejected.code) == (
        504,
        protocol.KIND_CACHE,
        protocol.CODE_TIMEOUT,
    )
    assert rejected.message == message


def test_a_timeout_with_no_message_says_so_instead_of_ending_at_the_colon() -> None:
    future: concurrent.futures.Future[None] = concurrent.futures.Future()
    with pytest.raises(TimeoutError) as info:
        future.result(timeout=0)
    rejected = replies.request_error(info.value)
    assert rejected.code == protocol.CODE_TIMEOUT
    assert rejected.message == "timed out waiting for the shard: no detail given (TimeoutError)"


BODIES = [
    b"{}",
    b'{"epoch": 0, "position": 4096, "pinned": [1, 2, 3], "released": []}',
    b'{"a": 1} ',
    b' {"a": 1}',
    b'{"a": 1}\n',
    b'{"a": 1} {"b": 2}',
    b'{"a": 1}}',
    b'{"a": }',
    b'{"a": "\xc3\xa9"}',
    b'{"a": "\xed\xa0\x80"}',  # a lone surrogate: json.loads takes it (surrogatepass)
    b'{"a": "\xff"}',
    '{"a": 1}'.encode("utf-16-le"),
    '{"a": 1}'.encode("utf-16"),
    '{"a": 1}'.encode("utf-8-sig"),
    b'{"a": NaN, "b": [1.5, -0, 1e400]}',
    b'{"a": 1, "a": 2}',
    b"[1, 2]",
    b"null",
    b"{",
    b"}",
    b"",
]


@pytest.mark.parametrize("raw", BODIES)
def test_a_body_is_decoded_exactly_as_json_loads_decodes_it(raw: bytes) -> None:
    try:
        expected: object = json.loads(raw) if raw else None
    except ValueError as exc:
        expected = exc
    if isinstance(expected, dict):
        assert repr(replies.json_object(raw)) == repr(expected)
        return
    with pytest.raises(errors.InputError) as refused:
        replies.json_object(raw)
    if isinstance(expected, ValueError):
        assert str(refused.value) == f"request body is not JSON: {expected}"
    else:
        assert "expected a JSON object" in str(refused.value)


def test_a_plain_object_body_is_decoded_without_json_loads_detour(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The control client's bodies (`{...}` in UTF-8) take the scanner directly; anything
    # else still goes to json.loads, which words its errors.
    def no_loads(raw: bytes) -> object:
        raise AssertionError("json_loads_called")

    monkeypatch.setattr(replies.json, "loads", no_loads)
    assert replies.json_object(b'{"epoch": 1, "pinned": [3]}') == {"epoch": 1, "pinned": [3]}
    with pytest.raises(AssertionError, match="json_loads_called"):
        replies.json_object(b' {"epoch": 1}')
