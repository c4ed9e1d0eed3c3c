"""Opening the sidecar's TCP listeners, and what it says when it cannot.

A port another process holds (two sidecars started by hand both take 8470), a host name
that does not resolve or an address the machine does not have is a setting to change,
so it is refused like a bad setting: one line naming the address and the flag and
variable that set it, rather than the event loop's traceback.
"""

from __future__ import annotations

import errno
import os
import socket

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
