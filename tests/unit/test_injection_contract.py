"""The env the injection writes is exactly what the sidecar's settings read.

The webhook (operator) and the sidecar never import each other; this test holds the two
sides of the environment-variable contract in `shardcache.contract` together.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from shardcache_operator import injection, specs
from shardcache_sidecar import configuration
from shardcache_sidecar.checkpoint import agent_config

from shardcache import contract

pytestmark = pytest.mark.unit

DIGEST = "sha256:" + "5e" * 32


def injected_sidecar_env(spec: dict[str, Any], *, rank: str | None = None) -> dict[str, str]:
    mount = injection.Mount("imagenet", specs.parse_spec(spec), DIGEST)
    pod = {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "trainer"}]}}
    injected = injection.inject(pod, [mount], defaults=injection.SidecarDefaults(image="s:1"))
    (sidecar,) = injected["spec"]["initContainers"]
    env = {e["name"]: e["value"] for e in sidecar["env"] if "value" in e}
    if rank is not None:  # what the downward API would resolve to
        env[contract.ENV_RANK] = rank
    return env


def test_sidecar_settings_read_back_every_injected_value() -> None:
    spec = {
        "source": {"uri": "s3://data/imagenet/", "format": "arrow"},
        "cache": {"memory": "3Gi", "disk": "40Gi"},
        "prefetch": {"depth": 6, "concurrency": 3, "readyShards": 2},
        "sharding": {"seed": 99, "shuffle": False, "blockSize": 512, "worldSize": 8},
        "checkpoint": {
            "uri": "s3://ckpt/run/",
            "keepLast": 4,
            "restore": "1200",
            "restoreFallback": True,
            "concurrency": 12,
            "verifyUploads": True,
            "uploadBuffer": "96Mi",
        },
    }
    settings = configuration.from_env(injected_sidecar_env(spec, rank="5"))
    run_dir = Path(contract.DEFAULT_RUN_DIR)
    assert settings.source_uri == "s3://data/imagenet/"
    assert settings.source_format == "arrow"
    assert settings.manifest_digest == DIGEST
    assert settings.socket_path == contract.socket_path(run_dir, "imagenet")
    assert settings.memory_dir == contract.memory_dir(run_dir, "imagenet")
    assert settings.disk_dir == Path(contract.DEFAULT_DISK_DIR)
    assert (settings.memory_limit, settings.disk_limit) == (3 * 2**30, 40 * 2**30)
    assert (settings.prefetch_depth, settings.fetch_concurrency) == (6, 3)
    assert settings.ready_shards == 2
    assert (settings.seed, settings.shuffle, settings.block_size) == (99, False, 512)
    assert (settings.world_size, settings.rank) == (8, 5)
    assert settings.metrics_port == contract.DEFAULT_METRICS_PORT
    checkpoint = settings.checkpoint
    assert checkpoint is not None
    assert checkpoint.directory == Path("/checkpoints")
    assert (checkpoint.uri, checkpoint.keep_last, checkpoint.restore) == (
        "s3://ckpt/run/",
        4,
        "1200",
    )
    assert (checkpoint.restore_fallback, checkpoint.verify_uploads) == (True, True)
    assert (checkpoint.upload_concurrency, checkpoint.upload_buffer) == (12, 96 * 2**20)


def test_sidecar_settings_accept_the_defaults_of_a_minimal_spec() -> None:
    settings = configuration.from_env(injected_sidecar_env({"source": {"uri": "s3://d/x/"}}))
    assert settings.shuffle is True
    assert settings.checkpoint is None
    assert settings.memory_limit == 2 * 2**30


def test_checkpoint_spec_defaults_are_the_agent_defaults() -> None:
    # Existing DatasetMounts gain the new fields at their defaults: their pods' agents
    # must behave exactly as before, when the webhook wrote none of these variables.
    spec = {"source": {"uri": "s3://d/x/"}, "checkpoint": {"uri": "s3://ckpt/run/"}}
    env = injected_sidecar_env(spec)
    injected = agent_config.CheckpointSettings.from_env(env)
    untuned = agent_config.CheckpointSettings.from_env(
        {contract.ENV_CHECKPOINT_URI: "s3://ckpt/run/", contract.ENV_CHECKPOINT_DIR: "/checkpoints"}
    )
    assert injected is not None
    assert injected == untuned
    assert injected == agent_config.CheckpointSettings(
        directory=Path("/checkpoints"), uri="s3://ckpt/run/"
    )
