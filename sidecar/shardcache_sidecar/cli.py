"""`shardcache sidecar`: run the cache sidecar (control socket, probes, metrics).

Configured by the `SHARDCACHE_*` environment variables the webhook injects; the flags
override them (handy outside a cluster). SIGTERM shuts down cleanly: the servers stop,
the cache closes, the socket file is removed.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import os
import signal
import sys
import threading
from typing import Any

from shardcache import errors
from shardcache_sidecar import configuration, logs, server

log = logging.getLogger("shardcache_sidecar")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "sidecar",
        help="run the node cache sidecar",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--source", dest="source_uri", help="dataset URI ($SHARDCACHE_SOURCE_URI)")
    add("--format", dest="source_format", help="shard format; default: from file names")
    add("--digest", dest="manifest_digest", help="pinned manifest digest sha256:...")
    add("--run-dir", help="run directory holding <mount>/control.sock and <mount>/mem")
    add("--mount", help="mount name (a subdirectory of the run directory)")
    add("--socket", dest="socket_path", help="control socket path (overrides run dir/mount)")
    add("--memory-dir", help="memory-tier directory (default <run dir>/<mount>/mem)")
    add("--disk-dir", help="disk-tier directory")
    add("--memory-limit", type=int, help="memory-tier limit in bytes")
    add("--disk-limit", type=int, help="disk-tier limit in bytes")
    add("--prefetch-depth", type=int, help="shards decoded ahead of each reader")
    add("--fetch-concurrency", type=int, help="concurrent source fetches")
    add("--ready-shards", type=int, help="shards of the startup plan resident before /readyz")
    add("--seed", type=int, help="startup plan: seed")
    add("--rank", type=int, help="startup plan: rank")
    add("--world-size", type=int, help="startup plan: world size")
    add("--block-size", type=int, help="startup plan: rows per shuffle block")
    add(
        "--no-shuffle",
        dest="shuffle",
        action="store_const",
        const=False,
        help="startup plan: no shuffle",
    )
    add("--metrics-host", help="TCP address for /healthz, /readyz, /metrics (default 0.0.0.0)")
    add("--metrics-port", type=int, help="TCP port for /healthz, /readyz, /metrics")
    add(
        "--handoff-timeout",
        type=float,
        help="seconds a handed-over shard stays held for the client",
    )
    add("--acquire-timeout", type=float, help="longest an acquire may wait, seconds")
    add("--control-threads", type=int, help="threads for blocking cache calls (waiting acquires)")
    add("--log-format", choices=("json", "text"))
    add("--log-level")
    parser.set_defaults(func=run)


_NOT_SETTINGS = {"command", "func"}


def run(args: argparse.Namespace) -> int:
    overrides: dict[str, Any] = {k: v for k, v in vars(args).items() if k not in _NOT_SETTINGS}
    try:
        settings = configuration.from_env(overrides=overrides)
    except errors.InputError as exc:
        print(f"shardcache sidecar: {exc}", file=sys.stderr)
        return 2
    logs.configure(settings.log_format, settings.log_level)
    # `kill -USR1` dumps every thread's stack to stderr: how to see what a stuck
    # acquire waits on in a running pod.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        asyncio.run(_main(settings))
    except errors.InputError as exc:
        log.error("cannot start: %s", exc)
        return 2
    # Threads still blocked on the object store would hold the interpreter open for as
    # long as their fetch takes; the work is abandoned and the kernel drops its locks.
    busy = [
        t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon
    ]
    if busy:
        log.info("exiting with %d cache thread(s) still busy", len(busy))
        logging.shutdown()
        os._exit(0)
    return 0


async def _main(settings: configuration.Settings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.serve(settings, stop)
