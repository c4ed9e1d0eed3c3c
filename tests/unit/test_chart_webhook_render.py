"""The chart's MutatingWebhookConfiguration, rendered with `helm template` (no cluster):
which namespaces' pods the webhook sees."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import toolpaths

pytestmark = pytest.mark.unit

CHART = toolpaths.REPO_ROOT / "helm" / "shardcache"


def webhook_configuration(tmp_path: Path, *args: str) -> dict[str, Any]:
    helm = toolpaths.tool_binary("helm", "HELM_VERSION", "helm")
    home = {k: str(tmp_path / k) for k in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME")}
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"} | home
    rendered = subprocess.run(
        [str(helm), "template", "rel", str(CHART), "--namespace=rel-system",
         "--show-only=templates/webhook.yaml", *args],
        capture_output=True, text=True, check=True, timeout=60, env=env,
    ).stdout  # fmt: skip
    (config,) = [
        doc
        for doc in yaml.safe_load_all(rendered)
        if doc and doc["kind"] == "MutatingWebhookConfiguration"
    ]
    return config  # type: ignore[no-any-return]


def selector(config: dict[str, Any]) -> dict[str, Any]:
    (hook,) = config["webhooks"]
    return hook["namespaceSelector"]  # type: ignore[no-any-return]


def test_a_namespaced_release_webhook_sees_exactly_its_watched_namespaces(
    tmp_path: Path,
) -> None:
    config = webhook_configuration(tmp_path, "--set=operator.watchNamespaces={team-a,team-b}")
    assert selector(config) == {
        "matchExpressions": [
            {
                "key": "kubernetes.io/metadata.name",
                "operator": "In",
                "values": ["team-a", "team-b"],
            }
        ]
    }


def test_a_cluster_wide_release_webhook_sees_all_but_its_own_and_kube_system(
    tmp_path: Path,
) -> None:
    assert selector(webhook_configuration(tmp_path)) == {
        "matchExpressions": [
            {
                "key": "kubernetes.io/metadata.name",
                "operator": "NotIn",
                "values": ["kube-system", "rel-system"],
            }
        ]
    }


def test_an_explicit_namespace_selector_wins_over_the_watched_namespaces(
    tmp_path: Path,
) -> None:
    config = webhook_configuration(
        tmp_path,
        "--set=operator.watchNamespaces={team-a}",
        "--set=webhook.namespaceSelector.matchLabels.shardcache=on",
    )
    assert selector(config) == {"matchLabels": {"shardcache": "on"}}
