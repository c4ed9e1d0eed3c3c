"""The real node: containerd (Debian's, with runc), a kubelet and kube-proxy built from the
pinned k8s.io/kubernetes module, and the cleanup that leaves the machine as it was.

This module builds configurations and argv (pure) and undoes the node's effects on the
host; tests/cluster/cluster.py starts and stops the processes. The traps this machine
sets, and how each is met here:

* cgroup v1 with no systemd: cgroupfs on both sides; kubelet 1.34 accepts v1
  (`failCgroupV1: false`, explicit for when the module is bumped).
* The VM's bounding set lacks CAP_SYS_RESOURCE, so runc fails every sandbox unless the CRI
  plugin's `restrict_oom_score_adj` keeps oom_score_adj where it may go.
* containerd runs as a plain process with its own root, state and socket in the cluster
  directory (never /run/containerd), the CNI plugins from /usr/lib/cni.
* Nothing is pulled: images are imported (images.py), the sandbox image included, and
  containerd's proxy points at a closed loopback port, so an image some pod names but
  nobody imported fails at once instead of reaching for the network.
* The kubelet sets host sysctls (setupKernelTunables): they are saved in /run (a reboot
  resets both) before it starts and restored after it stops.

One real node per machine: the kubelet's cgroups, the KUBE-* chains and the bridge are
host-wide. A lock in /run, held by containerd for as long as it runs, says so; a checkout
that finds it taken is told which one holds it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import pathlib
import signal
import subprocess
import time

from tests.cluster import network

NODE_NAME = "shardcache-node"
#: Pods for the real node select it with this label and tolerate the taint of the same
#: key; everything else (kwok's fake nodes' pods, the e2e tier) never lands there.
REAL_NODE_LABEL = "shardcache.io/real-node"
REAL_NODE_TAINT = {"key": REAL_NODE_LABEL, "value": "true", "effect": "NoSchedule"}
#: Host-wide state of the one real node: its lock and the sysctls saved before the kubelet.
MACHINE_DIR = pathlib.Path("/run/shardcache-node")
#: What the kubelet changes on the host (pkg/kubelet/cm setupKernelTunables), plus what
#: kube-proxy could (route_localnet is off by localhostNodePorts: false; kept as a check).
SYSCTLS = (
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
    "net/ipv4/conf/all/route_localnet",
)
CGROUP_ROOT = pathlib.Path("/sys/fs/cgroup")
#: The kubelet's cgroup tree (cgroupfs driver, cgroupRoot "/").
KUBEPODS = "kubepods"
#: A loopback port nothing serves: an image pull through it fails at once, locally.
NO_PULL_PROXY = "http://127.0.0.1:1"


@dataclasses.dataclass(frozen=True)
class Paths:
    """Where the node keeps its files: all inside the cluster directory."""

    root: pathlib.Path

    @classmethod
    def under(cls, cluster_dir: pathlib.Path) -> Paths:
        return cls(cluster_dir / "node")

    @property
    def containerd_root(self) -> pathlib.Path:
        return self.root / "containerd" / "root"

    @property
    def containerd_state(self) -> pathlib.Path:
        return self.root / "containerd" / "state"

    @property
    def containerd_socket(self) -> pathlib.Path:
        return self.root / "containerd" / "containerd.sock"

    @property
    def containerd_config(self) -> pathlib.Path:
        return self.root / "containerd" / "config.toml"

    @property
    def cni_conf_dir(self) -> pathlib.Path:
        return self.root / "cni" / "net.d"

    @property
    def cni_ipam_dir(self) -> pathlib.Path:
        return self.root / "cni" / "ipam"

    @property
    def kubelet_root(self) -> pathlib.Path:
        return self.root / "kubelet"

    @property
    def pod_logs(self) -> pathlib.Path:
        return self.root / "pod-logs"

    @property
    def kubelet_config(self) -> pathlib.Path:
        return self.root / "kubelet.json"

    @property
    def proxy_config(self) -> pathlib.Path:
        return self.root / "kube-proxy.json"

    @property
    def resolv_conf(self) -> pathlib.Path:
        return self.root / "resolv.conf"


# -- configuration (pure) ----------------------------------------------------------------


def containerd_config(paths: Paths, *, sandbox_image: str) -> str:
    """containerd 1.6's config (version 2) for the CRI plugin the kubelet talks to."""
    cri = '[plugins."io.containerd.grpc.v1.cri"]'
    return f"""\
version = 2
root = "{paths.containerd_root}"
state = "{paths.containerd_state}"
# Snapshotters this machine cannot use only add start-up noise.
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs"]

[grpc]
  address = "{paths.containerd_socket}"

[ttrpc]
  address = "{paths.containerd_socket}.ttrpc"

[debug]
  level = "info"

[metrics]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = "{paths.root / "containerd" / "opt"}"

{cri}
  sandbox_image = "{sandbox_image}"
  # runc may not lower oom_score_adj here (no CAP_SYS_RESOURCE in the bounding set).
  restrict_oom_score_adj = true
  enable_selinux = false
  # Pod network namespaces under the state dir, not the host-wide /var/run/netns.
  netns_mounts_under_state_dir = true
  disable_apparmor = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"

{cri[:-1]}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"

{cri[:-1]}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

{cri[:-1]}.containerd.runtimes.runc.options]
  SystemdCgroup = false

{cri[:-1]}.cni]
  bin_dir = "/usr/lib/cni"
  conf_dir = "{paths.cni_conf_dir}"
  max_conf_num = 1
"""


