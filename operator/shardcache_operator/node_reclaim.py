"""The node-cache DaemonSet's reclaim: a deleted namespace's node disk tier removed.

`python3 -m shardcache_operator.node_reclaim /node-cache [/node-cache-1 ...]
[--node-path NODE_PATH ...] --interval-seconds 600` (the chart's node-cache DaemonSet,
`nodeCache.reclaim`: one directory per `policy.nodePaths` entry, each mounted on its
own, and the node path each is mounted from, which the logs name). Every interval, one
round:

1. one `list namespaces` (the DaemonSet's service account may do nothing else), for
   each namespace's name and UID, shared by every node path; when it fails the round
   removes nothing anywhere and the next round tries again;
2. for each node path on its own, its entries, and `reclaim_decisions.decide` over
   both: a directory
   `ns-<namespace>.<uid>` whose (name, UID) no live namespace has (deleted, or deleted
   and created again), and a legacy `ns-<namespace>` whose namespace is gone or whose
   live namespace's keyed directory exists;
3. each such directory is renamed aside under its tier lock while no process holds a
   lock in it (`shardcache.node.tiers.move_aside_unused`; one in use is left for a
   later round), then removed; so is anything an earlier round renamed aside and did
   not finish removing. A node path that cannot be listed (missing, not a directory, a
   link, unreadable) is skipped this round with a WARNING naming it; the others go on.

What was removed and its bytes are logged at INFO, what was left and why at INFO too
(a namespace's last pods may take a round to stop), refused names at WARNING once.
Removal never follows a link (`shutil.rmtree` by descriptors, the node path itself
opened without following one) and never leaves the node path (every name is one
component, opened relative to it).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import signal
import stat
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from shardcache import errors
from shardcache.node import regular_files, tiers
from shardcache_operator import paging, reclaim_decisions

log = logging.getLogger(__name__)

#: Every namespace that exists: name -> UID; raises when the API cannot say.
NamespaceLister = Callable[[], Mapping[str, str]]

_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclasses.dataclass
class Round:
    """What one round did (for logs and tests)."""

    #: directory name (or the name it was renamed aside to) -> bytes removed.
    removed: dict[str, int] = dataclasses.field(default_factory=dict)
    #: directory name -> why it was left this round.
    kept: dict[str, str] = dataclasses.field(default_factory=dict)
    #: Names refused (`reclaim_decisions.Decision.refused`).
    refused: list[str] = dataclasses.field(default_factory=list)
    #: Why the round removed nothing at all in this node path (the namespace list
    #: failed, the node path could not be listed), or None.
    skipped: str | None = None


def remove_aside(root: Path, aside: str) -> tuple[int, int]:
    """Remove the directory `root/aside` (renamed aside, in no one's use); return (files,
    bytes) it held. Links inside are removed, never followed."""
    root_fd = os.open(root, _DIRECTORY_FLAGS)
    try:
        files = size = 0
        for _, _, filenames, dir_fd in os.fwalk(aside, dir_fd=root_fd, follow_symlinks=False):
            for filename in filenames:
                try:
                    st = os.stat(filename, dir_fd=dir_fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    files += 1
                    size += st.st_size
        shutil.rmtree(aside, dir_fd=root_fd)
        return files, size
    finally:
        os.close(root_fd)


def reclaim_round(
    root: Path, namespaces: NamespaceLister, *, said: set[str] | None = None
) -> Round:
    """One round over the node path `root` alone (module docstring). `said`: refused
    names already warned about (each is warned about once)."""
    return reclaim_paths([root], namespaces, said=None if said is None else {root: said})[root]


def node_paths(roots: Sequence[Path], given: Sequence[str]) -> dict[Path, Path]:
    """Each mount point in `roots` -> the node's path it is mounted from (`given`, in
    the same order; the mount point itself when none is given), which the logs name:
    a node's admin knows /var/cache/shardcache, not the container's /node-cache."""
    nodes = given or [str(root) for root in roots]
    return {root: Path(node) for root, node in zip(roots, nodes, strict=True)}


def reclaim_paths(
    roots: Sequence[Path],
    namespaces: NamespaceLister,
    *,
    said: dict[Path, set[str]] | None = None,
    shown: Mapping[Path, Path] | None = None,
) -> dict[Path, Round]:
    """One round over every node path in `roots`: one namespace list for all of them,
    then each path on its own, so that one that fails leaves the others their round.
    `said`: per node path, the refused names already warned about. `shown`: the node
    path the logs name for each root (`node_paths`; the root itself by default)."""
    try:
        existing = dict(namespaces())
    except Exception as exc:  # any failure of the API or its client: retry next round
        why = f"could not list namespaces ({type(exc).__name__}: {exc})"
        log.warning("node cache reclaim: %s; nothing removed, next round retries", why)
        return {root: Round(skipped=why) for root in roots}
    rounds: dict[Path, Round] = {}
    for root in roots:
        warned = None if said is None else said.setdefault(root, set())
        named = (shown or {}).get(root, root)
        try:
            rounds[root] = _reclaim_listed(root, existing, warned, named)
        except OSError as exc:
            why = why_unlistable(root, exc)
            log.warning(
                "node cache reclaim: node path %s skipped this round: %s; the other node"
                " paths go on, the next round tries it again",
                named,
                why,
            )
            rounds[root] = Round(skipped=why)
        except Exception as exc:  # a bug, said with its traceback; not the others' round
            log.exception(
                "node cache reclaim: node path %s: the round failed; the next round retries",
                named,
            )
            rounds[root] = Round(skipped=f"the round failed ({type(exc).__name__}: {exc})")
    return rounds


def list_node_path(root: Path) -> list[str]:
    """The entries of the node path `root`, opened without following a link (as every
    removal below it opens it); OSError when it cannot be listed."""
    root_fd = os.open(root, _DIRECTORY_FLAGS)
    try:
        return os.listdir(root_fd)
    finally:
        os.close(root_fd)


def why_unlistable(root: Path, exc: OSError) -> str:
    """Why `list_node_path(root)` raised `exc`, in words for the log."""
    try:
        found = os.lstat(root)
    except FileNotFoundError:
        return "it does not exist"
    except OSError:
        return f"it could not be listed ({exc})"
    if not stat.S_ISDIR(found.st_mode):
        return f"it is {regular_files.kind(found.st_mode)}, not a directory"
    return f"it could not be listed ({exc})"


def _reclaim_listed(
    root: Path, existing: Mapping[str, str], said: set[str] | None, named: Path
) -> Round:
    """The round over `root`, whose logs name it `named` (its node path)."""
    done = Round()
    decision = reclaim_decisions.decide(list_node_path(root), existing)
    for name, reason in decision.refused:
        done.refused.append(name)
        if said is None or name not in said:
            log.warning("node cache reclaim: %s left alone: %s", named / name, reason)
            if said is not None:
                said.add(name)
    for aside in decision.leftovers:
        _remove(root, aside, name=aside, what="an earlier round", done=done, named=named)
    for name, namespace, what in decision.reclaim:
        aside = reclaim_decisions.aside_name(namespace)
        why: str | None
        try:
            why = tiers.move_aside_unused(root, name, aside)
        except (OSError, errors.CacheError) as exc:
            why = f"could not be checked ({exc})"
        if why is not None:
            done.kept[name] = why
            log.info("node cache reclaim: %s (%s) kept this round: %s", named / name, what, why)
            continue
        _remove(root, aside, name=name, what=what, done=done, named=named)
    return done


def _remove(root: Path, aside: str, *, name: str, what: str, done: Round, named: Path) -> None:
    try:
        files, size = remove_aside(root, aside)
    except OSError as exc:
        # Renamed aside already: no sidecar sees it; the next round removes the rest.
        log.warning(
            "node cache reclaim: removing %s failed (%s); the next round retries",
            named / aside,
            exc,
        )
        return
    done.removed[name] = size
    log.info(
        "node cache reclaim: removed %s (%s): %d files, %d bytes", named / aside, what, files, size
    )


def kubernetes_lister() -> NamespaceLister:
    """Every namespace's name and UID, in pages, through the pod's service account."""
    import kubernetes  # the operator extra: in the image, not in the client library

    def names() -> dict[str, str]:
        kubernetes.config.load_incluster_config()  # type: ignore[no-untyped-call]
        core = kubernetes.client.CoreV1Api()

        def page(token: str | None) -> tuple[list[Any], str | None]:
            found = core.list_namespace(
                limit=paging.PAGE_SIZE, _continue=token, _request_timeout=30
            )
            return list(found.items), found.metadata._continue if found.metadata else None

        # No UID (none the API server serves): "" keeps every directory of the name
        # (`reclaim_decisions.why_reclaimed`).
        return {
            ns.metadata.name: ns.metadata.uid or ""
            for ns in paging.every_item(page)
            if ns.metadata and ns.metadata.name
        }

    return names


def run(
    roots: Sequence[Path],
    interval: float,
    namespaces: NamespaceLister,
    stop: threading.Event,
    shown: Mapping[Path, Path] | None = None,
) -> None:
    """Rounds over every node path in `roots` every `interval` seconds until `stop` is set."""
    said: dict[Path, set[str]] = {}
    while not stop.is_set():
        try:
            reclaim_paths(roots, namespaces, said=said, shown=shown)
        except Exception:  # a bug: said with its traceback; the next round may fare better
            log.exception("node cache reclaim: the round failed; the next round retries")
        stop.wait(interval)


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line (the chart's: `/node-cache [/node-cache-1 ...] --interval-seconds=N`;
    an older chart's, one directory, is the same)."""
    parser = argparse.ArgumentParser(
        prog="python3 -m shardcache_operator.node_reclaim",
        description="Remove the node disk tier of every namespace that no longer exists.",
    )
    parser.add_argument(
        "roots",
        metavar="DIR",
        nargs="+",
        help="a node path, as mounted here (the chart: /node-cache for nodeCache.path,"
        " /node-cache-1, ... for the other policy.nodePaths entries)",
    )
    parser.add_argument(
        "--interval-seconds", type=float, default=600.0, help="seconds between rounds (> 0)"
    )
    parser.add_argument(
        "--node-path",
        action="append",
        dest="node_paths",
        default=[],
        metavar="NODE_PATH",
        help="the node's path each DIR is mounted from, in DIR's order, for the logs"
        " (repeat once per DIR; default: the logs name DIR)",
    )
    parser.add_argument("--once", action="store_true", help="one round, then exit")
    args = parser.parse_args(argv)
    if not args.interval_seconds > 0:
        parser.error(f"--interval-seconds must be > 0, found {args.interval_seconds}")
    problem = bad_roots(args.roots)
    if problem is not None:
        parser.error(problem)
    if args.node_paths and len(args.node_paths) != len(args.roots):
        parser.error(
            f"--node-path: expected one per DIR ({len(args.roots)}: {' '.join(args.roots)}), "
            f"found {len(args.node_paths)}: {' '.join(args.node_paths)}"
        )
    args.roots = [Path(root) for root in args.roots]
    return args


def bad_roots(given: Sequence[str]) -> str | None:
    """What is wrong with the node paths `given` on the command line, or None."""
    seen: dict[str, str] = {}
    for root in given:
        if not root:
            return "DIR must be a node path, found an empty argument"
        same = os.path.abspath(root)
        if same in seen:
            return (
                f"DIR {root!r} names the node path {seen[same]!r} again: give each node path once"
            )
        seen[same] = root
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    stop = threading.Event()

    # As pid 1 an unhandled SIGTERM is dropped: handle it, so the pod stops at once.
    def on_term(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_term)
    lister = kubernetes_lister()
    shown = node_paths(args.roots, args.node_paths)
    if args.once:
        reclaim_paths(args.roots, lister, shown=shown)
        return 0
    run(args.roots, args.interval_seconds, lister, stop, shown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
