"""The `kube_cluster` fixture: a real control plane (tests/cluster/cluster.py) for e2e.

If `make cluster-up` already started one, the session uses it and leaves it running;
otherwise the fixture starts it and stops it when the session ends.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess
import sys
from collections.abc import Iterator

import kubernetes.client
import kubernetes.config
import pytest

from tests.support import toolpaths

CLUSTER_SCRIPT = toolpaths.REPO_ROOT / "tests" / "cluster" / "cluster.py"
CLUSTER_DIR = toolpaths.REPO_ROOT / ".cluster"
# A cold start is etcd + API server bootstrap + the default ServiceAccount + Ready nodes.
UP_TIMEOUT_S = 400.0


@dataclasses.dataclass(frozen=True)
class KubeCluster:
    kubeconfig: pathlib.Path
    helm: pathlib.Path
    kubectl: pathlib.Path
    server: str
    ca_file: pathlib.Path

    def api_client(self) -> kubernetes.client.ApiClient:
        """A new client as the cluster admin (system:masters); close it when done."""
        client: kubernetes.client.ApiClient = kubernetes.config.new_client_from_config(  # type: ignore[no-untyped-call]
            config_file=str(self.kubeconfig)
        )
        return client

    def token_client(self, token: str) -> kubernetes.client.ApiClient:
        """A new client that authenticates with a bearer token (a ServiceAccount's)."""
        configuration = kubernetes.client.Configuration()
        configuration.host = self.server
        configuration.ssl_ca_cert = str(self.ca_file)
        configuration.api_key = {"authorization": token}
        configuration.api_key_prefix = {"authorization": "Bearer"}
        return kubernetes.client.ApiClient(configuration)


def run_cluster_script(command: str) -> subprocess.CompletedProcess[str]:
    # The fixture's own limit: pytest's per-test timeout covers test bodies only
    # (timeout_func_only), so a slow cold start fails here, saying what it waited for.
    try:
        return subprocess.run(
            [sys.executable, str(CLUSTER_SCRIPT), command],
            capture_output=True,
            text=True,
            timeout=UP_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(
            f"`cluster.py {command}` did not finish within {UP_TIMEOUT_S:g} s "
            f"(a cold API server, etcd and tool start); output so far:\n{exc.stdout!r}\n"
            f"{exc.stderr!r}",
            pytrace=False,
        )


def cluster_is_up() -> bool:
    return run_cluster_script("status").returncode == 0


@pytest.fixture(scope="session")
def kube_cluster() -> Iterator[KubeCluster]:
    started_here = not cluster_is_up()
    if started_here:
        result = run_cluster_script("up")
        if result.returncode != 0:
            run_cluster_script("down")
            pytest.fail(
                f"cluster up failed ({result.returncode}):\n{result.stdout}\n{result.stderr}",
                pytrace=False,
            )
    state = json.loads((CLUSTER_DIR / "state.json").read_text())
    try:
        yield KubeCluster(
            kubeconfig=CLUSTER_DIR / "kubeconfig",
            helm=CLUSTER_DIR / "bin" / "helm",
            kubectl=CLUSTER_DIR / "bin" / "kubectl",
            server=str(state["server"]),
            ca_file=CLUSTER_DIR / "pki" / "ca.crt",
        )
    finally:
        if started_here:
            result = run_cluster_script("down")
            if result.returncode != 0:
                raise RuntimeError(f"cluster down failed:\n{result.stdout}\n{result.stderr}")
