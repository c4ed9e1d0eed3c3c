"""spec.checkpoint tuning of the sidecar's checkpoint agent: defaults, values, errors."""

from __future__ import annotations

import re
from typing import Any

import celpy
import celpy.adapter
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


@pytest.mark.parametrize(
    "path",
    ["/", "/a/../checkpoints", "/a/./b", "/..", "/checkpoints/", "//checkpoints", "checkpoints",
     "/checkpoints\n", ""],
)  # fmt: skip
def test_a_checkpoint_mount_path_that_is_not_a_normalised_absolute_path_is_refused(
    path: str,
) -> None:
    with pytest.raises(
        errors.InputError,
        match=r"^spec\.checkpoint\.mountPath: expected an absolute path .*, found "
        + re.escape(repr(path))
        + "$",
    ):
        checkpoint_of(mountPath=path)


@pytest.mark.parametrize(
    "path",
    ["/var/cache/shardcache", "/var/cache/shardcache/ckpt", "/var/cache", "/var",
     "/var/run/shardcache", "/var/run/shardcache/imagenet", "/var/run/shardcache/imagenet/c"],
)  # fmt: skip
def test_a_checkpoint_mount_path_at_or_around_the_sidecars_own_directories_is_refused(
    path: str,
) -> None:
    with pytest.raises(
        errors.InputError,
        match=r"^spec\.checkpoint: mountPath: must not be, hold or lie inside the cache "
        r"sidecar's own directories /var/cache/shardcache .* and /var/run/shardcache .*, "
        rf"found {re.escape(repr(path))}$",
    ):
        checkpoint_of(mountPath=path)


@pytest.mark.parametrize(
    "path",
    ["/checkpoints", "/home/me/.cache/ckpt", "/var/cache/shardcache-ckpt", "/var/run/ckpt",
     "/mnt/.../x", "/data/run 1"],
)  # fmt: skip
def test_a_checkpoint_mount_path_beside_the_sidecars_directories_is_accepted(path: str) -> None:
    assert checkpoint_of(mountPath=path).mount_path == path


CHECKPOINT_RULE_PATHS = [
    "/checkpoints", "/var/cache/shardcache", "/var/cache/shardcache/x", "/var/cache",
    "/var/cache/shardcache-x", "/var/run/shardcache", "/var/run/shardcache/m", "/var/run",
    "/var/runx", "/",
]  # fmt: skip


@pytest.mark.parametrize("path", CHECKPOINT_RULE_PATHS)
def test_the_checkpoint_path_cel_rule_and_its_python_check_agree(path: str) -> None:
    (rule,) = [r for r in specs.CheckpointSpec.rules if "mountPath" in r.cel]
    env = celpy.Environment()
    program = env.program(env.compile(rule.cel))
    cel = bool(program.evaluate({"self": celpy.adapter.json_to_cel({"mountPath": path})}))
    model = specs.CheckpointSpec(uri="s3://ckpt/", mount_path=path)
    assert cel == rule.check(model)
