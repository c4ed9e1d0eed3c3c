"""The real node's network: one bridge with no uplink, and the cleanup of what the
kubelet, kube-proxy and the CNI plugins leave in the host's network stack.

Everything lives in 198.18.0.0/15 (RFC 2544, reserved for network tests, not a private
range), on a bridge that is connected to nothing else: no uplink, no masquerade, no route
out, and `net.ipv4.ip_forward` is left as it is (the CNI bridge plugin runs with
`isGateway: false`, so it never turns forwarding on). Pods reach the host (the API
server advertises the bridge address) and each other; nothing leaves the machine.

  bridge        shardcache0, host address 198.18.0.1/24
  pods          198.18.0.0/24 from .16 (host-local IPAM, its state in the cluster dir)
  services      198.19.0.0/24 (kube-proxy, iptables mode); `kubernetes` is 198.19.0.1
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import pathlib
import re
import subprocess

BRIDGE = "shardcache0"
HOST_ADDRESS = "198.18.0.1"
POD_CIDR = "198.18.0.0/24"
POD_RANGE_START = "198.18.0.16"
SERVICE_CIDR = "198.19.0.0/24"
#: The first address of SERVICE_CIDR: the `kubernetes` Service.
KUBERNETES_SERVICE_IP = "198.19.0.1"
CNI_NETWORK = "shardcache"
#: Chains of ours in every table: kube-proxy and the kubelet (KUBE-*), portmap (CNI-*).
CHAIN_PREFIXES = ("KUBE-", "CNI-")
IPTABLES = ("iptables", "ip6tables")
TABLES = ("filter", "nat", "mangle", "raw")


def _run(argv: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=check)


def bridge_exists() -> bool:
    return pathlib.Path(f"/sys/class/net/{BRIDGE}").exists()


def create_bridge() -> None:
    """The bridge with the host address, up, and a route for the service range on it.

    The route keeps host-to-Service traffic (the tests, kube-proxy's own checks) on the
    bridge, where kube-proxy's DNAT sends it to a pod or the API server, instead of
    following the machine's default route.
    """
    if not bridge_exists():
        _run(["ip", "link", "add", BRIDGE, "type", "bridge"])
    _run(["ip", "addr", "replace", f"{HOST_ADDRESS}/24", "dev", BRIDGE])
    _run(["ip", "link", "set", BRIDGE, "up"])
    _run(["ip", "route", "replace", SERVICE_CIDR, "dev", BRIDGE, "src", HOST_ADDRESS])


def delete_bridge() -> None:
    # Its addresses and routes go with it; veths of dead pods are gone with their netns.
    if bridge_exists():
        _run(["ip", "link", "delete", BRIDGE])


def cni_config(ipam_dir: pathlib.Path) -> dict[str, object]:
    """The conflist the node's containerd hands to the CNI plugins."""
    return {
        "cniVersion": "1.0.0",
        "name": CNI_NETWORK,
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                # Not the pods' gateway: no forwarding on the host, no route out.
                "isGateway": False,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    # Its allocations live in the cluster dir, not /var/lib/cni.
                    "dataDir": str(ipam_dir),
                    "ranges": [
                        [
                            {
                                "subnet": POD_CIDR,
                                "rangeStart": POD_RANGE_START,
                                # Named so IPAM never hands out the host's address.
                                "gateway": HOST_ADDRESS,
                            }
                        ]
                    ],
                    # Only the service range goes through the host (kube-proxy's DNAT);
                    # there is no default route in a pod.
                    "routes": [{"dst": SERVICE_CIDR, "gw": HOST_ADDRESS}],
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
            {"type": "loopback"},
        ],
    }


def write_cni_config(conf_dir: pathlib.Path, ipam_dir: pathlib.Path) -> None:
    conf_dir.mkdir(parents=True, exist_ok=True)
    ipam_dir.mkdir(parents=True, exist_ok=True)
    (conf_dir / "10-shardcache.conflist").write_text(
        json.dumps(cni_config(ipam_dir), indent=2) + "\n"
    )


