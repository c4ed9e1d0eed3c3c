"""A real Kubernetes control plane on loopback, started the way controller-runtime's
envtest starts one, plus the controllers e2e tests need:

  etcd                      plain HTTP on 127.0.0.1 (nothing but the API server talks to it)
  kube-apiserver            TLS, client-certificate auth, Node,RBAC authorization,
                            service-account signing keys
  kube-controller-manager   every default controller (Job, ServiceAccount, token, namespace,
                            garbage collector, ...), one service-account identity each
  kube-scheduler            places pods on the fake nodes
  kwok                      fakes kubelets: its Nodes are Ready and pods bound to them Running
  the real node             containerd + kubelet + kube-proxy (node.py, network.py): pods
                            really run, on a bridge in 198.18.0.0/15 with no uplink;
                            SHARDCACHE_NODE=0 leaves it out

  python tests/cluster/cluster.py up     start (a second call finds it up and returns)
  python tests/cluster/cluster.py down   stop everything `up` started, clean the host
  python tests/cluster/cluster.py status
  python tests/cluster/cluster.py import-image ARCHIVE...   OCI archives into the node

Everything lives in .cluster/ at the repo root: kubeconfig (admin, a client certificate
in system:masters), bin/helm and bin/kubectl, pki/, logs/, state.json with the pids. The
binaries come from $TOOLS_CACHE (see mk/tools.mk). Run with the project's .venv python:
it needs `cryptography`.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import datetime
import fcntl
import ipaddress
import json
import os
import pathlib
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
if __package__ in (None, ""):
    # Run as a script (`python tests/cluster/cluster.py`): its siblings are tests.cluster.*.
    sys.path.insert(0, str(REPO_ROOT))

from shardcache_sidecar.listening import free_port  # noqa: E402

from tests.cluster import images, network, node  # noqa: E402

CLUSTER_DIR = REPO_ROOT / ".cluster"
VERSIONS_FILE = REPO_ROOT / "tests" / "cluster" / "versions.env"
HOST = "127.0.0.1"
# Inside 198.18.0.0/15 (network.py), like everything the node tier routes.
SERVICE_CIDR = network.SERVICE_CIDR
# The first address of SERVICE_CIDR: the `kubernetes` Service, which the serving cert names.
KUBERNETES_SERVICE_IP = network.KUBERNETES_SERVICE_IP
FAKE_NODES = ("kwok-node-0", "kwok-node-1")
# kwok's fake pod addresses: never routed anywhere, but kept out of the real node's range.
FAKE_POD_CIDR = "198.18.128.0/17"
# A cold start of the API server on two busy cores (bootstrap RBAC, CRD and APIService
# controllers) takes 10-40 s; beyond 180 s something is wrong, and the logs say what.
READY_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 20.0
# Components in start order; `down` stops them in reverse.
COMPONENTS = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kwok",
    "containerd",
    "kubelet",
    "kube-proxy",
)
NODE_COMPONENTS = ("containerd", "kubelet", "kube-proxy")
# The real node: containerd's socket answering, then the kubelet registering and its
# runtime and CNI reporting ready. ~10-20 s here; the bound covers a loaded machine.
NODE_READY_TIMEOUT_S = 180.0
# Deleting the node's pods on `down`: the kubelet stops them, tears their network down
# (CNI DEL) and unmounts their volumes, so what is left for clean_host is a crash's debris.
DRAIN_TIMEOUT_S = 60.0


def node_enabled() -> bool:
    """The real node is part of the cluster unless SHARDCACHE_NODE=0."""
    return os.environ.get("SHARDCACHE_NODE", "1") not in ("0", "false", "no", "off")


# -- binaries ------------------------------------------------------------------------


def parse_versions(text: str) -> dict[str, str]:
    versions: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            versions[key.strip()] = value.strip()
    return versions


@dataclasses.dataclass(frozen=True)
class Binaries:
    etcd: pathlib.Path
    kube_apiserver: pathlib.Path
    kube_controller_manager: pathlib.Path
    kube_scheduler: pathlib.Path
    kubectl: pathlib.Path
    helm: pathlib.Path
    kwok: pathlib.Path
    kubelet: pathlib.Path | None
    kube_proxy: pathlib.Path | None

    @property
    def kwok_stages(self) -> pathlib.Path:
        return self.kwok.parent / "stages"

    @classmethod
    def from_cache(cls, *, with_node: bool) -> Binaries:
        cache = pathlib.Path(
            os.environ.get("TOOLS_CACHE") or pathlib.Path.home() / ".cache" / "shardcache-tools"
        )
        v = parse_versions(VERSIONS_FILE.read_text())
        kube = cache / f"kubernetes-{v['KUBE_VERSION']}"
        binaries = cls(
            etcd=cache / f"etcd-{v['ETCD_VERSION']}" / "etcd",
            kube_apiserver=kube / "kube-apiserver",
            kube_controller_manager=kube / "kube-controller-manager",
            kube_scheduler=kube / "kube-scheduler",
            kubectl=kube / "kubectl",
            helm=cache / f"helm-{v['HELM_VERSION']}" / "helm",
            kwok=cache / f"kwok-{v['KWOK_VERSION']}" / "kwok",
            kubelet=cache / f"kubenode-{v['KUBE_VERSION']}" / "kubelet" if with_node else None,
            kube_proxy=cache / f"kubenode-{v['KUBE_VERSION']}" / "kube-proxy"
            if with_node
            else None,
        )
        missing = [
            str(p) for p in dataclasses.astuple(binaries) if p is not None and not p.is_file()
        ]
        if with_node:
            missing += [
                f"{tool} (Debian package; `make cluster-up` installs it)"
                for tool in ("containerd", "ctr", "runc", "iptables", "gcc")
                if shutil.which(tool) is None
            ]
            if not pathlib.Path("/usr/lib/cni/bridge").is_file():
                missing.append("/usr/lib/cni/bridge (Debian containernetworking-plugins)")
        if not list(binaries.kwok_stages.glob("*.yaml")):
            missing.append(str(binaries.kwok_stages / "*.yaml"))
        if missing:
            raise SystemExit(
                "cluster: these binaries are not built: "
                + ", ".join(missing)
                + "; run `make tools` (`make cluster-up` and `make test` do it), which builds "
                "them once into $TOOLS_CACHE"
            )
        return binaries


# -- certificates --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KeyPair:
    cert_pem: bytes
    key_pem: bytes


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attrs)


def _key_pem(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def make_ca() -> tuple[KeyPair, ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    name = _name("shardcache-test-ca")
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)), key, cert


def issue(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    common_name: str,
    *,
    organization: str | None = None,
    server_names: Sequence[str] = (),
    server_ips: Sequence[str] = (),
) -> KeyPair:
    """A leaf certificate: a server one when names or IPs are given, else a client one."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    server = bool(server_names or server_ips)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name, organization))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
    )
    if server:
        alt_names: list[x509.GeneralName] = [x509.DNSName(n) for n in server_names]
        alt_names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in server_ips]
        builder = builder.add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def write_private(path: pathlib.Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def kubeconfig(server: str, ca_pem: bytes, client: KeyPair, user: str) -> str:
    """A self-contained kubeconfig (certificates inline), in JSON, which is valid YAML."""

    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "shardcache-test",
                "cluster": {"server": server, "certificate-authority-data": b64(ca_pem)},
            }
        ],
        "users": [
            {
                "name": user,
                "user": {
                    "client-certificate-data": b64(client.cert_pem),
                    "client-key-data": b64(client.key_pem),
                },
            }
        ],
        "contexts": [
            {"name": "shardcache-test", "context": {"cluster": "shardcache-test", "user": user}}
        ],
        "current-context": "shardcache-test",
    }
    return json.dumps(doc, indent=2) + "\n"


