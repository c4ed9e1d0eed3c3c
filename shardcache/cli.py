"""The `shardcache` command.

Subcommands are plugins registered under the entry-point group `shardcache.commands`
(see pyproject.toml): each is a `register(subparsers)` function that adds a parser and
sets `func`. The client library therefore never imports the sidecar or the operator.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from collections.abc import Callable, Sequence

ENTRY_POINT_GROUP = "shardcache.commands"


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
    return func(args)


if __name__ == "__main__":
    raise SystemExit(main())
