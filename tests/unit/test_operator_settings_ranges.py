"""Operator settings and start-up inputs are refused at start, naming what is wrong:
out-of-range numbers and paths (env and flags), and a missing or broken kubeconfig."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
from shardcache_operator import configuration, injection, read_workers, webhook

from shardcache import errors

pytestmark = pytest.mark.unit

OPERATOR = [sys.executable, "-m", "shardcache", "operator"]


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("WEBHOOK_PORT", "99999", "an integer 0-65535"),
        ("HEALTH_PORT", "-1", "an integer 0-65535"),
        ("BACKOFF_INITIAL_SECONDS", "nan", "finite seconds > 0"),
        ("BACKOFF_MAX_SECONDS", "-5", "finite seconds > 0"),
        ("PODS_INTERVAL_SECONDS", "-1", "finite seconds > 0"),
        ("RESOLVE_TIMEOUT_SECONDS", "0", "finite seconds > 0"),
        ("SOURCE_CHECK_SECONDS", "inf", "finite seconds > 0"),
        ("STALL_CHECK_SECONDS", "-1", "finite seconds >= 0 (0: off)"),
        ("SIDECAR_UID", "0", ">= 1"),
        ("STARTUP_TIMEOUT_SECONDS", "-10", ">= 1"),
        ("RUN_DIR", "relative/run", "an absolute, normalised path"),
        ("RUN_DIR", "/run/shardcache/", "an absolute, normalised path"),
        ("RUN_DIR", "/run/../etc", "an absolute, normalised path"),
        ("NODE_PATHS", "/var/cache/shardcache,relative/cache", "an absolute path"),
        ("RESOLVE_MEMORY", "lots", "a byte size like '64Gi'"),
        ("RESOLVE_MEMORY", "159Mi", "a byte size of at least 160Mi"),
        ("RESOLVE_CHILDREN", "-1", "an integer >= 0"),
        ("RESOLVE_CHILDREN", "two", "an integer"),
        ("READ_WORKERS", "0", "an integer >= 1"),
        ("READ_WORKERS", "two", "an integer"),
    ],
)
def test_out_of_range_settings_are_refused_naming_variable_expected_and_found(
    name: str, value: str, expected: str
) -> None:
    with pytest.raises(errors.InputError) as refused:
        configuration.from_env({f"SHARDCACHE_OPERATOR_{name}": value})
    message = str(refused.value)
    assert message.startswith(f"$SHARDCACHE_OPERATOR_{name}: expected "), message
    assert expected in message and "found" in message, message


def test_documented_edges_are_accepted() -> None:
    settings = configuration.from_env(
        {
            "SHARDCACHE_OPERATOR_WEBHOOK_PORT": "0",
            "SHARDCACHE_OPERATOR_HEALTH_PORT": "65535",
            "SHARDCACHE_OPERATOR_STALL_CHECK_SECONDS": "0",
            "SHARDCACHE_OPERATOR_PODS_INTERVAL_SECONDS": "0.5",
            "SHARDCACHE_OPERATOR_SIDECAR_UID": "1000",
            "SHARDCACHE_OPERATOR_RUN_DIR": "/run/sc",
            "SHARDCACHE_OPERATOR_NODE_PATHS": "/var/cache/shardcache, /mnt/nvme",
        }
    )
    assert (settings.webhook_port, settings.health_port) == (0, 65535)
    assert settings.stall_check_seconds == 0
    assert settings.node_paths == ("/var/cache/shardcache", "/mnt/nvme")


def test_the_resolve_memory_is_a_quantity_with_a_floor_and_a_default() -> None:
    assert configuration.Settings().resolve_memory == 256 << 20
    settings = configuration.from_env({"SHARDCACHE_OPERATOR_RESOLVE_MEMORY": "160Mi"})
    assert settings.resolve_memory == configuration.MIN_RESOLVE_MEMORY == 160 << 20


def test_the_resolve_children_are_sized_from_the_memory_limit_unless_set() -> None:
    assert configuration.Settings().resolve_children == 0
    settings = configuration.from_env({"SHARDCACHE_OPERATOR_RESOLVE_CHILDREN": "3"})
    assert settings.resolve_children == 3


def test_the_read_workers_are_two_unless_set() -> None:
    assert configuration.Settings().read_workers == read_workers.WORKERS == 2
    settings = configuration.from_env({"SHARDCACHE_OPERATOR_READ_WORKERS": "5"})
    assert settings.read_workers == 5


def test_overrides_are_held_to_the_same_ranges() -> None:
    with pytest.raises(errors.InputError, match="health_port: expected an integer 0-65535"):
        configuration.from_env({}, health_port=99999)
    assert configuration.from_env({}, health_port=0, namespaces=("a", "b")).namespaces == (
        "a",
        "b",
    )


def test_every_setting_has_a_parser() -> None:
    """A numeric setting must say its range (`_PARSERS`), never fall back to its type."""
    for field in dataclasses.fields(configuration.Settings):
        assert configuration.parser(field.name).kind


def test_the_sidecar_uid_is_defined_once_and_reaches_the_injected_defaults() -> None:
    assert injection.SidecarDefaults(image="x").run_as_user == configuration.Settings.sidecar_uid
    settings = configuration.from_env({"SHARDCACHE_OPERATOR_SIDECAR_UID": "1000"})
    assert webhook.defaults_of(settings).run_as_user == 1000


def run(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "KUBECONFIG": str(home / "none")}
    env |= {k: v for k, v in os.environ.items() if k == "PYTHONPATH"}
    return subprocess.run(
        [*OPERATOR, "--standalone", "--health-addr", "127.0.0.1", "--health-port", "0", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )


def one_line_refusal(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("shardcache")]
    return line


def test_a_missing_kubeconfig_is_one_line_naming_the_file(tmp_path: Path) -> None:
    line = one_line_refusal(run("--kubeconfig", str(tmp_path / "nope"), home=tmp_path))
    assert line == (
        f"shardcache operator: kubeconfig {tmp_path / 'nope'}: expected a kubeconfig file, "
        "found no such file"
    )


@pytest.mark.parametrize(
    ("text", "found"),
    [("garbage: [\n", "malformed YAML"), ("- a\n", "a document the client cannot read")],
)
def test_a_broken_kubeconfig_is_one_line_naming_the_file(
    tmp_path: Path, text: str, found: str
) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text(text)
    line = one_line_refusal(run("--kubeconfig", str(path), home=tmp_path))
    assert line.startswith(f"shardcache operator: kubeconfig {path}: expected a kubeconfig")
    assert found in line


def test_no_kubeconfig_outside_a_cluster_says_where_it_looked(tmp_path: Path) -> None:
    line = one_line_refusal(run(home=tmp_path))
    assert f"kubeconfig {tmp_path / 'none'} (not in a cluster" in line
    assert "--kubeconfig" in line


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        (
            "--health-port",
            "99999",
            "argument --health-port: expected an integer 0-65535, found 99999",
        ),
        ("--webhook-port", "-1", "argument --webhook-port: expected an integer 0-65535, found -1"),
        ("--log-level", "verbose", "argument --log-level: expected LEVEL"),
    ],
)
def test_out_of_range_flags_are_refused_by_name(
    tmp_path: Path, flag: str, value: str, expected: str
) -> None:
    result = run(flag, value, home=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert expected in result.stderr, result.stderr