# -- processes -----------------------------------------------------------------------


def pid_alive(pid: int, binary: str) -> bool:
    """True if `pid` runs `binary`: a recycled pid of some other program does not count."""
    try:
        cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False
    return cmdline.split(b"\0", 1)[0].decode(errors="replace") == binary


def spawn(
    name: str,
    argv: list[str],
    logs: pathlib.Path,
    *,
    env: dict[str, str] | None = None,
    pass_fds: Sequence[int] = (),
) -> int:
    logs.mkdir(parents=True, exist_ok=True)
    with (logs / f"{name}.log").open("ab") as log:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            # Its own session: `make` returning or a terminal closing does not signal it.
            start_new_session=True,
            cwd=CLUSTER_DIR,
            env=env,
            pass_fds=pass_fds,
        )
    # Popen can return while the child is still inside execve (its /proc entry shows the
    # python that forked it); wait until it is the binary, so pid_alive() means it.
    deadline = time.monotonic() + 10.0
    while not pid_alive(process.pid, argv[0]):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            process.wait()
            raise SystemExit(f"cluster: {name} did not start; its log:\n{log_tail(name)}")
        time.sleep(0.01)
    return process.pid


def log_tail(name: str, lines: int = 30) -> str:
    path = CLUSTER_DIR / "logs" / f"{name}.log"
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


