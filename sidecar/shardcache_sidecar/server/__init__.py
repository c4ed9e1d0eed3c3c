"""The sidecar's HTTP servers: the control API on a Unix socket, probes on TCP.

* Unix socket (shared volume, trainer only): the versioned control API of
  docs/wire-format.md (`shardcache.contract.protocol`) plus /healthz, /readyz, /metrics.
* TCP (kubelet probes, Prometheus): /healthz, /readyz, /metrics and the inspector at /ui.

The modules, by what they hold (as `ui.routes` holds the inspector's):

* `lifecycle`: `Sidecar`, the app state handlers reach as `request.app[SIDECAR]`, and
  its start-up (resolve, pin check, warm-up), maintenance and shutdown;
* `control`: the control API's route table and handlers;
* `probes`: the /healthz, /readyz and /metrics route table and handlers;
* `replies`: JSON answers and errors, and which error gets which status;
* `running`: the two apps, the error middleware, and `serve`, which runs them.
"""

from __future__ import annotations

from shardcache_sidecar.server.lifecycle import SIDECAR, STARTUP_READER, Sidecar
from shardcache_sidecar.server.running import control_app, probe_app, remove_stale_socket, serve

__all__ = [
    "SIDECAR",
    "STARTUP_READER",
    "Sidecar",
    "control_app",
    "probe_app",
    "remove_stale_socket",
    "serve",
]
