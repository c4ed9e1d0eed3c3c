"""Opening the sidecar's TCP listeners, and what it says when it cannot.

A port another process holds (two sidecars started by hand both take 8470), a host name
that does not resolve or an address the machine does not have is a setting to change,
so it is refused like a bad setting: one line naming the address and the flag and
variable that set it, rather than the event loop's traceback.

`free_port` picks a port for a process about to be started (the launcher's sidecars and
MinIO, and the tests' servers).
"""

from __future__ import annotations

import errno
import os
import random
import socket
import threading
from collections.abc import Sequence

from aiohttp import web

from shardcache import errors
from shardcache_sidecar import configuration


async def start_tcp(
    runner: web.AppRunner, host: str, port: int, *, port_field: str, host_field: str | None
) -> None:
    """Serve `runner` on `host:port`; an `InputError` says why not. `port_field` and
    `host_field` are the settings that chose them (None: the host is fixed)."""
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as exc:
        raise errors.InputError(cannot_listen(host, port, exc, port_field, host_field)) from exc


def cannot_listen(
    host: str, port: int, exc: OSError, port_field: str, host_field: str | None
) -> str:
    """The one-line refusal: which address, which setting, and the system's reason."""
    # A name that does not resolve or an address not on this machine is the host's
    # fault; anything else (in use, a privileged port) the port's.
    host_at_fault = isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL
    field = host_field if host_at_fault and host_field is not None else port_field
    # The event loop's own text repeats the address; the plain reason is enough here.
    if isinstance(exc, socket.gaierror) or exc.errno is None:
        reason = exc.strerror or str(exc)
    else:
        reason = os.strerror(exc.errno)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return f"cannot listen on {address} ({configuration.where_set(field)}): {reason}"


#: What Linux uses when /proc says nothing (net.ipv4.ip_local_port_range's default).
DEFAULT_EPHEMERAL = (32768, 60999)
#: How far below the ephemeral range a port is drawn: well above the fixed ports of
#: the services around (etcd's 2379, the apiserver's 6443, 8470 and up of the sidecars'
#: metrics, the kubelet's 10250).
BELOW_EPHEMERAL = 16384
#: Kubernetes' default NodePort range: kube-proxy forwards these on the node's
#: addresses to a Service, whoever else listens there.
NODE_PORTS = range(30000, 32768)
_handed: set[tuple[str, int]] = set()
_handed_lock = threading.Lock()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports it picks itself (bind to 0, connect), inclusive."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL


def outside_ephemeral(ephemeral: tuple[int, int]) -> list[range]:
    """Where `free_port` draws from: below the ephemeral range (and the NodePorts)
    and above it."""
    low, high = ephemeral
    below = range(max(1024, low - BELOW_EPHEMERAL), min(low, NODE_PORTS.start))
    return [r for r in (below, range(high + 1, 65536)) if len(r) > 0]


def free_port(host: str = "127.0.0.1", *, within: Sequence[range] | None = None) -> int:
    """A port nothing on `host` holds now, for a process about to listen on it.

    Drawn outside the kernel's ephemeral range (`within` overrides): a port from
    bind(0) lies inside it, where any outgoing connection on the machine can take it
    between this call and the child's own bind (a CI run lost a sidecar's start so:
    "Address already in use"). Never one this process handed out before, so two asked
    in a row differ. Where the ephemeral range leaves nothing outside, bind(0)."""
    pools = list(within) if within is not None else outside_ephemeral(ephemeral_range())
    size = sum(len(r) for r in pools)
    rng = random.SystemRandom()
    for _ in range(min(size, 512)):
        pick = rng.randrange(size)
        for r in pools:
            if pick < len(r):
                port = r[pick]
                break
            pick -= len(r)
        with _handed_lock:
            if (host, port) in _handed or not _bindable(host, port):
                continue
            _handed.add((host, port))
        return port
    if within is not None:
        raise OSError(errno.EADDRINUSE, f"no free port on {host} in {list(within)}")
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _bindable(host: str, port: int) -> bool:
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