# -- cleanup -----------------------------------------------------------------------------


def our_chains(tool: str, table: str) -> tuple[list[str], list[list[str]]]:
    """(chains of ours, rules in built-in chains that jump to them) in one table."""
    result = _run([tool, "-w", "-t", table, "-S"], check=False)
    if result.returncode != 0:
        return [], []
    chains, jumps = [], []
    for line in result.stdout.splitlines():
        words = line.split()
        if words[:1] == ["-N"] and words[1].startswith(CHAIN_PREFIXES):
            chains.append(words[1])
        elif (
            words[:1] == ["-A"]
            and not words[1].startswith(CHAIN_PREFIXES)
            and any(w.startswith(CHAIN_PREFIXES) for w in words[2:])
        ):
            jumps.append(words[1:])
    return chains, jumps


def remove_chains() -> list[str]:
    """Delete every KUBE-*/CNI-* chain and the rules that lead to it; returns what went.

    Rule by rule rather than a whole-table restore, so rules of anyone else on the
    machine stay as they are.
    """
    removed = []
    for tool in IPTABLES:
        for table in TABLES:
            chains, jumps = our_chains(tool, table)
            for rule in jumps:
                # `-S` prints a rule the way `-A` takes it, so `-D` takes it back.
                _run([tool, "-w", "-t", table, "-D", *_unquote(rule)], check=False)
            for chain in chains:
                _run([tool, "-w", "-t", table, "-F", chain], check=False)
            for chain in chains:
                if _run([tool, "-w", "-t", table, "-X", chain], check=False).returncode == 0:
                    removed.append(f"{tool} -t {table} {chain}")
    return removed


def _unquote(words: list[str]) -> list[str]:
    # `-S` quotes comments ("--comment \"a b\""): rejoin them into one argument.
    joined = " ".join(words)
    parts = re.findall(r'"((?:[^"\\]|\\.)*)"|(\S+)', joined)
    return [quoted.replace('\\"', '"') if quoted else bare for quoted, bare in parts]


def leftover_chains() -> list[str]:
    found = []
    for tool in IPTABLES:
        for table in TABLES:
            chains, jumps = our_chains(tool, table)
            found += [f"{tool} -t {table} {c}" for c in chains]
            found += [f"{tool} -t {table} -A {' '.join(j)}" for j in jumps]
    return found


def netns_of_ours() -> list[str]:
    """Named network namespaces that hold a pod address of ours (containerd's cni-*)."""
    result = _run(["ip", "-j", "netns", "list"], check=False)
    if result.returncode != 0 or not result.stdout.strip():
        return []
    pods = ipaddress.ip_network(POD_CIDR)
    ours = []
    for entry in json.loads(result.stdout):
        name = str(entry.get("name", ""))
        if not name.startswith("cni-"):
            continue
        addrs = _run(["ip", "-n", name, "-j", "addr"], check=False)
        try:
            links = json.loads(addrs.stdout) if addrs.returncode == 0 else []
        except ValueError:
            links = []
        local = [a.get("local", "") for link in links for a in link.get("addr_info", [])]
        # A namespace whose pod interface is already gone (no address at all besides
        # loopback) is one CNI DEL never finished; one with another network's address
        # belongs to someone else.
        if any(_in(addr, pods) for addr in local) or not [
            a for a in local if a not in ("127.0.0.1", "::1")
        ]:
            ours.append(name)
    return ours


def _in(addr: str, net: ipaddress.IPv4Network | ipaddress.IPv6Network) -> bool:
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(addr) in net
    return False


def remove_netns(names: list[str]) -> None:
    for name in names:
        # `ip netns delete` unmounts /run/netns/NAME and removes it.
        _run(["ip", "netns", "delete", name], check=False)
