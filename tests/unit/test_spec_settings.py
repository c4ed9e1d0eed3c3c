"""Operator settings: read once from SHARDCACHE_OPERATOR_* env, then CLI overrides."""

from __future__ import annotations

import pytest
from shardcache_operator import configuration

from shardcache import errors

pytestmark = pytest.mark.unit


def test_defaults_need_no_environment() -> None:
    settings = configuration.from_env({})
    assert settings == configuration.Settings()
    assert settings.webhook_port == 9443
    assert settings.missing_policy == "Refuse"


def test_environment_is_typed_and_overrides_win() -> None:
    env = {
        "SHARDCACHE_OPERATOR_SIDECAR_IMAGE": "reg/sidecar:1",
        "SHARDCACHE_OPERATOR_WEBHOOK_PORT": "8443",
        "SHARDCACHE_OPERATOR_STANDALONE": "true",
        "SHARDCACHE_OPERATOR_NAMESPACES": "ml, research",
        "SHARDCACHE_OPERATOR_BACKOFF_MAX_SECONDS": "60.5",
    }
    settings = configuration.from_env(env, webhook_port=9000, priority=None)
    assert settings.sidecar_image == "reg/sidecar:1"
    assert settings.webhook_port == 9000
    assert settings.standalone is True
    assert settings.namespaces == ("ml", "research")
    assert settings.backoff_max_seconds == 60.5
    assert settings.priority is None


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("WEBHOOK_PORT", "https", "SHARDCACHE_OPERATOR_WEBHOOK_PORT: expected an integer"),
        ("STANDALONE", "maybe", "SHARDCACHE_OPERATOR_STANDALONE: expected true or false"),
        ("MISSING_POLICY", "Ignore", "expected Refuse or Admit, found 'Ignore'"),
    ],
)
def test_bad_environment_values_are_named(name: str, value: str, message: str) -> None:
    with pytest.raises(errors.InputError, match=message):
        configuration.from_env({f"SHARDCACHE_OPERATOR_{name}": value})
