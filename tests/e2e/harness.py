"""The e2e harness: one suite, two cluster providers (SHARDCACHE_E2E_CLUSTER).

  local (default)  the control plane of tests/cluster/cluster.py on loopback (etcd,
                   kube-apiserver, kube-controller-manager, kube-scheduler, kwok fake
                   nodes). No kubelet runs, so the chart's operator Deployment never runs
                   a process: the operator runs here as a local process under the chart's
                   own ServiceAccount (a kubeconfig with a TokenRequest token), and the
                   chart's webhook configuration points at it (webhook.url, external mode).
  kind             an existing kind cluster (`make e2e CLUSTER=kind` creates it and loads
                   the images): the operator runs in-cluster from the chart's Deployment
                   and the webhook goes through the chart's Service and generated CA.

Tests talk to the cluster and to an `Operator` only through what this module exposes, so
they are the same code for both providers.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import os
import pathlib
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol, TypeVar, cast

import kubernetes.client
import kubernetes.config
import pyarrow.fs
from kubernetes.client import ApiException
from shardcache_sidecar.listening import free_port

import shardcache
from tests.support import processes, toolpaths

PROVIDER_ENV = "SHARDCACHE_E2E_CLUSTER"
PROVIDERS = ("local", "kind")
REPO_ROOT = toolpaths.REPO_ROOT
CHART_DIR = REPO_ROOT / "helm" / "shardcache"
RELEASE = "shardcache"
RELEASE_NAMESPACE = "shardcache-system"
HOST = "127.0.0.1"
#: The chart names the operator's ServiceAccount after the release's full name.
SERVICE_ACCOUNT = "shardcache"
#: Kubernetes release the chart is rendered for without a cluster (helm template).
KUBE_VERSION = toolpaths.parse_versions(toolpaths.VERSIONS_FILE.read_text())["KUBE_VERSION"]
#: The one image (images/image.toml) runs both the operator and the sidecar; its
#: archive (`make image-archives`) carries this name, which `make e2e CLUSTER=kind`
#: loads. The local provider runs no image.
OPERATOR_IMAGE = ("localhost/shardcache", shardcache.__version__)
SIDECAR_IMAGE = OPERATOR_IMAGE
#: Operator start-up: interpreter, kopf, the kubernetes client, first list calls.
OPERATOR_READY_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 20.0
#: Fast operator timings, so status and deletion tests wait seconds, not minutes.
OPERATOR_SETTINGS = {
    "podsIntervalSeconds": 2,
    "deletionPollSeconds": 2,
    "backoffInitialSeconds": 1,
    "backoffMaxSeconds": 5,
    "resolveTimeoutSeconds": 60,
    # DataStarved is checked every second, so test_data_starved sees it set and cleared.
    "stallCheckSeconds": 1,
}

T = TypeVar("T")


def provider_name() -> str:
    name = os.environ.get(PROVIDER_ENV, "local") or "local"
    if name not in PROVIDERS:
        raise ValueError(f"{PROVIDER_ENV}: expected one of {', '.join(PROVIDERS)}, found {name!r}")
    return name


def wait_until(
    what: str,
    check: Callable[[], T | None],
    *,
    timeout: float,
    interval: float = 0.5,
    describe: Callable[[], str] | None = None,
) -> T:
    """Poll `check()` until it returns something other than None/False; bounded.

    On time-out the failure names what was awaited and, through `describe`, what was
    last seen, so a red test says why without rerunning it.
    """
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            value = check()
            if value is not None and value is not False:
                return value
        except ApiException as exc:  # transient API errors while things settle
            last_error = exc
        if time.monotonic() >= deadline:
            break
        time.sleep(interval)
    seen = describe() if describe else ""
    error = f"; last API error: {last_error}" if last_error else ""
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}{error}\n{seen}")


# -- tools and API access ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Cluster:
    """What every test needs of a cluster, whichever provider made it."""

    provider: str
    kubeconfig: pathlib.Path
    helm: pathlib.Path
    kubectl: pathlib.Path
    server: str
    ca_file: pathlib.Path | None

    def api_client(self) -> kubernetes.client.ApiClient:
        """A new admin client; close it when done."""
        config = str(self.kubeconfig)
        client = kubernetes.config.new_client_from_config(config_file=config)  # type: ignore[no-untyped-call]
        return cast(kubernetes.client.ApiClient, client)

    def run(
        self, tool: str, *args: str, stdin: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run helm or kubectl against this cluster as its admin."""
        binary = {"helm": self.helm, "kubectl": self.kubectl}[tool]
        result = subprocess.run(
            [str(binary), f"--kubeconfig={self.kubeconfig}", *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
            env={
                **clean_env(),
                "HELM_CACHE_HOME": str(helm_home() / "cache"),
                "HELM_CONFIG_HOME": str(helm_home() / "config"),
                "HELM_DATA_HOME": str(helm_home() / "data"),
            },
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"{tool} {' '.join(args)} exited with {result.returncode}:\n"
                f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
            )
        return result


def helm_home() -> pathlib.Path:
    # helm writes caches and a repository config; keep them out of $HOME and the repo.
    path = pathlib.Path(tempfile.gettempdir()) / "shardcache-e2e-helm"
    path.mkdir(exist_ok=True)
    return path


def clean_env() -> dict[str, str]:
    """This process's environment minus anything that would pick credentials or a
    cluster for a child: children get exactly the kubeconfig they are given."""
    drop = ("KUBECONFIG",)
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("AWS_")}


