"""Which namespace directories of a node path to reclaim: a pure decision.

The node disk tier is one directory per namespace below the node path, named for the
namespace and its UID (`ns-<namespace>.<uid>`, `namespace_dirs`); only that namespace's
sidecars evict from it, so a deleted namespace's bytes would stay on every node forever.
The node-cache DaemonSet (`node_reclaim`) lists the node path and the cluster's
namespaces (name and UID) once a round and asks this module what to do; it does the I/O.

* `ns-<namespace>.<uid>` is reclaimed once no live namespace has that (name, UID) pair:
  the namespace was deleted, or deleted and created again (a new UID, a new directory:
  the new tenant never sees the old one's entries).
* `ns-<namespace>` (legacy: pods injected before the UID was used, or offline) is
  reclaimed once no live namespace has that name, as before, or once the directory of
  the live namespace of that name (`ns-<namespace>.<its uid>`) exists on the node: its
  new pods use that one, so the legacy directory only serves pods injected before, and
  those hold locks in it while they run (`tiers.move_aside_unused` leaves a directory
  in use for a later round). Not while the live namespace has no keyed directory here:
  with the operator rolled back, its pods would again use the legacy directory, and
  removing it between two jobs would only cost them the cache.

Only a name that is exactly one of those forms is ever reclaimed; any other `ns-` name
is refused (said, never touched), and every other name (an older chart's flat tier,
anything an administrator put there) is ignored. A directory already renamed aside
(`ASIDE_PREFIX`) by an earlier round whose removal did not finish is removed again.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Iterable, Mapping

from shardcache_operator import namespace_dirs

#: What every namespace directory's name starts with (`namespace_dirs`).
NAMESPACE_PREFIX = namespace_dirs.PREFIX
#: A namespace directory renamed aside for removal: a dot name, which no sidecar mounts
#: and no tier lists.
ASIDE_PREFIX = ".reclaiming-"


@dataclasses.dataclass(frozen=True)
class Decision:
    """One round's decision over a node path's listing."""

    #: (directory name, namespace, why) of each namespace directory to reclaim; `why`
    #: ends the log line of its removal ("deleted namespace team-a").
    reclaim: tuple[tuple[str, str, str], ...] = ()
    #: Names renamed aside by an earlier round and not yet removed.
    leftovers: tuple[str, ...] = ()
    #: (directory name, why) of each `ns-` name that is not a namespace's.
    refused: tuple[tuple[str, str], ...] = ()


def namespace_of(name: str) -> str | None:
    """The namespace whose directory `name` is (keyed or legacy), or None if it is none's."""
    parsed = namespace_dirs.parse(name)
    return parsed.namespace if parsed else None


def why_reclaimed(
    parsed: namespace_dirs.Parsed, live: Mapping[str, str], names: frozenset[str]
) -> str | None:
    """Why the directory `parsed` names is reclaimed, given the live namespaces (name ->
    UID, "" where the list gave none) and every name in the node path; None to keep it."""
    namespace = parsed.namespace
    uid = live.get(namespace)
    if uid is None:
        return f"deleted namespace {namespace}"
    if not uid:  # a live namespace whose UID the list did not give: keep all of its
        return None
    if parsed.uid is not None:
        if parsed.uid == uid:
            return None
        return f"deleted namespace {namespace} UID {parsed.uid}; the live one's UID is {uid}"
    try:
        current = namespace_dirs.keyed(namespace, uid)
    except ValueError:  # a UID no webhook would have keyed a directory by
        return None
    if current in names:
        return f"legacy directory of namespace {namespace}, whose pods now use {current}"
    return None


def decide(names: Iterable[str], namespaces: Mapping[str, str]) -> Decision:
    """What to reclaim among the node path's entries `names`, given every namespace
    that exists (`namespaces`, name -> UID, the one list of the round)."""
    listed = frozenset(names)
    reclaim: list[tuple[str, str, str]] = []
    leftovers: list[str] = []
    refused: list[tuple[str, str]] = []
    for name in sorted(listed):
        if name.startswith(ASIDE_PREFIX):
            leftovers.append(name)
            continue
        if not name.startswith(NAMESPACE_PREFIX):
            continue
        parsed = namespace_dirs.parse(name)
        if parsed is None:
            refused.append((name, f"{namespace_dirs.EXPECTED}, found {name!r}"))
            continue
        why = why_reclaimed(parsed, namespaces, listed)
        if why is not None:
            reclaim.append((name, parsed.namespace, why))
    return Decision(tuple(reclaim), tuple(leftovers), tuple(refused))


def aside_name(namespace: str) -> str:
    """A fresh name to rename `namespace`'s directory aside to."""
    return f"{ASIDE_PREFIX}{namespace}-{secrets.token_hex(4)}"
