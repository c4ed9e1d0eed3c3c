"""Sidecar settings: environment, flags, defaults and what a bad value says."""

from __future__ import annotations

from pathlib import Path

import pytest
from shardcache_sidecar import configuration

from shardcache import contract, errors, plans

pytestmark = pytest.mark.unit


def test_layout_follows_run_dir_and_mount_like_the_client() -> None:
    env = {
        contract.ENV_SOURCE_URI: "s3://b/p",
        contract.ENV_RUN_DIR: "/run/sc",
        contract.ENV_MOUNT: "tokens",
        contract.ENV_RANK: "3",
        contract.ENV_WORLD_SIZE: "8",
        contract.ENV_SHUFFLE: "false",
        contract.ENV_MEMORY_LIMIT: "1048576",
    }
    s = configuration.from_env(env)
    assert s.socket_path == Path("/run/sc/tokens/control.sock")
    assert s.memory_dir == Path("/run/sc/tokens/mem")
    assert s.disk_dir == Path(contract.DEFAULT_DISK_DIR)
    assert (s.rank, s.world_size, s.shuffle, s.memory_limit) == (3, 8, False, 1048576)
    assert s.metrics_port == contract.DEFAULT_METRICS_PORT
    assert s.ready_shards == 2
    assert s.manifest_digest is None
    assert s.startup_plan().rank == 3


def test_the_startup_plan_carries_the_mounts_granularity_and_window() -> None:
    env = {
        contract.ENV_SOURCE_URI: "s3://b/p",
        contract.ENV_SEED: "5",
        contract.ENV_SHUFFLE_GRANULARITY: "sample",
        contract.ENV_SHUFFLE_WINDOW: "3000",
    }
    plan = configuration.from_env(env).startup_plan()
    assert (plan.seed, plan.granularity, plan.window, plan.sampled) == (5, "sample", 3000, True)
    # Flags win over the env, as for every other setting.
    flagged = configuration.from_env(env, {"granularity": "block", "window": 10}).startup_plan()
    assert (flagged.granularity, flagged.window, flagged.sampled) == ("block", 10, False)
    assert configuration.from_env({contract.ENV_SOURCE_URI: "s3://b/p"}).startup_plan() == (
        plans.PlanParams()
    )


def test_flags_override_the_environment() -> None:
    env = {contract.ENV_SOURCE_URI: "s3://b/p", contract.ENV_PREFETCH_DEPTH: "9"}
    s = configuration.from_env(
        env,
        {
            "source_uri": "file:///d",
            "prefetch_depth": 2,
            "socket_path": "/tmp/s.sock",
            "seed": None,
        },
    )
    assert (s.source_uri, s.prefetch_depth, s.socket_path) == ("file:///d", 2, Path("/tmp/s.sock"))
    assert s.seed == 0


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, contract.ENV_SOURCE_URI),
        (
            {contract.ENV_READY_SHARDS: "two"},
            f"${contract.ENV_READY_SHARDS}: expected an integer, found 'two'",
        ),
        ({contract.ENV_SHUFFLE: "maybe"}, f"${contract.ENV_SHUFFLE}: expected true or false"),
        (
            {contract.ENV_RANK: "4", contract.ENV_WORLD_SIZE: "4"},
            "rank must be in [0, world_size=4)",
        ),
        (
            {contract.ENV_SHUFFLE_GRANULARITY: "rows"},
            f"${contract.ENV_SHUFFLE_GRANULARITY}: expected block or sample, found 'rows'",
        ),
        (
            {contract.ENV_SHUFFLE_WINDOW: "0"},
            f"${contract.ENV_SHUFFLE_WINDOW}: expected an integer >= 1, found 0",
        ),
        ({contract.ENV_MANIFEST_DIGEST: "md5:x"}, "expected 'sha256:<hex>'"),
        ({contract.ENV_RUN_DIR: "/" + "x" * 120}, "Unix sockets allow at most 107"),
        (
            {contract.ENV_FETCH_CONCURRENCY: "-1"},
            f"${contract.ENV_FETCH_CONCURRENCY}: expected an integer 0-256, found -1",
        ),
        ({"SHARDCACHE_LOG_LEVEL": "LOUD"}, "$SHARDCACHE_LOG_LEVEL: expected LEVEL or"),
        ({"SHARDCACHE_LOG_LEVEL": "INFO,shardcache=LOUD"}, "found 'LOUD' in"),
        ({"SHARDCACHE_LOG_LEVEL": "INFO,nonsense"}, "found 'nonsense' in"),
        ({contract.ENV_MOUNT: "../escaped"}, f"${contract.ENV_MOUNT}: expected a DatasetMount"),
        ({contract.ENV_MOUNT: "a/b"}, "found 'a/b'"),
        ({contract.ENV_MOUNT: "."}, "found '.'"),
    ],
)
def test_bad_settings_say_which_variable_and_what_was_found(
    env: dict[str, str], message: str
) -> None:
    base = {contract.ENV_SOURCE_URI: "s3://b/p"} if env else {}
    with pytest.raises(errors.InputError) as info:
        configuration.from_env({**base, **env})
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"handoff_timeout": float("nan")}, "handoff_timeout: expected a finite number"),
        ({"acquire_timeout": float("nan")}, "acquire_timeout: expected a finite number"),
        ({"acquire_timeout": float("inf")}, "found inf"),
        ({"source_retry_seconds": float("nan")}, "source_retry_seconds: expected a finite"),
        ({"source_retry_seconds": float("inf")}, "found inf"),
        ({"log_level": "LOUD"}, "log level 'LOUD'"),
        ({"mount": "../escaped"}, "--mount: expected a DatasetMount name"),
        ({"mount": "a/b"}, "found 'a/b'"),
        ({"mount": "."}, "found '.'"),
    ],
)
def test_values_given_in_code_are_checked_like_the_flags(
    overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(errors.InputError) as info:
        configuration.from_env({contract.ENV_SOURCE_URI: "s3://b/p"}, overrides)
    assert message in str(info.value)


def test_a_mount_stays_one_directory_below_the_run_directory() -> None:
    # Dotted names are DatasetMount names too (Kubernetes allows them, the webhook
    # injects them); they are still a single path component.
    env = {contract.ENV_SOURCE_URI: "s3://b/p", contract.ENV_RUN_DIR: "/run/sc"}
    s = configuration.from_env({**env, contract.ENV_MOUNT: "web.text-v2"})
    assert s.socket_path == Path("/run/sc/web.text-v2/control.sock")
    assert s.memory_dir == Path("/run/sc/web.text-v2/mem")