# -- talking to the API server ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Api:
    server: str
    context: ssl.SSLContext

    @classmethod
    def admin(cls, server: str) -> Api:
        pki = CLUSTER_DIR / "pki"
        context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        context.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
        return cls(server, context)

    def request(self, method: str, path: str, body: object | None = None) -> tuple[int, bytes]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.server + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, context=self.context, timeout=10) as response:
                return int(response.status), response.read()
        except urllib.error.HTTPError as err:
            return int(err.code), err.read()


def wait_for(
    what: str,
    check: Callable[[], bool],
    timeout: float,
    pids: dict[str, int],
    binaries: dict[str, str],
) -> None:
    """Poll `check()` until true; fail early, with its log, if a component died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, pid in pids.items():
            if not pid_alive(pid, binaries[name]):
                raise SystemExit(
                    f"cluster: {name} exited while waiting for {what}; its log:\n{log_tail(name)}"
                )
        try:
            if check():
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
    raise SystemExit(
        f"cluster: {what} not reached within {timeout:.0f}s; kube-apiserver log:\n{log_tail('kube-apiserver')}"
    )


def etcd_healthy(url: str) -> bool:
    with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
        return bool(response.status == 200)


def fake_node(name: str) -> dict[str, object]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            # kwok manages nodes carrying this annotation (see its --manage-nodes-with-annotation-selector).
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
            },
        },
        "status": {
            "allocatable": {"cpu": "32", "memory": "256Gi", "pods": "110"},
            "capacity": {"cpu": "32", "memory": "256Gi", "pods": "110"},
        },
    }


# -- up / down -------------------------------------------------------------------------


def load_state() -> dict[str, object] | None:
    try:
        state = json.loads((CLUSTER_DIR / "state.json").read_text())
    except (FileNotFoundError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def running_components(state: dict[str, object]) -> dict[str, bool]:
    pids = state.get("pids", {})
    binaries = state.get("binaries", {})
    assert isinstance(pids, dict) and isinstance(binaries, dict)
    return {name: pid_alive(int(pid), str(binaries[name])) for name, pid in pids.items()}


def is_up(state: dict[str, object]) -> bool:
    alive = running_components(state)
    if not alive or not all(alive.values()):
        return False
    try:
        status, _ = Api.admin(str(state["server"])).request("GET", "/readyz")
    except (OSError, ssl.SSLError):
        return False
    return status == 200


def up() -> int:
    state = load_state()
    with_node = node_enabled()
    if state is not None:
        if is_up(state) and bool(state.get("node")) == with_node:
            print(
                f"cluster: already up at {state['server']} (kubeconfig {CLUSTER_DIR / 'kubeconfig'})"
            )
            return 0
        # Half-up (a component died, or the machine restarted), or up with the node when
        # asked without it (or the reverse): start over cleanly.
        down()

    binaries = Binaries.from_cache(with_node=with_node)
    node_paths = node.Paths.under(CLUSTER_DIR)
    lock_fd = -1
    if with_node:
        # A crash or a kill -9 of an earlier run leaves containers, mounts, netns, chains,
        # the bridge and changed sysctls behind: clear them before starting anew.
        if node.machine_lock_free() or _lock_holder() == str(REPO_ROOT):
            report = node.clean_host(node_paths)
            if any(report.values()):
                print(f"cluster: cleaned what an earlier run left: {report}")
        lock_fd = node.take_machine_lock(REPO_ROOT)
        shutil.rmtree(node_paths.root, ignore_errors=True)
        network.create_bridge()
    # The API server listens where pods reach it (the bridge) when there are pods.
    api_host = network.HOST_ADDRESS if with_node else HOST
    pki = CLUSTER_DIR / "pki"
    logs = CLUSTER_DIR / "logs"
    for sub in ("pki", "etcd", "kubeconfigs"):
        shutil.rmtree(CLUSTER_DIR / sub, ignore_errors=True)
    pki.mkdir(parents=True)
    (CLUSTER_DIR / "kubeconfigs").mkdir()

    ca, ca_key, ca_cert = make_ca()
    (pki / "ca.crt").write_bytes(ca.cert_pem)
    write_private(pki / "ca.key", ca.key_pem)
    serving = issue(
        ca_key,
        ca_cert,
        "kube-apiserver",
        server_names=(
            "localhost",
            "kubernetes",
            "kubernetes.default",
            "kubernetes.default.svc",
            "kubernetes.default.svc.cluster.local",
        ),
        server_ips=(HOST, network.HOST_ADDRESS, KUBERNETES_SERVICE_IP),
    )
    (pki / "apiserver.crt").write_bytes(serving.cert_pem)
    write_private(pki / "apiserver.key", serving.key_pem)
    admin = issue(ca_key, ca_cert, "shardcache-admin", organization="system:masters")
    (pki / "admin.crt").write_bytes(admin.cert_pem)
    write_private(pki / "admin.key", admin.key_pem)
    # What the API server shows the kubelet for exec, logs and port-forward.
    kubelet_client = issue(
        ca_key, ca_cert, "kube-apiserver-kubelet-client", organization="system:masters"
    )
    (pki / "apiserver-kubelet-client.crt").write_bytes(kubelet_client.cert_pem)
    write_private(pki / "apiserver-kubelet-client.key", kubelet_client.key_pem)
    # The identities the bootstrap RBAC policy grants the control-plane components.
    controller_manager = issue(ca_key, ca_cert, "system:kube-controller-manager")
    scheduler = issue(ca_key, ca_cert, "system:kube-scheduler")
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    write_private(pki / "sa.key", _key_pem(sa_key))
    (pki / "sa.pub").write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )

    ports = {
        name: free_port()
        for name in (
            "apiserver",
            "etcd",
            "etcd-peer",
            "kcm",
            "scheduler",
            "kwok",
            "kubelet",
            "kubelet-healthz",
            "proxy-healthz",
            "proxy-metrics",
        )
    }
    server = f"https://{api_host}:{ports['apiserver']}"
    (CLUSTER_DIR / "kubeconfig").write_text(
        kubeconfig(server, ca.cert_pem, admin, "shardcache-admin")
    )
    os.chmod(CLUSTER_DIR / "kubeconfig", 0o600)
    kcm_kubeconfig = CLUSTER_DIR / "kubeconfigs" / "controller-manager"
    kcm_kubeconfig.write_text(kubeconfig(server, ca.cert_pem, controller_manager, "kcm"))
    scheduler_kubeconfig = CLUSTER_DIR / "kubeconfigs" / "scheduler"
    scheduler_kubeconfig.write_text(kubeconfig(server, ca.cert_pem, scheduler, "scheduler"))

    bin_dir = CLUSTER_DIR / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in (binaries.helm, binaries.kubectl):
        link = bin_dir / tool.name
        link.unlink(missing_ok=True)
        link.symlink_to(tool)

    etcd_url = f"http://{HOST}:{ports['etcd']}"
    argv: dict[str, list[str]] = {
        "etcd": [
            str(binaries.etcd),
            "--name=shardcache-test",
            f"--data-dir={CLUSTER_DIR / 'etcd'}",
            f"--listen-client-urls={etcd_url}",
            f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls=http://{HOST}:{ports['etcd-peer']}",
            f"--initial-advertise-peer-urls=http://{HOST}:{ports['etcd-peer']}",
            f"--initial-cluster=shardcache-test=http://{HOST}:{ports['etcd-peer']}",
            # Test data: losing it on a crash is fine; fsync on every write is not free.
            "--unsafe-no-fsync",
            "--quota-backend-bytes=2147483648",
            "--log-level=warn",
        ],
        "kube-apiserver": [
            str(binaries.kube_apiserver),
            f"--etcd-servers={etcd_url}",
            # The `kubernetes` Service's endpoint: pods reach it through kube-proxy.
            f"--advertise-address={api_host}",
            f"--bind-address={api_host}",
            f"--secure-port={ports['apiserver']}",
            f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
            f"--kubelet-certificate-authority={pki / 'ca.crt'}",
            "--kubelet-preferred-address-types=InternalIP",
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction",
            f"--service-account-issuer={server}",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--allow-privileged=true",
            "--profiling=false",
            f"--cert-dir={pki}",
            "--v=1",
        ],
        "kube-controller-manager": [
            str(binaries.kube_controller_manager),
            f"--kubeconfig={kcm_kubeconfig}",
            f"--authentication-kubeconfig={kcm_kubeconfig}",
            f"--authorization-kubeconfig={kcm_kubeconfig}",
            f"--bind-address={HOST}",
            f"--secure-port={ports['kcm']}",
            "--controllers=*",
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={pki / 'sa.key'}",
            f"--root-ca-file={pki / 'ca.crt'}",
            f"--cluster-signing-cert-file={pki / 'ca.crt'}",
            f"--cluster-signing-key-file={pki / 'ca.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--leader-elect=false",
            "--profiling=false",
            "--v=1",
        ],
        "kube-scheduler": [
            str(binaries.kube_scheduler),
            f"--kubeconfig={scheduler_kubeconfig}",
            f"--authentication-kubeconfig={scheduler_kubeconfig}",
            f"--authorization-kubeconfig={scheduler_kubeconfig}",
            f"--bind-address={HOST}",
            f"--secure-port={ports['scheduler']}",
            "--leader-elect=false",
            "--profiling=false",
            "--v=1",
        ],
        "kwok": [
            str(binaries.kwok),
            f"--kubeconfig={CLUSTER_DIR / 'kubeconfig'}",
            "--manage-all-nodes=false",
            "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
            f"--server-address={HOST}:{ports['kwok']}",
            "--node-lease-duration-seconds=40",
            f"--cidr={FAKE_POD_CIDR}",
            f"--node-ip={HOST}",
            # The release's "fast" stages, kept beside the binary by build.sh.
            *(f"--config={stage}" for stage in sorted(binaries.kwok_stages.glob("*.yaml"))),
        ],
    }
    node_image_names: dict[str, str] = {}
    if with_node:
        assert binaries.kubelet is not None and binaries.kube_proxy is not None
        node_image_names = _prepare_node(
            node_paths, binaries, ports, server=server, ca=ca, ca_key=ca_key, ca_cert=ca_cert
        )
        containerd = shutil.which("containerd")
        assert containerd is not None
        argv["containerd"] = [containerd, "--config", str(node_paths.containerd_config)]
        argv["kubelet"] = node.kubelet_argv(
            binaries.kubelet, node_paths, kubeconfig=CLUSTER_DIR / "kubeconfigs" / "kubelet"
        )
        argv["kube-proxy"] = node.proxy_argv(binaries.kube_proxy, node_paths)
    binary_of = {name: args[0] for name, args in argv.items()}
    pids: dict[str, int] = {}

    def save() -> None:
        state = {
            "server": server,
            "ports": ports,
            "pids": pids,
            "binaries": binary_of,
            "node": (
                {
                    "name": node.NODE_NAME,
                    "containerd_socket": str(node_paths.containerd_socket),
                    "images": node_image_names,
                    "label": node.REAL_NODE_LABEL,
                    "host_address": network.HOST_ADDRESS,
                    "pod_cidr": network.POD_CIDR,
                    "service_cidr": SERVICE_CIDR,
                    "kubernetes_service_ip": KUBERNETES_SERVICE_IP,
                }
                if with_node
                else None
            ),
        }
        (CLUSTER_DIR / "state.json").write_text(json.dumps(state, indent=2) + "\n")

    started = time.monotonic()
    try:
        pids["etcd"] = spawn("etcd", argv["etcd"], logs)
        save()
        wait_for(
            "etcd health",
            lambda: etcd_healthy(etcd_url),
            60.0,
            pids,
            binary_of,
        )
        pids["kube-apiserver"] = spawn("kube-apiserver", argv["kube-apiserver"], logs)
        save()
        api = Api.admin(server)
        wait_for(
            "kube-apiserver /readyz",
            lambda: api.request("GET", "/readyz")[0] == 200,
            READY_TIMEOUT_S,
            pids,
            binary_of,
        )
        for name in ("kube-controller-manager", "kube-scheduler", "kwok"):
            pids[name] = spawn(name, argv[name], logs)
            save()
        for fake in FAKE_NODES:
            status, body = api.request("POST", "/api/v1/nodes", fake_node(fake))
            if status not in (201, 409):
                raise SystemExit(
                    f"cluster: creating fake node {fake} answered {status}: {body[:500]!r}"
                )
        if with_node:
            # containerd carries the machine lock: it holds it while it (or a shim) runs.
            pids["containerd"] = spawn(
                "containerd",
                argv["containerd"],
                logs,
                env=node.containerd_env(),
                pass_fds=(lock_fd,),
            )
            os.close(lock_fd)
            lock_fd = -1
            save()
            wait_for(
                "containerd's socket",
                lambda: _ctr_answers(node_paths),
                60.0,
                pids,
                binary_of,
            )
            for archive in node_image_names.values():
                images.import_image(pathlib.Path(archive), address=node_paths.containerd_socket)
            for name in ("kubelet", "kube-proxy"):
                pids[name] = spawn(name, argv[name], logs)
                save()

        def default_service_account() -> bool:
            return (
                api.request("GET", "/api/v1/namespaces/default/serviceaccounts/default")[0] == 200
            )

        # The ServiceAccount controller made it: the controller manager works.
        wait_for(
            "the default ServiceAccount", default_service_account, READY_TIMEOUT_S, pids, binary_of
        )

        def nodes_ready() -> bool:
            for name in FAKE_NODES + ((node.NODE_NAME,) if with_node else ()):
                if not _node_ready(api, name):
                    return False
            return True

        wait_for(
            "Ready nodes (kwok's, and the real one)",
            nodes_ready,
            NODE_READY_TIMEOUT_S,
            pids,
            binary_of,
        )
    except BaseException:
        if lock_fd >= 0:
            os.close(lock_fd)
        down()
        raise
    print(
        f"cluster: up at {server} in {time.monotonic() - started:.1f}s"
        + (f" with the real node {node.NODE_NAME}" if with_node else "")
        + f"; kubeconfig {CLUSTER_DIR / 'kubeconfig'}, helm {bin_dir / 'helm'}, "
        f"kubectl {bin_dir / 'kubectl'}"
    )
    return 0


def _lock_holder() -> str:
    try:
        return (node.MACHINE_DIR / "lock").read_text().strip()
    except FileNotFoundError:
        return ""


def _ctr_answers(paths: node.Paths) -> bool:
    return (
        subprocess.run(
            ["ctr", "--address", str(paths.containerd_socket), "version"],
            capture_output=True,
            check=False,
            timeout=10,
        ).returncode
        == 0
    )


def _node_ready(api: Api, name: str) -> bool:
    status, body = api.request("GET", f"/api/v1/nodes/{name}")
    conditions = json.loads(body).get("status", {}).get("conditions", []) if status == 200 else []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _prepare_node(
    paths: node.Paths,
    binaries: Binaries,
    ports: dict[str, int],
    *,
    server: str,
    ca: KeyPair,
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
) -> dict[str, str]:
    """Certificates, configuration files and images of the real node; returns the images
    to import ({name: archive})."""
    pki = CLUSTER_DIR / "pki"
    kubeconfigs = CLUSTER_DIR / "kubeconfigs"
    # The Node authorizer and NodeRestriction know a kubelet by exactly this identity.
    kubelet_identity = issue(
        ca_key, ca_cert, f"system:node:{node.NODE_NAME}", organization="system:nodes"
    )
    (kubeconfigs / "kubelet").write_text(
        kubeconfig(server, ca.cert_pem, kubelet_identity, "kubelet")
    )
    kubelet_serving = issue(
        ca_key,
        ca_cert,
        f"system:node:{node.NODE_NAME}",
        server_names=(node.NODE_NAME,),
        server_ips=(network.HOST_ADDRESS,),
    )
    (pki / "kubelet.crt").write_bytes(kubelet_serving.cert_pem)
    write_private(pki / "kubelet.key", kubelet_serving.key_pem)
    # Bound to system:node-proxier by the bootstrap RBAC policy.
    proxy_identity = issue(ca_key, ca_cert, "system:kube-proxy")
    (kubeconfigs / "kube-proxy").write_text(
        kubeconfig(server, ca.cert_pem, proxy_identity, "kube-proxy")
    )
    kube_version = parse_versions(VERSIONS_FILE.read_text())["KUBE_VERSION"]
    pause = images.pause_image(kube_version)
    toolbox = images.toolbox_image()
    node.write_files(
        paths,
        sandbox_image=pause.name,
        kubelet=node.kubelet_config(
            paths,
            port=ports["kubelet"],
            healthz_port=ports["kubelet-healthz"],
            ca_file=pki / "ca.crt",
            cert_file=pki / "kubelet.crt",
            key_file=pki / "kubelet.key",
        ),
        proxy=node.proxy_config(
            kubeconfig=kubeconfigs / "kube-proxy",
            healthz_port=ports["proxy-healthz"],
            metrics_port=ports["proxy-metrics"],
        ),
    )
    node.share_kubelet_root(paths)
    node.save_sysctls()
    return {pause.name: str(pause.archive), toolbox.name: str(toolbox.archive)}


def _stop(name: str, pid: int, binary: str) -> None:
    if not pid_alive(pid, binary):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while pid_alive(pid, binary) and time.monotonic() < deadline:
        _reap(pid)
        time.sleep(0.1)
    if pid_alive(pid, binary):
        os.kill(pid, signal.SIGKILL)
        while pid_alive(pid, binary) and time.monotonic() < deadline + STOP_TIMEOUT_S:
            _reap(pid)
            time.sleep(0.1)


def _drain_real_node(state: dict[str, object]) -> None:
    """Delete the pods bound to the real node and wait (bounded) for the kubelet to stop
    them: it runs CNI DEL and unmounts their volumes, the clean way out."""
    try:
        api = Api.admin(str(state["server"]))
        selector = f"spec.nodeName={node.NODE_NAME}"
        status, body = api.request("GET", f"/api/v1/pods?fieldSelector={selector}")
        if status != 200:
            return
        for pod in json.loads(body).get("items", []):
            meta = pod["metadata"]
            api.request(
                "DELETE",
                f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 1},
            )
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while time.monotonic() < deadline:
            status, body = api.request("GET", f"/api/v1/pods?fieldSelector={selector}")
            if status != 200 or not json.loads(body).get("items"):
                return
            time.sleep(0.5)
        print(f"cluster: pods on {node.NODE_NAME} still there after {DRAIN_TIMEOUT_S:.0f}s")
    except (OSError, ssl.SSLError, ValueError) as exc:
        print(f"cluster: could not drain {node.NODE_NAME}: {exc}")


def down() -> int:
    state = load_state()
    if state is None:
        if node_enabled() and node.machine_lock_free():
            # No state, but maybe debris of a run whose state file went with a crash.
            node_paths = node.Paths.under(CLUSTER_DIR)
            report = node.clean_host(node_paths)
            if any(report.values()):
                print(f"cluster: cleaned what an earlier run left: {report}")
        print("cluster: not up")
        return 0
    pids = state.get("pids", {})
    binaries = state.get("binaries", {})
    assert isinstance(pids, dict) and isinstance(binaries, dict)
    with_node = bool(state.get("node"))
    alive = running_components(state)
    if with_node and alive.get("kubelet") and alive.get("kube-apiserver"):
        _drain_real_node(state)
    node_paths = node.Paths.under(CLUSTER_DIR)
    for name in reversed(COMPONENTS):
        if name not in pids:
            continue
        if name == "containerd":
            # Whatever the drain did not stop goes now, while containerd can still do it.
            node.remove_containers(node_paths)
        _stop(name, int(pids[name]), str(binaries[name]))
    still = [name for name, alive in running_components(state).items() if alive]
    if still:
        raise SystemExit(f"cluster: could not stop {', '.join(still)}")
    if with_node:
        report = node.clean_host(node_paths)
        left = {k: v for k, v in node.leftovers(node_paths).items() if v}
        if left:
            raise SystemExit(f"cluster: the real node left {left} (cleanup found {report})")
        shutil.rmtree(node_paths.root, ignore_errors=True)
    (CLUSTER_DIR / "state.json").unlink(missing_ok=True)
    for sub in ("etcd", "pki", "kubeconfigs"):
        shutil.rmtree(CLUSTER_DIR / sub, ignore_errors=True)
    (CLUSTER_DIR / "kubeconfig").unlink(missing_ok=True)
    print("cluster: down")
    return 0


def _reap(pid: int) -> None:
    # A component started by this very process (up() failing half-way) is our child:
    # reap it, or it lingers as a zombie that /proc still lists.
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def status() -> int:
    state = load_state()
    if state is None:
        print("cluster: not up")
        return 1
    print(
        json.dumps(
            {
                "server": state["server"],
                "running": running_components(state),
                "node": state.get("node"),
            },
            indent=2,
        )
    )
    return 0 if is_up(state) else 1


def import_images(archives: Sequence[str]) -> int:
    """Import OCI archives into the real node's containerd (`k8s.io` namespace)."""
    state = load_state()
    if state is None or not state.get("node") or not is_up(state):
        raise SystemExit(
            "import-image: the cluster with its real node is not up; run `make cluster-up`"
        )
    socket_path = pathlib.Path(node.Paths.under(CLUSTER_DIR).containerd_socket)
    for archive in archives:
        names = images.import_image(pathlib.Path(archive), address=socket_path)
        print(f"import-image: {archive}: {', '.join(names)}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", choices=("up", "down", "status", "import-image"))
    parser.add_argument("archives", nargs="*", help="import-image: OCI archives (tar)")
    args = parser.parse_args(argv)
    if args.command != "import-image" and args.archives:
        parser.error(f"{args.command} takes no arguments")
    if args.command == "import-image" and not args.archives:
        parser.error("import-image needs at least one OCI archive")
    CLUSTER_DIR.mkdir(exist_ok=True)
    # One command at a time per checkout: a test session's fixture and a `make cluster-up`
    # in another shell would otherwise both start a control plane on one data dir.
    with (CLUSTER_DIR / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if args.command == "import-image":
            return import_images(args.archives)
        return {"up": up, "down": down, "status": status}[args.command]()


if __name__ == "__main__":
    sys.exit(main())