def containerd_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env.update(HTTP_PROXY=NO_PULL_PROXY, HTTPS_PROXY=NO_PULL_PROXY, NO_PROXY="")
    return env


def kubelet_config(
    paths: Paths,
    *,
    port: int,
    healthz_port: int,
    ca_file: pathlib.Path,
    cert_file: pathlib.Path,
    key_file: pathlib.Path,
) -> dict[str, object]:
    """The kubelet's static configuration file (KubeletConfiguration v1beta1)."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": network.HOST_ADDRESS,
        "port": port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz_port,
        "tlsCertFile": str(cert_file),
        "tlsPrivateKeyFile": str(key_file),
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(ca_file)},
        },
        "authorization": {"mode": "Webhook"},
        "containerRuntimeEndpoint": f"unix://{paths.containerd_socket}",
        "cgroupDriver": "cgroupfs",
        "cgroupsPerQOS": True,
        "failCgroupV1": False,
        "failSwapOn": False,
        "podLogsDir": str(paths.pod_logs),
        # No DNS here: pods get an empty resolv.conf, not the host's resolvers.
        "resolvConf": str(paths.resolv_conf),
        "registerNode": True,
        "registerWithTaints": [REAL_NODE_TAINT],
        "makeIPTablesUtilChains": False,
        "rotateCertificates": False,
        "serverTLSBootstrap": False,
        # A shared, busy test machine: node-level eviction for memory or disk pressure
        # would kill the tests' pods for other people's usage, so every signal is off
        # ("0%" disables one). What a test checks per pod still holds: memory limits are
        # the cgroup's, a Memory emptyDir's sizeLimit is its tmpfs size.
        "evictionHard": {
            signal: "0%"
            for signal in (
                "memory.available",
                "nodefs.available",
                "nodefs.inodesFree",
                "imagefs.available",
                "imagefs.inodesFree",
            )
        },
        "mergeDefaultEvictionSettings": False,
        # Imported images cannot be pulled back: never garbage-collect them.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "maxPods": 32,
        "nodeStatusReportFrequency": "10s",
        "syncFrequency": "10s",
        "fileCheckFrequency": "10s",
        "shutdownGracePeriod": "0s",
    }


def kubelet_argv(binary: pathlib.Path, paths: Paths, *, kubeconfig: pathlib.Path) -> list[str]:
    return [
        str(binary),
        f"--config={paths.kubelet_config}",
        f"--kubeconfig={kubeconfig}",
        f"--root-dir={paths.kubelet_root}",
        f"--cert-dir={paths.root / 'kubelet-pki'}",
        # The kubelet refuses a loopback node IP: the bridge's host address it is.
        f"--node-ip={network.HOST_ADDRESS}",
        f"--hostname-override={NODE_NAME}",
        f"--node-labels={REAL_NODE_LABEL}=true",
        "--v=1",
    ]


def proxy_config(
    *, kubeconfig: pathlib.Path, healthz_port: int, metrics_port: int
) -> dict[str, object]:
    """kube-proxy's configuration (KubeProxyConfiguration v1alpha1), iptables mode."""
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "mode": "iptables",
        "hostnameOverride": NODE_NAME,
        "bindAddress": network.HOST_ADDRESS,
        "healthzBindAddress": f"127.0.0.1:{healthz_port}",
        "metricsBindAddress": f"127.0.0.1:{metrics_port}",
        "clusterCIDR": network.POD_CIDR,
        "detectLocalMode": "ClusterCIDR",
        # NodePorts on the bridge only; never on loopback (that would set route_localnet).
        "nodePortAddresses": [f"{network.HOST_ADDRESS}/32"],
        "iptables": {"localhostNodePorts": False, "masqueradeAll": False},
        # Zeros leave the host's conntrack sysctls alone.
        "conntrack": {
            "maxPerCore": 0,
            "min": 0,
            "tcpEstablishedTimeout": "0s",
            "tcpCloseWaitTimeout": "0s",
            "udpTimeout": "0s",
            "udpStreamTimeout": "0s",
        },
        "oomScoreAdj": 0,
    }


