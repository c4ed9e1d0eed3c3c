"""The DatasetMount spec model: defaults, quantities, and errors that name the field."""

from __future__ import annotations

import re
from typing import Any

import pytest
from shardcache_operator import specs

from shardcache import errors

pytestmark = pytest.mark.unit


def parse(**spec: Any) -> specs.DatasetMountSpec:
    body: dict[str, Any] = {"source": {"uri": "s3://bucket/train/"}}
    body.update(spec)
    return specs.parse_spec(body)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2Gi", 2 * 2**30),
        ("1.5Gi", 3 * 2**29),
        ("500M", 500_000_000),
        ("1k", 1000),
        ("64Ki", 65536),
        ("1e3", 1000),
        ("0", 0),
        (4096, 4096),
        ("+7", 7),
    ],
)
def test_quantity_parses_to_bytes(text: Any, expected: int) -> None:
    assert specs.parse_quantity(text) == expected


@pytest.mark.parametrize("bad", ["-1Gi", -3, "2GB", "lots", "", "0.5", True, 1.5])
def test_bad_quantity_names_the_field_and_what_was_expected(bad: Any) -> None:
    with pytest.raises(errors.InputError, match=r"^spec\.cache\.memory: .*"):
        parse(cache={"memory": bad})


def test_defaults_fill_every_optional_section() -> None:
    spec = parse()
    assert spec.source.format == "parquet"
    assert spec.source.secret_ref is None
    assert spec.cache.memory == 2 * 2**30
    assert spec.cache.medium == "Memory"
    assert spec.prefetch.depth == 4
    assert spec.sharding.rank_from == "JobCompletionIndex"
    assert spec.checkpoint is None
    assert spec.admission.policy == "Refuse"
    assert spec.sidecar.resources.limits["memory"] == "1Gi"


def test_shuffle_granularity_and_window_default_to_the_librarys_block_mode() -> None:
    sharding = parse().sharding
    assert (sharding.shuffle, sharding.granularity, sharding.window) == (True, "block", 65536)
    sampled = parse(sharding={"granularity": "sample", "window": 4096}).sharding
    assert (sampled.granularity, sampled.window) == ("sample", 4096)


def test_checkpoint_fields_are_parsed_with_defaults() -> None:
    spec = parse(checkpoint={"uri": "s3://ckpt/run/", "restore": "1200"})
    assert spec.checkpoint is not None
    assert spec.checkpoint.keep_last == 3
    assert spec.checkpoint.restore == "1200"
    assert spec.checkpoint.mount_path == "/checkpoints"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"source": {"uri": "bucket/no-scheme"}}, r"spec\.source\.uri: 'bucket/no-scheme'"),
        (
            {"source": {"uri": "s3://b/", "format": "csv"}},
            r"spec\.source\.format: expected one of parquet, arrow, jsonl, found 'csv'",
        ),
        (
            {"source": {"uri": "s3://b/", "secretRef": {}}},
            r"spec\.source\.secretRef\.name: required",
        ),
        (
            {"source": {"uri": "s3://b/"}, "prefetch": {"depth": -2}},
            r"spec\.prefetch\.depth: expected an integer >= 0, found -2",
        ),
        (
            {"source": {"uri": "s3://b/"}, "prefetch": {"depth": "4"}},
            r"spec\.prefetch\.depth: expected an integer",
        ),
        (
            {"source": {"uri": "s3://b/"}, "sharding": {"shuffle": "yes"}},
            r"spec\.sharding\.shuffle: expected true or false",
        ),
        (
            {"source": {"uri": "s3://b/"}, "sharding": {"granularity": "rows"}},
            r"spec\.sharding\.granularity: expected one of block, sample, found 'rows'",
        ),
        (
            {"source": {"uri": "s3://b/"}, "sharding": {"window": 0}},
            r"spec\.sharding\.window: expected an integer >= 1, found 0",
        ),
        (
            {"source": {"uri": "s3://b/"}, "sharding": {"window": "64k"}},
            r"spec\.sharding\.window: expected an integer, found '64k'",
        ),
        (
            {"source": {"uri": "s3://b/"}, "cache": {"memroy": "1Gi"}},
            r"spec\.cache: unknown field 'memroy'",
        ),
        (
            {"source": {"uri": "s3://b/"}, "sidecar": {"resources": {"limits": {"cpu": "-1"}}}},
            r"spec\.sidecar\.resources\.limits\.cpu",
        ),
        ({}, r"spec\.source: required, but missing"),
        ({"source": "s3://b/"}, r"spec\.source: expected an object, found a string"),
    ],
)
def test_invalid_spec_error_names_the_field_path(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(errors.InputError, match=message):
        specs.parse_spec(spec)


def test_cross_field_rule_is_checked_offline() -> None:
    with pytest.raises(errors.InputError, match="rank must be smaller than worldSize"):
        parse(sharding={"rankFrom": "Fixed", "rank": 4, "worldSize": 4})
    fixed = parse(sharding={"rankFrom": "Fixed", "rank": 3, "worldSize": 4})
    assert fixed.sharding.rank == 3


def test_to_dict_round_trips_through_from_dict() -> None:
    spec = parse(checkpoint={"uri": "s3://ckpt/"}, cache={"memory": "1Gi", "medium": "Disk"})
    assert specs.parse_spec(specs.to_dict(spec)) == spec


def test_load_refuses_a_document_that_is_not_a_datasetmount() -> None:
    with pytest.raises(errors.InputError, match=r"expected kind DatasetMount .* found kind 'Pod'"):
        specs.load({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}})


