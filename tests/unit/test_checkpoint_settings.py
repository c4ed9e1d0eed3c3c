"""The checkpoint agent's settings, from the env the webhook injects."""

from __future__ import annotations

from pathlib import Path

import pytest
from shardcache_sidecar.checkpoint import agent_config

from shardcache import contract, errors

pytestmark = pytest.mark.unit

BASE = {contract.ENV_CHECKPOINT_URI: "s3://b/run", contract.ENV_CHECKPOINT_DIR: "/checkpoints"}


def test_no_uri_means_no_agent() -> None:
    assert agent_config.CheckpointSettings.from_env({}) is None


def test_defaults_and_overrides_from_env() -> None:
    s = agent_config.CheckpointSettings.from_env(BASE)
    assert s is not None
    assert (s.directory, s.uri, s.keep_last, s.restore, s.restore_fallback) == (
        Path("/checkpoints"),
        "s3://b/run",
        3,
        "latest",
        False,
    )
    s = agent_config.CheckpointSettings.from_env(
        {
            **BASE,
            contract.ENV_CHECKPOINT_KEEP_LAST: "5",
            contract.ENV_CHECKPOINT_RESTORE: "1200",
            contract.ENV_CHECKPOINT_RESTORE_FALLBACK: "true",
            contract.ENV_CHECKPOINT_CONCURRENCY: "16",
            contract.ENV_CHECKPOINT_VERIFY_UPLOADS: "yes",
            contract.ENV_CHECKPOINT_UPLOAD_BUFFER: str(64 << 20),
        }
    )
    assert s is not None
    assert (s.keep_last, s.restore, s.restore_fallback, s.upload_concurrency) == (
        5,
        "1200",
        True,
        16,
    )
    assert (s.verify_uploads, s.upload_buffer) == (True, 64 << 20)


def test_switches_set_to_false_stay_off() -> None:
    s = agent_config.CheckpointSettings.from_env(
        {
            **BASE,
            contract.ENV_CHECKPOINT_RESTORE_FALLBACK: "false",
            contract.ENV_CHECKPOINT_VERIFY_UPLOADS: "0",
        }
    )
    assert s is not None
    assert (s.restore_fallback, s.verify_uploads) == (False, False)


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({contract.ENV_CHECKPOINT_KEEP_LAST: "0"}, "KEEP_LAST: expected an integer >= 1, found 0"),
        ({contract.ENV_CHECKPOINT_KEEP_LAST: "many"}, "expected an integer, found 'many'"),
        ({contract.ENV_CHECKPOINT_RESTORE: "newest"}, "expected latest, none or a step"),
        ({contract.ENV_CHECKPOINT_URI: "ftp://x/y"}, "unsupported URI scheme"),
        ({contract.ENV_CHECKPOINT_DIR: ""}, "CHECKPOINT_DIR is not"),
        ({contract.ENV_CHECKPOINT_CONCURRENCY: "0"}, "CONCURRENCY: expected an integer 1-256"),
        ({contract.ENV_CHECKPOINT_UPLOAD_BUFFER: "-1"}, "BUFFER_BYTES: expected a byte count >= 0"),
        (
            {contract.ENV_CHECKPOINT_VERIFY_UPLOADS: "ture"},
            "VERIFY_UPLOADS: expected true or false",
        ),
        ({contract.ENV_CHECKPOINT_RESTORE_FALLBACK: "maybe"}, "found 'maybe'"),
    ],
)
def test_bad_settings_name_the_variable(env: dict[str, str], match: str) -> None:
    with pytest.raises(errors.InputError, match=match):
        agent_config.CheckpointSettings.from_env({**BASE, **env})


@pytest.mark.parametrize(
    ("value", "parsed"), [("latest", "latest"), ("none", None), ("NONE", None), ("42", 42)]
)
def test_restore_choice(value: str, parsed: object) -> None:
    assert agent_config.parse_restore(value) == parsed


@pytest.mark.parametrize("value", ["²", "١٢", "4²"])
def test_restore_step_in_digits_other_than_ascii_is_refused_naming_the_variable(
    value: str,
) -> None:
    # str.isdigit() takes these; int() does not (or reads them as another number).
    with pytest.raises(errors.InputError, match="RESTORE: expected latest, none or a step"):
        agent_config.parse_restore(value)
    with pytest.raises(errors.InputError, match="expected latest, none or a step"):
        agent_config.CheckpointSettings.from_env({**BASE, contract.ENV_CHECKPOINT_RESTORE: value})
