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
from shardcache.contract import parsers
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
    # One flag per contract variable the sidecar reads, parsed like the variable.
    for option in configuration.OPTIONS:
        help_text = f"{option.variable.doc} (${option.variable.env})"
        if option.variable.parser is parsers.BOOLEAN:
            add(
                option.flag,
                dest=option.field,
                action=argparse.BooleanOptionalAction,
                help=help_text,
            )
        else:
            add(
                option.flag,
                dest=option.field,
                type=option.variable.parser.flag_type,
                metavar=_metavar(option.variable.parser.kind),
                help=help_text,
            )
    # Sidecar-only tuning, no environment variable: nothing else sets them.
    add(
        "--handoff-timeout",
        type=float,
        help="seconds a handed-over shard stays held for the client",
    )
    add("--acquire-timeout", type=float, help="longest an acquire may wait, seconds")
    add(
        "--source-retry-seconds",
        type=float,
        help="how long a shard fetch retries a store that fails transiently, seconds",
    )
    add("--control-threads", type=int, help="threads for blocking cache calls (waiting acquires)")
    parser.set_defaults(func=run)


def _metavar(kind: str) -> str:
    """`{json,text}` for a choice, else the kind's first word: `INTEGER`, `BYTES`."""
    if "/" in kind:
        return "{" + kind.replace("/", ",") + "}"
    return kind.split()[0].upper()


_NOT_SETTINGS = {"command", "func"}
#: How long a thread running Python keeps the GIL while another waits for it (seconds;
#: CPython's default is 5 ms). Every system call on the event loop (a socket's recv and
#: send, a lease's flock, a stat) lets the GIL go, and taking it back from a fetch or
#: pool thread running Python waited up to the whole interval: at 5 ms, a loop asking
#: 48 stats beside one busy thread took 27-40 ms at the p99, at 0.5 ms 5 ms
#: (`python -m bench.node_membership --switch-interval`, docs/benchmarks.md). The cost
#: is more hand-overs between busy threads, whose heavy work (reading, hashing,
#: decoding) runs in pyarrow and hashlib without the GIL.
SWITCH_INTERVAL_S = 0.0005


def run(args: argparse.Namespace) -> int:
    sys.setswitchinterval(SWITCH_INTERVAL_S)
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