def proxy_argv(binary: pathlib.Path, paths: Paths) -> list[str]:
    return [str(binary), f"--config={paths.proxy_config}", "--v=1"]


def write_files(
    paths: Paths, *, sandbox_image: str, kubelet: dict[str, object], proxy: dict[str, object]
) -> None:
    for d in (
        paths.root,
        paths.containerd_root,
        paths.containerd_state,
        paths.kubelet_root,
        paths.pod_logs,
    ):
        d.mkdir(parents=True, exist_ok=True)
    paths.containerd_config.write_text(containerd_config(paths, sandbox_image=sandbox_image))
    network.write_cni_config(paths.cni_conf_dir, paths.cni_ipam_dir)
    paths.kubelet_config.write_text(json.dumps(kubelet, indent=2) + "\n")
    paths.proxy_config.write_text(json.dumps(proxy, indent=2) + "\n")
    paths.resolv_conf.write_text("")


# -- the machine lock and host sysctls -----------------------------------------------------


def take_machine_lock(owner: pathlib.Path) -> int:
    """An fd holding the machine's node lock (pass it to containerd so it holds it)."""
    MACHINE_DIR.mkdir(parents=True, exist_ok=True)
    fd = os.open(MACHINE_DIR / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another checkout"
        os.close(fd)
        raise SystemExit(
            f"cluster: the real node of this machine is in use by {holder}; run `make "
            "cluster-down` there (one real node per machine: cgroups, iptables chains and "
            "the bridge are host-wide), or set SHARDCACHE_NODE=0 for a control plane only"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(owner).encode(), 0)
    return fd


def machine_lock_free() -> bool:
    try:
        fd = os.open(MACHINE_DIR / "lock", os.O_RDWR)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def read_sysctls() -> dict[str, str]:
    values = {}
    for name in SYSCTLS:
        with contextlib.suppress(OSError):
            values[name] = (pathlib.Path("/proc/sys") / name).read_text().strip()
    return values


def save_sysctls() -> None:
    """Record the host's values before the kubelet runs; a saved record is kept (it holds
    the values from before a crashed run, which the kubelet had already changed)."""
    saved = MACHINE_DIR / "sysctls.json"
    if not saved.exists():
        MACHINE_DIR.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps(read_sysctls(), indent=2) + "\n")


def restore_sysctls() -> dict[str, tuple[str, str]]:
    """Write back the saved values; returns {name: (was, restored)} for those that differed."""
    saved = MACHINE_DIR / "sysctls.json"
    try:
        values = json.loads(saved.read_text())
    except FileNotFoundError:
        return {}
    changed = {}
    current = read_sysctls()
    for name, value in values.items():
        if current.get(name) != value:
            (pathlib.Path("/proc/sys") / name).write_text(value)
            changed[name] = (current.get(name, ""), value)
    saved.unlink()
    return changed


# -- stopping what runs and removing what is left ----------------------------------------


def _ctr(paths: Paths, *args: str) -> subprocess.CompletedProcess[str]:
    argv = ["ctr", "--address", str(paths.containerd_socket), "--namespace", "k8s.io", *args]
    try:
        return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=60)
    except subprocess.TimeoutExpired:
        # A hung containerd: the caller goes on to kill shims and cgroups directly.
        return subprocess.CompletedProcess(argv, 124, "", "ctr timed out")


def remove_containers(paths: Paths) -> None:
    """Kill and delete every task and container of the node's containerd (if it runs).

    A clean `down` has the kubelet delete its pods first (CNI DEL, unmounts); this is
    for what a crash left, and for sandboxes whose pods are already gone.
    """
    if not paths.containerd_socket.exists():
        return
    listing = _ctr(paths, "tasks", "ls", "-q")
    if listing.returncode != 0:
        return
    for task in listing.stdout.split():
        _ctr(paths, "tasks", "kill", "--signal", "SIGKILL", task)
    deadline = time.monotonic() + 20
    for task in listing.stdout.split():
        while _ctr(paths, "tasks", "delete", task).returncode != 0:
            if time.monotonic() > deadline:
                _ctr(paths, "tasks", "delete", "--force", task)
                break
            time.sleep(0.2)
    for container in _ctr(paths, "containers", "ls", "-q").stdout.split():
        _ctr(paths, "containers", "delete", container)


def _proc_cmdline(pid: int) -> list[str]:
    try:
        raw = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return raw.decode(errors="replace").split("\0")


