"""The `shardcache` command.

Subcommands are plugins registered under the entry-point group `shardcache.commands`
(see pyproject.toml): each is a `register(subparsers)` function that adds a parser and
sets `func`. The client library therefore never imports the sidecar or the operator.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import select
import signal
import sys
from collections.abc import Callable, Sequence

ENTRY_POINT_GROUP = "shardcache.commands"
#: Exit status of a command whose reader went away, as a shell reports a process that
#: SIGPIPE ended (`yes | head` leaves 141 in PIPESTATUS).
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardcache", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for entry_point in sorted(
        importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name
    ):
        try:
            register: Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None] = (
                entry_point.load()
            )
        except ImportError as exc:
            # An extra that is not installed (say the operator on a trainer image):
            # its command is listed but explains what to install.
            _register_missing(subparsers, entry_point.name, exc)
            continue
        register(subparsers)
    return parser


def _register_missing(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    exc: ImportError,
) -> None:
    parser = subparsers.add_parser(name, help=f"(unavailable: {exc.name} is not installed)")

    def fail(_: argparse.Namespace) -> int:
        print(
            f"shardcache {name}: needs the module {exc.name!r}, which is not installed; "
            f"install the matching extra, e.g. pip install 'shardcache[{name}]'",
            file=sys.stderr,
        )
        return 2

    parser.set_defaults(func=fail)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        status = func(args)
        # Output still buffered would meet a closed pipe at exit, outside this `try`.
        sys.stdout.flush()
    except BrokenPipeError:
        if not _stdout_gone():
            raise
        return _quit_on_broken_pipe()
    return status


def _stdout_gone() -> bool:
    """Whether standard output is a pipe or socket whose reader has gone.

    Python ignores SIGPIPE, so a write to a closed pipe raises BrokenPipeError. Only that
    one on stdout means `| head` has read enough; one from a socket a command talks to
    (the sidecar's clients) is an error to report.
    """
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), 0)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False  # not a real file descriptor (captured, replaced, closed)


def _quit_on_broken_pipe() -> int:
    """End quietly, as a CLI that SIGPIPE ends does, instead of with a traceback.

    SIGPIPE's default action is not restored for the whole run: the sidecar and web
    commands write to sockets and must see EPIPE as an error, not die of a signal.
    """
    # Point stdout at /dev/null so that the interpreter's final flush of what is still
    # buffered does not raise again ("Exception ignored ... BrokenPipeError").
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    raise SystemExit(main())