def token_kubeconfig(server: str, ca_file: pathlib.Path | None, token: str, user: str) -> str:
    cluster: dict[str, Any] = {"server": server}
    if ca_file is not None:
        cluster["certificate-authority-data"] = base64.b64encode(ca_file.read_bytes()).decode()
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "e2e", "cluster": cluster}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": user}}],
        "current-context": "e2e",
    }
    return json.dumps(doc, indent=2) + "\n"


def service_account_token(
    admin: kubernetes.client.ApiClient, namespace: str, name: str, seconds: int = 3600
) -> str:
    """A bound token of the ServiceAccount, minted by the API server's TokenRequest."""
    response = kubernetes.client.CoreV1Api(admin).create_namespaced_service_account_token(
        name,
        namespace,
        kubernetes.client.AuthenticationV1TokenRequest(
            spec=kubernetes.client.V1TokenRequestSpec(audiences=[], expiration_seconds=seconds)
        ),
    )
    assert response.status is not None, "a TokenRequest answered without a status"
    return str(response.status.token)


# -- object store -----------------------------------------------------------------------


class ObjectStore(Protocol):
    """An S3-compatible server reachable from this process and from the operator."""

    @property
    def endpoint_url(self) -> str: ...
    @property
    def access_key(self) -> str: ...
    @property
    def secret_key(self) -> str: ...
    @property
    def region(self) -> str: ...
    def filesystem(self, **options: object) -> pyarrow.fs.S3FileSystem: ...
    def make_bucket(self, prefix: str = "t") -> str: ...


def uninstall_leftover_release(cluster: Cluster, release: str, namespace: str) -> bool:
    """Uninstall the helm release `release` from `namespace` where an interrupted earlier
    session on a reused cluster left it (a new install would collide); whether it did."""
    if cluster.run("helm", "status", release, "-n", namespace, check=False).returncode != 0:
        return False
    cluster.run("helm", "uninstall", release, "-n", namespace)
    return True


def store_env(store: ObjectStore) -> dict[str, str]:
    """The AWS variables that point an SDK (or a subprocess) at `store`."""
    return {
        "AWS_ACCESS_KEY_ID": store.access_key,
        "AWS_SECRET_ACCESS_KEY": store.secret_key,
        "AWS_ENDPOINT_URL": store.endpoint_url,
        "AWS_REGION": store.region,
    }


@dataclasses.dataclass(frozen=True)
class ExternalObjectStore:
    """kind: an S3 endpoint given by the environment, reachable from pods and from here."""

    endpoint_url: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"

    @classmethod
    def from_env(cls) -> ExternalObjectStore:
        try:
            return cls(
                os.environ["SHARDCACHE_E2E_S3_ENDPOINT"],
                os.environ["SHARDCACHE_E2E_S3_ACCESS_KEY"],
                os.environ["SHARDCACHE_E2E_S3_SECRET_KEY"],
            )
        except KeyError as exc:
            raise RuntimeError(
                f"{PROVIDER_ENV}=kind needs an S3 endpoint that pods and this host both "
                f"reach: set SHARDCACHE_E2E_S3_ENDPOINT, _ACCESS_KEY, _SECRET_KEY ({exc} is unset)"
            ) from exc

    def filesystem(self, **options: object) -> pyarrow.fs.S3FileSystem:
        scheme, _, host_port = self.endpoint_url.partition("://")
        kwargs: dict[str, object] = {
            "access_key": self.access_key,
            "secret_key": self.secret_key,
            "endpoint_override": host_port,
            "scheme": scheme,
            "region": self.region,
        }
        kwargs.update(options)
        return pyarrow.fs.S3FileSystem(**kwargs)

    def make_bucket(self, prefix: str = "t") -> str:
        name = f"{prefix}-{secrets.token_hex(6)}".lower()
        self.filesystem(allow_bucket_creation=True).create_dir(name)
        return name


# -- the operator ------------------------------------------------------------------------


