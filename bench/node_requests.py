"""Sidecar CPU per control request, by route: many requests, so the figure is exact.

    python -m bench.node_requests [--seconds 2] [--shards 6] [--gap-ms 0]

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
import contextlib
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardcache_sidecar import launcher

from bench import node_dataset, node_probes, node_profile
from shardcache import contract, plans, sidecar_client
from shardcache.contract import protocol

#: Rows per shard (`node_dataset` writes a multiple of its 4,096-row block).
ROWS = 4096


def measure(
    pid: int, seconds: float, call: Callable[[], object], gap: float = 0.0
) -> tuple[int, float, float]:
    """(calls, sidecar CPU ms per call, wall ms per call without the gaps) of `call`
    in a loop, `gap` seconds apart."""
    cpu, start, n, slept = node_probes.cpu_seconds(pid), time.monotonic(), 0, 0.0
    while time.monotonic() - start < seconds:
        call()
        n += 1
        if gap:
            before = time.monotonic()
            time.sleep(gap)
            slept += time.monotonic() - before
    wall = time.monotonic() - start - slept
    return n, (node_probes.cpu_seconds(pid) - cpu) / n * 1e3, wall / n * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=2.0, help="per route (default 2)")
    p.add_argument("--shards", type=int, default=6)
    p.add_argument(
        "--profile",
        type=Path,
        help="py-spy the sidecar into this file, one route after another (pip install py-spy)",
    )
    p.add_argument("--only", help="measure only the routes whose name contains this")
    p.add_argument(
        "--gap-ms",
        type=float,
        default=0.0,
        help="pause between calls, so each finds the sidecar idle, as a rank's do while "
        "it reads (default 0: back to back)",
    )
    args = p.parse_args()
    shm = Path("/dev/shm")
    work = Path(tempfile.mkdtemp(prefix="scnr-", dir=shm if shm.is_dir() else None))
    try:
        run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, work: Path) -> None:
    # The sidecar as bench.node and bench.node_opens start it (no test support code:
    # this runs on the device machine, which has no pytest).
    root = f"file://{work / 'source'}"
    node_dataset.generate(root, {}, args.shards, ROWS, threads=node_probes.usable_cores())
    sidecar_env = {
        contract.ENV_READY_SHARDS: str(args.shards),
        "SHARDCACHE_LOG_LEVEL": "WARNING",
    }
    with launcher.sidecar(root, {}, work, extra_env=sidecar_env) as (trainer_env, _):
        pid = node_probes.find_child("shardcache sidecar")
        client = sidecar_client.SidecarProvider.from_env(environ=trainer_env)
        reader = client.open_reader(plans.PlanParams(shuffle=False), position=0)
        for shard in range(args.shards):  # every shard resident: warm lookups only
            client.acquire(reader, shard, epoch=0, position=ROWS * shard).release()
        client.close()
        transport = sidecar_client.Transport(client.settings)
        # With `seq` as a provider sends it (an older sidecar ignores it): always the
        # same, so every position is applied after its one compare (`FEATURE_SEQ`).
        seq = {protocol.SEQ_FIELD: 0}
        body = {**protocol.params_to_json(plans.PlanParams(shuffle=False)), "position": 0, **seq}
        features = transport.call("PUT", protocol.reader_path("bench"), body).get("features", [])
        here = {"epoch": 0, "position": 0, **seq}

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
        epochs = iter(range(1, 1 << 30))
        # A rank enters a new epoch every pass: the sidecar makes (or slices) its plan.
        routes["position (a new epoch)"] = lambda: transport.call(
            "POST", protocol.position_path("bench"), {"epoch": next(epochs), "position": 0, **seq}
        )
        if "notes" in features:
            routes["notes (1 pinned)"] = lambda: transport.call(
                "POST", f"{protocol.PREFIX}/readers/bench/notes", {**here, "pinned": [1]}
            )
            # What a rank's notes carry in `make bench-node`: about 13 shards each.
            many = [s % args.shards for s in range(16)]
            routes["notes (16 pinned)"] = lambda: transport.call(
                "POST", f"{protocol.PREFIX}/readers/bench/notes", {**here, "pinned": many}
            )
        if "ahead" in features:
            routes["acquire, 4 ahead + notes"] = acquire(4)
        print(f"{'route':26} {'calls':>7} {'sidecar CPU ms':>15} {'wall ms':>8}")
        for name, call in routes.items():
            if args.only and args.only not in name:
                continue
            profile = None
            if args.profile:
                slug = re.sub(r"[^a-z0-9]+", "-", name).strip("-")
                profile = args.profile.with_name(f"{args.profile.stem}-{slug}.txt")
            with node_profile.sampling(pid, profile) if profile else contextlib.nullcontext():
                n, cpu_ms, wall_ms = measure(pid, args.seconds, call, args.gap_ms / 1e3)
            if profile:
                print(node_profile.summary(profile))
            requests = {"acquire + release": 2, "acquire, 4 ahead + notes": 2}.get(name, 1)
            print(f"{name:26} {n:7d} {cpu_ms:15.3f} {wall_ms:8.3f}  ({requests} request(s))")
        getattr(transport, "close", lambda: None)()  # older clients have none


if __name__ == "__main__":
    main()
