"""The control protocol's pure parts: plan parameters on the wire and error mapping."""

from __future__ import annotations

from typing import Any

import pytest

from shardcache import errors, plans, streams
from shardcache.contract import protocol

pytestmark = pytest.mark.unit

GOOD: dict[str, Any] = {
    "seed": 5,
    "epoch": 2,
    "rank": 1,
    "world_size": 4,
    "shuffle": False,
    "block_size": 128,
    "segments": None,
    "granularity": "block",
    "window": 65536,
}


def test_plan_params_round_trip_through_json() -> None:
    params = plans.PlanParams(seed=5, epoch=2, rank=1, world_size=4, shuffle=False, block_size=128)
    assert protocol.params_to_json(params) == GOOD
    assert protocol.params_from_json(GOOD) == params
    # An older client sends no segments: rule 5.
    assert protocol.params_from_json({k: v for k, v in GOOD.items() if k != "segments"}) == params


def test_elastic_segments_travel_with_the_plan_params() -> None:
    seg = streams.Segments(2, ((3, 9), (40, 41)))
    params = plans.PlanParams(epoch=2, world_size=3, segments=seg)
    body = protocol.params_to_json(params)
    assert body["segments"] == {"epoch": 2, "ranges": [[3, 9], [40, 41]]}
    assert protocol.params_from_json(body) == params
    with pytest.raises(errors.InputError, match="field 'segments'"):
        protocol.params_from_json({**body, "segments": {"epoch": 2, "ranges": [[9, 3]]}})


def test_sample_mode_params_round_trip_and_a_client_without_them_reads_in_block_mode() -> None:
    params = plans.PlanParams(seed=5, shuffle=True, granularity="sample", window=300)
    assert protocol.params_from_json(protocol.params_to_json(params)) == params
    older = {k: v for k, v in GOOD.items() if k not in ("granularity", "window")}
    assert protocol.params_from_json(older) == plans.PlanParams(
        seed=5, epoch=2, rank=1, world_size=4, shuffle=False, block_size=128
    )


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("seed", None, "field 'seed': expected an integer, found None"),
        ("seed", True, "field 'seed': expected an integer, found True"),
        ("rank", "1", "field 'rank': expected an integer, found '1'"),
        ("epoch", -1, "field 'epoch': expected an integer >= 0, found -1"),
        ("world_size", 0, "field 'world_size': expected an integer >= 1, found 0"),
        ("shuffle", 1, "field 'shuffle': expected true or false, found 1"),
        ("rank", 4, "rank must be in [0, world_size=4), got 4"),
    ],
)
def test_bad_plan_params_name_the_field_and_what_was_found(
    field: str, value: object, message: str
) -> None:
    with pytest.raises(errors.InputError) as info:
        protocol.params_from_json({**GOOD, field: value})
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("kind", "code", "cls"),
    [
        (protocol.KIND_INPUT, protocol.CODE_BAD_REQUEST, errors.InputError),
        (protocol.KIND_INPUT, protocol.CODE_MANIFEST_MISMATCH, errors.ManifestMismatchError),
        (protocol.KIND_INPUT, protocol.CODE_UNKNOWN_SHARD, errors.ShardIndexError),
        (protocol.KIND_INPUT, protocol.CODE_ACCESS_DENIED, errors.AccessDeniedError),
        (protocol.KIND_SOURCE, protocol.CODE_SOURCE_FAILED, errors.SourceError),
        (protocol.KIND_CACHE, protocol.CODE_TIMEOUT, errors.AcquireTimeoutError),
        (protocol.KIND_CACHE, protocol.CODE_INTERNAL, errors.CacheError),
        (protocol.KIND_UNAVAILABLE, protocol.CODE_STARTING, errors.SidecarUnavailableError),
    ],
)
def test_error_bodies_map_back_to_shardcache_errors_with_the_message(
    kind: str, code: str, cls: type[errors.ShardcacheError]
) -> None:
    body = protocol.error_body(kind, code, "shard 3 (a.parquet): connection refused")
    wire = protocol.WireError.from_body(502, body)
    assert (wire.kind, wire.code) == (kind, code)
    exc = wire.to_exception()
    assert type(exc) is cls
    assert "shard 3 (a.parquet): connection refused" in str(exc)
    assert "HTTP 502" in str(exc)


def test_refused_credentials_through_a_sidecar_raise_what_embedded_mode_raises() -> None:
    body = protocol.error_body(
        protocol.KIND_INPUT, protocol.CODE_ACCESS_DENIED, "the object store refused the credentials"
    )
    exc = protocol.WireError.from_body(409, body).to_exception()
    assert type(exc) is errors.AccessDeniedError
    # What a client that predates the code raises, by its kind: a handler of it still catches.
    assert isinstance(exc, errors.InputError)
    assert str(exc) == (
        "sidecar: the object store refused the credentials "
        "(HTTP 409, kind=input, code=access_denied)"
    )


@pytest.mark.parametrize("body", [None, "Bad Gateway", {"error": "nope"}, [1]])
def test_a_malformed_error_body_is_a_cache_error_that_shows_it(body: object) -> None:
    wire = protocol.WireError.from_body(502, body)
    exc = wire.to_exception()
    assert type(exc) is errors.CacheError
    assert repr(body) in str(exc)


@pytest.mark.parametrize("reader_id", ["a", "0c3c291d9f9146bcbe896eaa553a69f2", "rank-0.w_1"])
def test_reader_ids_safe_in_a_path_are_accepted(reader_id: str) -> None:
    assert protocol.check_reader_id(reader_id) == reader_id


@pytest.mark.parametrize(
    "reader_id", ["", "-x", "a/b", "a b", "x" * 129, "ü", "abc\n", "abc\r\n", "\nabc"]
)
def test_reader_ids_unsafe_in_a_path_are_refused(reader_id: str) -> None:
    with pytest.raises(errors.InputError, match="reader id"):
        protocol.check_reader_id(reader_id)


@pytest.mark.parametrize("lease", ["a" * 31, "a" * 32 + "\n", "A" * 32, ""])
def test_lease_ids_other_than_32_lowercase_hex_digits_are_refused(lease: str) -> None:
    assert protocol.lease_list({"leases": ["0" * 32]}, "leases") == ["0" * 32]
    with pytest.raises(errors.InputError, match="expected a list of lease ids"):
        protocol.lease_list({"leases": [lease]}, "leases")


def test_routes_carry_the_api_version() -> None:
    assert protocol.acquire_path("r") == "/v1/readers/r/acquire"
    assert protocol.pinned_path("r") == "/v1/readers/r/pinned"
    assert protocol.lease_path("ab") == "/v1/leases/ab"
    assert protocol.MANIFEST.startswith(f"/{protocol.VERSION}/")


def test_a_seq_is_an_integer_from_zero_or_left_out() -> None:
    assert protocol.optional_seq({}) is None
    assert protocol.optional_seq({"seq": None}) is None
    assert protocol.optional_seq({"seq": 0}) == 0
    for bad in (-1, True, "3", 2.0):
        with pytest.raises(errors.InputError, match="field 'seq': expected an integer"):
            protocol.optional_seq({"seq": bad})
