"""spec.checkpoint tuning of the sidecar's checkpoint agent: defaults, values, errors."""

from __future__ import annotations

from typing import Any

import pytest
from shardcache_operator import specs

from shardcache import errors

pytestmark = pytest.mark.unit


def checkpoint_of(**fields: Any) -> specs.CheckpointSpec:
    spec = specs.parse_spec(
        {"source": {"uri": "s3://bucket/train/"}, "checkpoint": {"uri": "s3://ckpt/", **fields}}
    )
    assert spec.checkpoint is not None
    return spec.checkpoint


def test_agent_tuning_defaults_leave_fallback_and_verification_off() -> None:
    checkpoint = checkpoint_of()
    assert checkpoint.restore_fallback is False
    assert checkpoint.concurrency == 8
    assert checkpoint.verify_uploads is False
    assert checkpoint.upload_buffer == 512 * 2**20


def test_agent_tuning_fields_are_read_from_their_json_names() -> None:
    checkpoint = checkpoint_of(
        restoreFallback=True, concurrency=32, verifyUploads=True, uploadBuffer="128Mi"
    )
    assert checkpoint.restore_fallback is True
    assert checkpoint.concurrency == 32
    assert checkpoint.verify_uploads is True
    assert checkpoint.upload_buffer == 128 * 2**20


def test_agent_tuning_round_trips_through_to_dict() -> None:
    spec = specs.parse_spec(
        {
            "source": {"uri": "s3://bucket/train/"},
            "checkpoint": {"uri": "s3://ckpt/", "restoreFallback": True, "concurrency": 3},
        }
    )
    as_dict = specs.to_dict(spec)
    assert as_dict["checkpoint"]["restoreFallback"] is True
    assert as_dict["checkpoint"]["uploadBuffer"] == 512 * 2**20
    assert specs.parse_spec(as_dict) == spec


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"restoreFallback": "yes"},
            r"^spec\.checkpoint\.restoreFallback: expected true or false, found 'yes'$",
        ),
        (
            {"verifyUploads": 1},
            r"^spec\.checkpoint\.verifyUploads: expected true or false, found 1$",
        ),
        ({"concurrency": 0}, r"^spec\.checkpoint\.concurrency: expected an integer >= 1, found 0$"),
        (
            {"concurrency": 257},
            r"^spec\.checkpoint\.concurrency: expected an integer <= 256, found 257$",
        ),
        ({"concurrency": "8"}, r"^spec\.checkpoint\.concurrency: expected an integer, found '8'$"),
        (
            {"concurrency": True},
            r"^spec\.checkpoint\.concurrency: expected an integer, found True$",
        ),
        (
            {"uploadBuffer": "-1Mi"},
            r"^spec\.checkpoint\.uploadBuffer: expected a non-negative byte size",
        ),
        ({"uploadBuffer": "lots"}, r"^spec\.checkpoint\.uploadBuffer: .*found 'lots'$"),
        ({"verifyUpload": True}, r"^spec\.checkpoint: unknown field 'verifyUpload'"),
    ],
)
def test_bad_agent_tuning_names_the_field_and_what_was_expected(
    fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(errors.InputError, match=message):
        checkpoint_of(**fields)