def kill_shims(paths: Paths) -> list[int]:
    """SIGKILL the containerd shims serving this node's socket (they outlive containerd)."""
    killed = []
    address = str(paths.containerd_socket)
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        argv = _proc_cmdline(int(entry.name))
        if argv and argv[0].endswith("containerd-shim-runc-v2") and address in argv:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
    return killed


def kubepods_cgroups() -> list[pathlib.Path]:
    """Every cgroup directory of the kubelet's tree, deepest first."""
    found: list[pathlib.Path] = []
    for controller in CGROUP_ROOT.iterdir():
        top = controller / KUBEPODS
        if top.is_dir() and not top.is_symlink():
            found += [top, *(p for p in top.rglob("*") if p.is_dir())]
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def remove_cgroups() -> list[pathlib.Path]:
    """Kill what still runs in the kubelet's cgroups, then remove them; returns leftovers."""
    for cgroup in kubepods_cgroups():
        with contextlib.suppress(OSError):
            for pid in (cgroup / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
    left = []
    deadline = time.monotonic() + 10
    for cgroup in kubepods_cgroups():
        while True:
            try:
                cgroup.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                # Busy until the killed processes are gone.
                if time.monotonic() > deadline:
                    left.append(cgroup)
                    break
                time.sleep(0.1)
    return left


def mounts_under(root: pathlib.Path) -> list[str]:
    """Mount points at or below `root` (and the netns files CNI mounted), deepest first."""
    prefix = str(root.resolve())
    points = []
    for line in pathlib.Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point == prefix or point.startswith(prefix + "/"):
            points.append(point)
    return sorted(set(points), key=lambda p: p.count("/"), reverse=True)


def share_kubelet_root(paths: Paths) -> None:
    """Make the kubelet's root directory a shared mount of its own before the kubelet
    starts.

    Why: on a host whose root mount is private (this machine's), the kubelet's start
    bind-mounts its root onto itself and makes it rshared (`setupDataDirs`,
    `MakeRShared`) while another of its goroutines creates the pod-resources socket: a
    temporary file renamed onto `kubelet.sock`. A rename whose two paths were looked up
    on either side of that mount fails with EXDEV ("invalid cross-device link") and the
    kubelet exits; seen once, on an `up` after the node was killed. Already shared, the
    kubelet mounts nothing.
    """
    point = str(paths.kubelet_root.resolve())
    if point not in mounts_under(paths.kubelet_root):
        subprocess.run(["mount", "--bind", point, point], check=True, capture_output=True)
    subprocess.run(["mount", "--make-rshared", point], check=True, capture_output=True)


def unmount_under(root: pathlib.Path) -> list[str]:
    # Mounts stacked on one point (a bind of the kubelet's root and one the kubelet made)
    # go one per umount: passes until none is left or a pass removes nothing.
    left: list[str] = []
    while True:
        points = mounts_under(root)
        if not points or points == left:
            return points
        left = []
        for point in points:
            # Still busy (a process being killed): detach it now, it goes when released.
            if (
                subprocess.run(["umount", point], capture_output=True, check=False).returncode
                and subprocess.run(
                    ["umount", "-l", point], capture_output=True, check=False
                ).returncode
            ):
                left.append(point)


def clean_host(paths: Paths) -> dict[str, object]:
    """Remove everything the node left on the host; returns what was found, for the log.

    Order: containers (so nothing holds mounts or cgroups), shims, cgroups, mounts, network
    namespaces, iptables chains, the bridge, then the sysctls.
    """
    report: dict[str, object] = {}
    remove_containers(paths)
    report["shims killed"] = kill_shims(paths)
    report["cgroups left"] = [str(p) for p in remove_cgroups()]
    netns = network.netns_of_ours()
    network.remove_netns(netns)
    report["netns removed"] = netns
    report["mounts left"] = unmount_under(paths.root)
    report["chains removed"] = network.remove_chains()
    network.delete_bridge()
    report["sysctls restored"] = restore_sysctls()
    return report


def leftovers(paths: Paths) -> dict[str, object]:
    """What of the node is still on the host (empty values: nothing)."""
    return {
        "bridge": network.bridge_exists(),
        "chains": network.leftover_chains(),
        "netns": network.netns_of_ours(),
        "mounts": mounts_under(paths.root),
        "cgroups": [str(p) for p in kubepods_cgroups()],
        "shims": [
            int(e.name)
            for e in pathlib.Path("/proc").iterdir()
            if e.name.isdigit() and str(paths.containerd_socket) in _proc_cmdline(int(e.name))
        ],
        "sysctls saved": (MACHINE_DIR / "sysctls.json").exists(),
    }
