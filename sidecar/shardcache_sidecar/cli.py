"""`shardcache sidecar`: run the cache sidecar (control socket, probes, metrics).

Configured by the `SHARDCACHE_*` environment variables the webhook injects; the flags
override them (handy outside a cluster). SIGTERM shuts down cleanly: the servers stop,
the cache closes, the socket file is removed.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import faulthandler
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from shardcache import errors
from shardcache.contract import parsers, variables
from shardcache_sidecar import configuration, logs, server, termination
from shardcache_sidecar.server import running

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
        help_text = _help(option.variable)
        if option.variable.parser is parsers.BOOLEAN:
            # `--shuffle`, `--shuffle false` and `--no-shuffle`. A value is parsed like
            # the variable: argparse's BooleanOptionalAction takes none, so
            # `--shuffle ture` left `ture` to the top-level parser, whose error named
            # neither the flag nor what it expects.
            add(
                option.flag,
                dest=option.field,
                nargs="?",
                const=True,
                type=option.variable.parser.flag_type,
                metavar="BOOLEAN",
                help=help_text,
            )
            add(
                "--no-" + option.flag.removeprefix("--"),
                dest=option.field,
                action="store_const",
                const=False,
                default=None,
                help=f"same as {option.flag} false",
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
    defaults = {f.name: f.default for f in dataclasses.fields(configuration.Settings)}
    add(
        "--handoff-timeout",
        type=parsers.SECONDS.flag_type,
        metavar="SECONDS",
        help="seconds a handed-over shard stays held for the client "
        f"(default {defaults['handoff_timeout']:g})",
    )
    add(
        "--acquire-timeout",
        type=parsers.SECONDS.flag_type,
        metavar="SECONDS",
        help=f"longest an acquire may wait, seconds (default {defaults['acquire_timeout']:g})",
    )
    add(
        "--source-retry-seconds",
        type=_RETRY_BUDGET.flag_type,
        metavar="SECONDS",
        help="how long a shard fetch retries a store that fails transiently, seconds; "
        f"0: no retries (default {defaults['source_retry_seconds']:g})",
    )
    add(
        "--control-threads",
        type=parsers.integer(minimum=1).flag_type,
        metavar="INTEGER",
        help="threads for blocking cache calls (waiting acquires) "
        f"(default {defaults['control_threads']}; at least 1)",
    )
    parser.set_defaults(func=run)


def _help(variable: variables.Variable[Any]) -> str:
    """The row's doc, its variable, its default and its range, as `--help` shows them."""
    notes = [f"${variable.env}"]
    if variable.default is not None:
        value = variable.render(variable.default)
        if variable.parser is parsers.BYTES:
            value = f"{value} ({parsers.quantity(variable.default)})"
        notes.append(f"default {value}")
    low, high = variable.parser.minimum, variable.parser.maximum
    if low is not None and high is not None:
        notes.append(f"range {low}-{high}")
    elif low is not None:
        notes.append(f"at least {low}")
    elif high is not None:
        notes.append(f"at most {high}")
    # argparse expands %-formats in help texts.
    return f"{variable.doc} ({'; '.join(notes)})".replace("%", "%%")


#: The contract's seconds (`parsers.seconds`), 0 included.
_RETRY_BUDGET = parsers.seconds(zero="no retries")


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
    # Where a refusal is written for `kubectl describe` (`termination`), before the
    # settings that name it are known to be valid.
    given = overrides.get("termination_message_path")
    message_path = Path(given) if given else termination.path_from(os.environ)
    try:
        settings = configuration.from_env(overrides=overrides)
        made = running.make_directories(settings)
    except errors.InputError as exc:
        print(f"shardcache sidecar: {exc}", file=sys.stderr)
        termination.write(message_path, f"shardcache sidecar: {exc}")
        return 2
    logs.configure(settings.log_format, settings.log_level)
    # `kill -USR1` dumps every thread's stack to stderr: how to see what a stuck
    # acquire waits on in a running pod.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    code = 0
    try:
        asyncio.run(_main(settings))
    except errors.InputError as exc:
        log.error("cannot start: %s", exc)
        if not isinstance(exc, termination.Written):  # else it holds every source's reason
            termination.write(settings.termination_message_path, f"cannot start: {exc}")
        running.remove_made(made)
        return 2
    except termination.Unfinished:
        # Logged and in the termination message already; the status makes the
        # container's last state an error, which `kubectl describe` shows.
        code = 1
    # Threads still blocked on the object store would hold the interpreter open for as
    # long as their fetch takes; the work is abandoned and the kernel drops its locks.
    busy = [
        t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon
    ]
    if busy or code:
        # A drain cut off leaves its upload inside the store's client (a daemon
        # thread): a normal exit would wait on it in the interpreter's shutdown
        # (pyarrow's S3 finalizer), the hang the drain's bound is for.
        log.info("exiting with %d cache thread(s) still busy", len(busy))
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


async def _main(settings: configuration.Settings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.serve(settings, stop)
