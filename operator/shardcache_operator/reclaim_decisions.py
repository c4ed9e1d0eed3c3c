"""Which namespace directories of a node path to reclaim: a pure decision.

The node disk tier is one directory per namespace, `ns-<namespace>` below the node
path (`pod_env.namespace_subdir`); only that namespace's sidecars evict from it, so a
deleted namespace's bytes would stay on every node forever. The node-cache DaemonSet
(`node_reclaim`) lists the node path and the cluster's namespaces once a round and asks
this module what to do; it does the I/O.

Only a name that is exactly `ns-` + a valid namespace name (a DNS-1123 label) is ever
reclaimed; any other `ns-` name is refused (said, never touched), and every other name
(an older chart's flat tier, anything an administrator put there) is ignored. A
directory already renamed aside (`ASIDE_PREFIX`) by an earlier round whose removal did
not finish is removed again.
"""

from __future__ import annotations

import dataclasses
import re
import secrets
from collections.abc import Iterable

#: What every namespace directory's name starts with (`pod_env.namespace_subdir`).
NAMESPACE_PREFIX = "ns-"
#: A namespace directory renamed aside for removal: a dot name, which no sidecar mounts
#: and no tier lists.
ASIDE_PREFIX = ".reclaiming-"

# Kubernetes' DNS-1123 label: what a namespace name must be.
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


@dataclasses.dataclass(frozen=True)
class Decision:
    """One round's decision over a node path's listing."""

    #: (directory name, namespace) of each namespace directory whose namespace is gone.
    reclaim: tuple[tuple[str, str], ...] = ()
    #: Names renamed aside by an earlier round and not yet removed.
    leftovers: tuple[str, ...] = ()
    #: (directory name, why) of each `ns-` name that is not a namespace's.
    refused: tuple[tuple[str, str], ...] = ()


def namespace_of(name: str) -> str | None:
    """The namespace whose directory `name` is, or None if it is none's."""
    if not name.startswith(NAMESPACE_PREFIX):
        return None
    namespace = name[len(NAMESPACE_PREFIX) :]
    return namespace if _NAMESPACE.fullmatch(namespace) else None


def decide(names: Iterable[str], namespaces: Iterable[str]) -> Decision:
    """What to reclaim among the node path's entries `names`, given every namespace
    that exists (`namespaces`, the one list of the round)."""
    existing = frozenset(namespaces)
    reclaim: list[tuple[str, str]] = []
    leftovers: list[str] = []
    refused: list[tuple[str, str]] = []
    for name in sorted(names):
        if name.startswith(ASIDE_PREFIX):
            leftovers.append(name)
            continue
        if not name.startswith(NAMESPACE_PREFIX):
            continue
        namespace = namespace_of(name)
        if namespace is None:
            refused.append(
                (
                    name,
                    f"expected {NAMESPACE_PREFIX!r} followed by a namespace name (at most 63 "
                    f"lowercase letters, digits and '-', starting and ending with a letter "
                    f"or digit), found {name!r}",
                )
            )
        elif namespace not in existing:
            reclaim.append((name, namespace))
    return Decision(tuple(reclaim), tuple(leftovers), tuple(refused))


def aside_name(namespace: str) -> str:
    """A fresh name to rename `namespace`'s directory aside to."""
    return f"{ASIDE_PREFIX}{namespace}-{secrets.token_hex(4)}"