def test_load_takes_the_pinned_digest_from_status_then_from_version() -> None:
    digest = "sha256:" + "ab" * 32
    pinned = "sha256:" + "cd" * 32
    doc = {
        "apiVersion": "shardcache.io/v1alpha1",
        "kind": "DatasetMount",
        "metadata": {"name": "d", "namespace": "ns"},
        "spec": {"source": {"uri": "s3://b/", "version": digest}},
    }
    assert specs.load(doc).manifest_digest == digest
    doc["status"] = {"manifestDigest": pinned, "phase": "Ready"}
    loaded = specs.load(doc)
    assert (loaded.manifest_digest, loaded.phase, loaded.namespace) == (pinned, "Ready", "ns")


def test_format_bytes_uses_binary_units() -> None:
    assert specs.format_bytes(0) == "0"
    assert specs.format_bytes(1536) == "1.5Ki"
    assert specs.format_bytes(3 * 2**40) == "3Ti"


# The API server checks patterns with Go's RE2, where `$` never matches before a final
# newline; Python's `re.match` lets it, and would pass what the API server refuses.
@pytest.mark.parametrize(
    ("spec", "field", "value"),
    [
        ({"source": {"uri": "s3://b/x/", "version": "sha256:" + "a" * 64 + "\n"}},
         r"spec\.source\.version", "sha256:" + "a" * 64 + "\n"),
        ({"source": {"uri": "s3://b/x/\n"}}, r"spec\.source\.uri", "s3://b/x/\n"),
        ({"source": {"uri": "s3://b/x/"}, "checkpoint": {"uri": "s3://c/", "restore": "latest\n"}},
         r"spec\.checkpoint\.restore", "latest\n"),
        ({"source": {"uri": "s3://b/x/", "secretRef": {"name": "s3-creds\n"}}},
         r"spec\.source\.secretRef\.name", "s3-creds\n"),
        ({"source": {"uri": "s3://b/x/"},
          "mixture": {"sources": [{"name": "code\n", "weight": 1, "uri": "s3://b/c/"}]}},
         r"spec\.mixture\.sources\[0\]\.name", "code\n"),
        ({"source": {"uri": "s3://b/x/"}, "cache": {"nodePath": "/var/cache/x\n"}},
         r"spec\.cache\.nodePath", "/var/cache/x\n"),
    ],
)  # fmt: skip
def test_a_value_with_a_trailing_newline_is_refused_showing_the_newline(
    spec: dict[str, Any], field: str, value: str
) -> None:
    with pytest.raises(errors.InputError, match=rf"^{field}: .*{re.escape(repr(value))}"):
        specs.parse_spec(spec)


@pytest.mark.parametrize("text", [" 2Gi", "2Gi ", "2Gi\n", "\t2Gi"])
def test_a_byte_size_with_surrounding_whitespace_is_refused_as_the_api_server_does(
    text: str,
) -> None:
    with pytest.raises(
        errors.InputError, match=rf"^spec\.cache\.memory: .*found {re.escape(repr(text))}$"
    ):
        parse(cache={"memory": text})


@pytest.mark.parametrize("text", [" 2Gi", "2Gi\n", "500m "])
def test_a_resource_quantity_with_surrounding_whitespace_is_refused(text: str) -> None:
    with pytest.raises(
        errors.InputError,
        match=rf"^spec\.sidecar\.resources\.limits\.memory: .*found {re.escape(repr(text))}$",
    ):
        parse(sidecar={"resources": {"limits": {"memory": text}}})