class Operator(Protocol):
    """The running operator, wherever it runs."""

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def restart(self) -> None: ...
    def metrics(self) -> str: ...
    def logs(self) -> str: ...


def log_mentions(operator: Operator, text: str) -> int:
    """How often the operator's log says `text`: the whole log of a local process (it is
    appended across restarts); the recent tail of an in-cluster one.

    Tests wait for the count to grow (kopf logs every timer round and every retry of a
    handler) rather than sleep for "a few rounds".
    """
    path = getattr(operator, "log_path", None)
    if isinstance(path, pathlib.Path):
        try:
            return path.read_text(errors="replace").count(text)
        except FileNotFoundError:
            return 0
    return operator.logs().count(text)


def metric_value(text: str, name: str, labels: Mapping[str, str] | None = None) -> float:
    """Sum of the samples of `name` whose labels include `labels` (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        match = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)", line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(3) or ""))
        if all(found.get(k) == v for k, v in (labels or {}).items()):
            total += float(match.group(4))
    return total


class LocalOperator:
    """`shardcache operator` as a local process with the chart's ServiceAccount identity.

    It serves the webhook on 127.0.0.1 with a certificate the chart's webhook
    configuration trusts (webhook.caBundle), and /healthz, /readyz, /metrics next to it.
    """

    def __init__(
        self,
        workdir: pathlib.Path,
        kubeconfig: pathlib.Path,
        tls_dir: pathlib.Path,
        webhook_port: int,
        sidecar_image: str,
        source_endpoints: tuple[str, ...] = (),
        manifest_namespaces: tuple[str, ...] = (),
    ) -> None:
        self.workdir = workdir
        # Where it hands pinned manifests to sidecars: the chart's rbac.manifestNamespaces.
        self.manifest_namespaces = manifest_namespaces
        # The object store listens on loopback here, which the operator refuses as a
        # Secret's endpoint unless the platform lists it (policy.sourceEndpoints).
        self.source_endpoints = source_endpoints
        self.kubeconfig = kubeconfig
        self.tls_dir = tls_dir
        self.webhook_port = webhook_port
        self.health_port = free_port()
        self.sidecar_image = sidecar_image
        self.log_path = workdir / "operator.log"
        self._process: subprocess.Popen[bytes] | None = None

    def argv(self) -> list[str]:
        entry = pathlib.Path(sys.executable).parent / "shardcache"
        return [
            str(entry),
            "operator",
            f"--kubeconfig={self.kubeconfig}",
            f"--webhook-addr={HOST}",
            f"--webhook-port={self.webhook_port}",
            f"--cert-file={self.tls_dir / 'tls.crt'}",
            f"--key-file={self.tls_dir / 'tls.key'}",
            f"--ca-file={self.tls_dir / 'ca.crt'}",
            f"--health-addr={HOST}",
            f"--health-port={self.health_port}",
            f"--sidecar-image={self.sidecar_image}",
        ]

    def env(self) -> dict[str, str]:
        # The same settings the chart passes to its Deployment (values operator.settings).
        names = {
            "podsIntervalSeconds": "PODS_INTERVAL_SECONDS",
            "deletionPollSeconds": "DELETION_POLL_SECONDS",
            "backoffInitialSeconds": "BACKOFF_INITIAL_SECONDS",
            "backoffMaxSeconds": "BACKOFF_MAX_SECONDS",
            "resolveTimeoutSeconds": "RESOLVE_TIMEOUT_SECONDS",
            "stallCheckSeconds": "STALL_CHECK_SECONDS",
        }
        env = clean_env()
        for key, suffix in names.items():
            env[f"SHARDCACHE_OPERATOR_{suffix}"] = str(OPERATOR_SETTINGS[key])
        env["SHARDCACHE_OPERATOR_SOURCE_ENDPOINTS"] = ",".join(self.source_endpoints)
        env["SHARDCACHE_OPERATOR_MANIFEST_NAMESPACES"] = ",".join(self.manifest_namespaces)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def start(self) -> None:
        if self._process is not None and self._process.poll() is None:
            return
        with self.log_path.open("ab") as log:
            log.write(f"--- start {time.strftime('%H:%M:%S')}\n".encode())
            self._process = subprocess.Popen(
                self.argv(),
                env=self.env(),
                cwd=self.workdir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._wait_ready()

    def _get(self, path: str) -> tuple[int, str]:
        url = f"http://{HOST}:{self.health_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return int(response.status), response.read().decode()
        except urllib.error.HTTPError as err:
            return int(err.code), err.read().decode()

    def _wait_ready(self) -> None:
        def ready() -> bool:
            assert self._process is not None
            if self._process.poll() is not None:
                raise AssertionError(
                    f"the operator exited with {self._process.returncode} while starting; "
                    f"its log:\n{self.logs()}"
                )
            try:
                return self._get("/readyz")[0] == 200
            except OSError:
                return False

        wait_until(
            "the local operator's /readyz",
            ready,
            timeout=OPERATOR_READY_TIMEOUT_S,
            describe=self.logs,
        )

    def stop(self) -> None:
        process, self._process = self._process, None
        processes.stop(process, STOP_TIMEOUT_S)

    def restart(self) -> None:
        self.stop()
        self.start()

    def metrics(self) -> str:
        status, text = self._get("/metrics")
        assert status == 200, f"/metrics answered {status}: {text[:300]}"
        return text

    def logs(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no operator log)"
        all_lines = text.splitlines()
        # The first warnings and errors explain more than the traceback they end in.
        first = [line for line in all_lines if " WARNING " in line or " ERROR " in line][:15]
        return (
            "operator log, first warnings and errors:\n"
            + "\n".join(first)
            + "\noperator log (tail):\n"
            + "\n".join(all_lines[-lines:])
        )


class InClusterOperator:
    """kind: the chart's Deployment; metrics through `kubectl port-forward`."""

    def __init__(self, cluster: Cluster, deployment: str, namespace: str) -> None:
        self.cluster = cluster
        self.deployment = deployment
        self.namespace = namespace

    def wait_rolled_out(self) -> None:
        self.cluster.run(
            "kubectl",
            "-n",
            self.namespace,
            "rollout",
            "status",
            f"deployment/{self.deployment}",
            f"--timeout={int(OPERATOR_READY_TIMEOUT_S)}s",
        )

    def restart(self) -> None:
        self.cluster.run(
            "kubectl", "-n", self.namespace, "rollout", "restart", f"deployment/{self.deployment}"
        )
        self.wait_rolled_out()

    def _scale(self, replicas: int) -> None:
        self.cluster.run(
            "kubectl", "-n", self.namespace, "scale", f"deployment/{self.deployment}",
            f"--replicas={replicas}",
        )  # fmt: skip

    def stop(self) -> None:
        self._scale(0)
        self.cluster.run(
            "kubectl", "-n", self.namespace, "wait", "--for=delete", "pod",
            "--selector=app.kubernetes.io/component=operator",
            f"--timeout={int(OPERATOR_READY_TIMEOUT_S)}s",
        )  # fmt: skip

    def start(self) -> None:
        self._scale(1)
        self.wait_rolled_out()

    @contextlib.contextmanager
    def _forward(self) -> Iterator[int]:
        process = subprocess.Popen(
            [
                str(self.cluster.kubectl),
                f"--kubeconfig={self.cluster.kubeconfig}",
                "-n",
                self.namespace,
                "port-forward",
                f"deployment/{self.deployment}",
                ":8080",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            assert process.stdout is not None
            line = process.stdout.readline()
            match = re.search(r"127\.0\.0\.1:(\d+)", line)
            if not match:
                raise AssertionError(f"kubectl port-forward said: {line!r}")
            yield int(match.group(1))
        finally:
            process.terminate()
            process.wait(timeout=STOP_TIMEOUT_S)

    def metrics(self) -> str:
        with self._forward() as port:
            with urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=10) as resp:
                return str(resp.read().decode())

    def logs(self) -> str:
        result = self.cluster.run(
            "kubectl",
            "-n",
            self.namespace,
            "logs",
            f"deployment/{self.deployment}",
            "--tail=60",
            check=False,
        )
        return "operator log (tail):\n" + result.stdout + result.stderr


# -- kind ------------------------------------------------------------------------------------


def kind_cluster(workdir: pathlib.Path) -> Cluster:
    """The kind cluster `make e2e CLUSTER=kind` created (name in KIND_CLUSTER_NAME)."""
    kind = shutil.which("kind")
    helm = shutil.which("helm")
    kubectl = shutil.which("kubectl")
    if not (kind and helm and kubectl):
        raise RuntimeError(f"{PROVIDER_ENV}=kind needs kind, helm and kubectl on PATH")
    name = os.environ.get("KIND_CLUSTER_NAME", "shardcache-e2e")
    result = subprocess.run(
        [kind, "get", "kubeconfig", f"--name={name}"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    kubeconfig = workdir / "kind-kubeconfig"
    kubeconfig.write_text(result.stdout)
    config = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(  # type: ignore[no-untyped-call]
        config_file=str(kubeconfig), client_configuration=config
    )
    ca_file = pathlib.Path(config.ssl_ca_cert) if config.ssl_ca_cert else None
    return Cluster(
        "kind", kubeconfig, pathlib.Path(helm), pathlib.Path(kubectl), config.host, ca_file
    )
