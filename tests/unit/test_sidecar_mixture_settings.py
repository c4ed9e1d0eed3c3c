"""The settings of each source a multi-source mount's sidecar serves."""

from __future__ import annotations

from pathlib import Path

import pytest
from shardcache_sidecar import configuration
from shardcache_sidecar.server import running

from shardcache import contract, errors
from shardcache.contract import mixture_sources, variables

pytestmark = pytest.mark.unit

MIXTURE = mixture_sources.Mixture(
    (
        mixture_sources.Source("web", 3, "s3://b/web/", "parquet", "sha256:" + "a" * 64),
        mixture_sources.Source("code", 1, "s3://b/code/", "arrow", "sha256:" + "c" * 64),
        mixture_sources.Source("math", 1, "s3://b/math/"),
    ),
    seed=2,
)


def env(mixture: mixture_sources.Mixture, uri: str = "s3://b/web/") -> dict[str, str]:
    return {
        contract.ENV_SOURCE_URI: uri,
        contract.ENV_RUN_DIR: "/run/sc",
        contract.ENV_MOUNT: "mix",
        contract.ENV_MEMORY_LIMIT: str(3 << 30),
        contract.ENV_METRICS_PORT: "8470",
        variables.MIXTURE.env: variables.MIXTURE.render(mixture),
    }


def test_each_source_gets_its_own_socket_memory_tier_and_share_of_the_memory() -> None:
    settings = configuration.from_env(env(MIXTURE))
    first, code, math = running.source_settings(settings)
    mount_dir = Path("/run/sc/mix")
    assert first.socket_path == mount_dir / "control.sock"
    assert first.metrics_port == 8470 and first.mixture == MIXTURE
    assert (code.source_uri, code.source_format, code.manifest_digest) == (
        "s3://b/code/",
        "arrow",
        "sha256:" + "c" * 64,
    )
    assert code.socket_path == mount_dir / "sources" / "code" / "control.sock"
    assert math.memory_dir == mount_dir / "sources" / "math" / "mem"
    assert math.source_format is None and math.manifest_digest is None
    # One run volume, sized for cache.memory, shared out equally.
    assert {s.memory_limit for s in (first, code, math)} == {1 << 30}
    # Only the first source has the ports the pod's probes and the checkpoint agent use.
    assert (code.metrics_port, code.ui_port, code.checkpoint, code.mixture) == (0, 0, None, None)


def test_a_single_source_sidecar_serves_its_one_source_unchanged() -> None:
    plain = env(MIXTURE)
    del plain[variables.MIXTURE.env]
    settings = configuration.from_env(plain)
    assert running.source_settings(settings) == [settings]


def test_the_first_source_must_be_the_mounts_own() -> None:
    with pytest.raises(errors.InputError, match="expected its first source to be the mount's own"):
        configuration.from_env(env(MIXTURE, uri="s3://b/other/"))


def test_a_malformed_mixture_variable_names_the_variable() -> None:
    bad = {**env(MIXTURE), variables.MIXTURE.env: "{not json"}
    with pytest.raises(errors.InputError, match=r"\$SHARDCACHE_MIXTURE: expected a mixture"):
        configuration.from_env(bad)
