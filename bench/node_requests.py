"""Sidecar CPU per control request, by route: many requests, so the figure is exact.

    python -m bench.node_requests [--seconds 2] [--shards 6]

`make bench-node` divides the sidecar's CPU over a pass by the requests of that pass;
on a small dataset that is a few clock ticks over a few dozen requests. This runs one
route at a time in a loop against a real sidecar (file:// source, every shard resident)
from one client on kept-alive connections, as a rank's provider sends them, and prints
the sidecar's user + system CPU per request (all its threads, /proc) and the client's
wall time per request. Routes a sidecar does not serve (an older one: no `notes`) are
skipped, so the same script measures the code before and after a change.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from bench import node_probes
from shardcache import plans, sidecar_client
from shardcache.contract import protocol
from tests.support import datasets
from tests.support.sidecar import SidecarProcess


def measure(pid: int, seconds: float, call: Callable[[], object]) -> tuple[int, float, float]:
    """(calls, sidecar CPU ms per call, wall ms per call) of `call` in a loop."""
    cpu, start, n = node_probes.cpu_seconds(pid), time.monotonic(), 0
    while time.monotonic() - start < seconds:
        call()
        n += 1
    wall = time.monotonic() - start
    return n, (node_probes.cpu_seconds(pid) - cpu) / n * 1e3, wall / n * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=2.0, help="per route (default 2)")
    p.add_argument("--shards", type=int, default=6)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="scnr-"))
    datasets.write_dataset(pafs.LocalFileSystem(), str(work / "ds"), [300] * args.shards)
    (work / "sidecar").mkdir()
    proc = SidecarProcess(f"file://{work / 'ds'}", workdir=work / "sidecar")
    proc.start(wait="ready")
    assert proc.process is not None
    pid = proc.process.pid
    try:
        client = sidecar_client.SidecarProvider.from_env(environ=proc.client_env())
        reader = client.open_reader(plans.PlanParams(shuffle=False), position=0)
        for shard in range(args.shards):  # every shard resident: warm lookups only
            client.acquire(reader, shard, epoch=0, position=300 * shard).release()
        client.close()
        transport = sidecar_client.Transport(client.settings)
        body = {**protocol.params_to_json(plans.PlanParams(shuffle=False)), "position": 0}
        features = transport.call("PUT", protocol.reader_path("bench"), body).get("features", [])
        here = {"epoch": 0, "position": 0}

        def acquire(ahead: int) -> Callable[[], None]:
            def call() -> None:
                answer: Any = transport.call(
                    "POST", protocol.acquire_path("bench"), {"shard": 0, **here, "ahead": ahead}
                )
                leases = [answer["lease"], *(g["lease"] for g in answer.get("ahead", []))]
                if "notes" in features:
                    notes = {**here, "pinned": [], "released": leases}
                    transport.call("POST", f"{protocol.PREFIX}/readers/bench/notes", notes)
                else:
                    for lease in leases:
                        transport.call("DELETE", protocol.lease_path(lease))

            return call

        routes: dict[str, Callable[[], object]] = {
            "healthz": lambda: transport.call("GET", protocol.HEALTHZ),
            "position": lambda: transport.call("POST", protocol.position_path("bench"), here),
            "pinned": lambda: transport.call(
                "POST", protocol.pinned_path("bench"), {"shard": 1, **here}
            ),
            "acquire + release": acquire(0),
        }
        if "notes" in features:
            routes["notes (1 pinned)"] = lambda: transport.call(
                "POST", f"{protocol.PREFIX}/readers/bench/notes", {**here, "pinned": [1]}
            )
        if "ahead" in features:
            routes["acquire, 4 ahead + notes"] = acquire(4)
        print(f"{'route':26} {'calls':>7} {'sidecar CPU ms':>15} {'wall ms':>8}")
        for name, call in routes.items():
            n, cpu_ms, wall_ms = measure(pid, args.seconds, call)
            requests = {"acquire + release": 2, "acquire, 4 ahead + notes": 2}.get(name, 1)
            print(f"{name:26} {n:7d} {cpu_ms:15.3f} {wall_ms:8.3f}  ({requests} request(s))")
        getattr(transport, "close", lambda: None)()  # older clients have none
    finally:
        proc.kill()


if __name__ == "__main__":
    main()
