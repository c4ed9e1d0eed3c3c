"""The chart's uninstall guard, rendered with `helm template` (no cluster): a pre-delete
hook Job that runs the guard with the operator's identity, image and placement, over the
namespaces the operator serves, and nothing when off."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import toolpaths
from tests.unit.test_chart_operator_render import CHART, helm_template, rendered

pytestmark = pytest.mark.unit


def guard_jobs(tmp_path: Path, *args: str) -> list[dict[str, Any]]:
    return [
        d
        for d in rendered(tmp_path, *args)
        if d["kind"] == "Job" and d["metadata"]["name"].endswith("-uninstall-guard")
    ]


def test_the_guard_is_a_pre_delete_hook_running_as_the_operator(tmp_path: Path) -> None:
    documents = rendered(
        tmp_path, "--set=operator.nodeSelector.pool=system", "--set=operator.image.tag=abc"
    )
    (job,) = [d for d in documents if d["kind"] == "Job"]
    annotations = job["metadata"]["annotations"]
    assert annotations["helm.sh/hook"] == "pre-delete"
    # A refused try's Job is kept for its log, and replaced by the next try.
    assert annotations["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded"
    assert job["spec"]["backoffLimit"] == 0
    pod = job["spec"]["template"]["spec"]
    (deployment,) = [d for d in documents if d["kind"] == "Deployment"]
    operator_pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == operator_pod["serviceAccountName"]
    assert pod["nodeSelector"] == {"pool": "system"} == operator_pod["nodeSelector"]
    assert pod["restartPolicy"] == "Never"
    (container,) = pod["containers"]
    assert (
        container["image"] == operator_pod["containers"][0]["image"] == "localhost/shardcache:abc"
    )
    assert container["command"] == [
        "python3", "-m", "shardcache_operator.uninstall_guard",
        "--release=rel", "--revision=1", "--release-namespace=rel-system",
    ]  # fmt: skip
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_a_namespaced_release_guards_only_its_namespaces(tmp_path: Path) -> None:
    (job,) = guard_jobs(tmp_path, "--set=operator.watchNamespaces={team-a,team-b}")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["command"][6:] == ["--namespace=team-a", "--namespace=team-b"]


def test_the_guard_off_renders_no_job(tmp_path: Path) -> None:
    assert guard_jobs(tmp_path, "--set=uninstallGuard.enabled=false") == []


def test_the_job_name_fits_a_label_value_for_the_longest_release_name(tmp_path: Path) -> None:
    helm = toolpaths.tool_binary("helm", "HELM_VERSION", "helm")
    home = {k: str(tmp_path / k) for k in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME")}
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"} | home
    longest = "r" * 53  # helm refuses longer release names
    result = subprocess.run(
        [str(helm), "template", longest, str(CHART), "--show-only=templates/uninstall-guard.yaml"],
        capture_output=True, text=True, check=False, timeout=60, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (job,) = [d for d in yaml.safe_load_all(result.stdout) if d]
    # The Job's name is also a label value on its pods (batch.kubernetes.io/job-name).
    assert len(job["metadata"]["name"]) <= 63
    assert job["metadata"]["name"] == "r" * 47 + "-uninstall-guard"


def test_a_bad_deadline_is_refused_by_the_schema(tmp_path: Path) -> None:
    result = helm_template(tmp_path, "--set=uninstallGuard.activeDeadlineSeconds=0")
    assert result.returncode != 0
    assert "activeDeadlineSeconds" in result.stderr
