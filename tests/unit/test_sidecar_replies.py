"""Which error becomes which HTTP status and wire `kind`: retry later, or fix the input."""

from __future__ import annotations

import concurrent.futures

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
