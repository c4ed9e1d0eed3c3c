"""The names of the namespace directories of the node disk tier, and what a name says.

Each namespace's sidecars keep their disk tier in a directory of their own below the
node path (`pod_volumes.disk_mount` mounts it alone, as a subPath), named for the
namespace *and its UID*: `ns-<namespace>.<uid>` (`keyed`). The name alone would be
inherited: a namespace deleted and created again with the same name, before the
node-cache reclaim removed the old directory, would have been given the earlier
tenant's cached entries (docs/security.md). A UID is never reused, so a namespace
created again gets a directory of its own, and the reclaim removes the old one once no
live namespace has that (name, UID) pair.

The separator is a dot, which a namespace name (a DNS-1123 label) never contains, so
a keyed name is never a valid legacy name: `ns-<namespace>` (`legacy`), what pods
injected before namespace UIDs were used mount, and what offline injection (no API to
ask for the UID) still writes. A node-cache reclaim from before this change refuses
(never touches) the keyed names rather than taking one for the directory of a missing
namespace called `<namespace>-<uid>`, as a '-' separator would have made it.
"""

from __future__ import annotations

import dataclasses
import re

#: What every namespace directory's name starts with.
PREFIX = "ns-"
#: Between the namespace and its UID in a keyed name: never in a namespace name.
SEPARATOR = "."

# Kubernetes' DNS-1123 label: what a namespace name must be.
_NAMESPACE = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
# What the API server gives every object as metadata.uid: a lowercase RFC 4122 UUID.
_UID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
_NAMESPACE_RE = re.compile(_NAMESPACE)
_UID_RE = re.compile(_UID)
_LEGACY_RE = re.compile(re.escape(PREFIX) + f"(?P<namespace>{_NAMESPACE})")
_KEYED_RE = re.compile(
    re.escape(PREFIX) + f"(?P<namespace>{_NAMESPACE}){re.escape(SEPARATOR)}(?P<uid>{_UID})"
)

#: What a valid name looks like, for refusals.
EXPECTED = (
    f"expected {PREFIX!r} followed by a namespace name (at most 63 lowercase letters, "
    "digits and '-', starting and ending with a letter or digit), optionally followed by "
    f"{SEPARATOR!r} and the namespace's UID (a lowercase UUID)"
)


@dataclasses.dataclass(frozen=True)
class Parsed:
    """Whose directory a name is: `uid` None for the legacy form (`ns-<namespace>`)."""

    namespace: str
    uid: str | None


def check_uid(uid: str, *, namespace: str) -> str:
    """`uid`, if it is a UID the API server gives (a lowercase UUID); ValueError naming
    the namespace otherwise: it becomes part of a path on every node."""
    if not _UID_RE.fullmatch(uid):
        raise ValueError(
            f"namespace {namespace}: expected metadata.uid to be a lowercase UUID "
            f"(8-4-4-4-12 hex digits), found {uid!r}"
        )
    return uid


def keyed(namespace: str, uid: str) -> str:
    """The directory of the namespace `namespace` whose UID is `uid`: `ns-<namespace>.<uid>`,
    a single path component (ValueError when either is not what the API server gives)."""
    if not _NAMESPACE_RE.fullmatch(namespace):
        raise ValueError(f"expected a namespace name (a DNS-1123 label), found {namespace!r}")
    return f"{PREFIX}{namespace}{SEPARATOR}{check_uid(uid, namespace=namespace)}"


def legacy(namespace: str) -> str:
    """The directory named for the namespace alone (`ns-<namespace>`): pods injected before
    namespace UIDs were used, and offline injection."""
    return f"{PREFIX}{namespace}"


def parse(name: str) -> Parsed | None:
    """Whose directory `name` is (keyed or legacy); None when it is no valid namespace
    directory name (which the reclaim refuses if it starts with `PREFIX`)."""
    match = _KEYED_RE.fullmatch(name)
    if match:
        return Parsed(match["namespace"], match["uid"])
    match = _LEGACY_RE.fullmatch(name)
    if match:
        return Parsed(match["namespace"], None)
    return None
