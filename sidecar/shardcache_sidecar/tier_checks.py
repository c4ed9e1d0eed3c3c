"""The sidecar's check of its tier directories at start-up, and what to do when it fails.

A sidecar that cannot write its disk tier (a node directory the chart's node-cache
DaemonSet has not prepared yet, or prepared for another user) used to fail every shard
and every metrics scrape, while /readyz said only that it waited for the first shards.
`problems` finds that before anything else and says, per tier, the directory, the user
the sidecar runs as, the directory's owner and mode (`tiers.unusable`), and the fix.

The sidecar then stays up, not ready, with that reason in /readyz, and checks again
every few seconds (`lifecycle.Sidecar`): the usual cause is a node the DaemonSet has
not rolled onto yet, which heals by itself, and a sidecar that exited would wait out
the kubelet's restart backoff (up to five minutes) after it healed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from shardcache import contract
from shardcache.node import tiers


def disk_reason(found: tiers.Unusable, *, retry_s: float) -> str:
    """Why the disk tier is unusable and how a platform engineer fixes it."""
    uid, gid = found.uid, found.gid
    if isinstance(found.error, tiers.LockTimeout):
        # The directory is right; another process holds its lock and does not run.
        return (
            f"the disk tier {found.path} is not usable now: {found.describe()}. Resume or "
            f"end that process (another sidecar of this node); the sidecar checks again "
            f"every {retry_s:g} s and goes on by itself once it gets the lock "
            f'(docs/cache-format.md, "A stopped process holding a lock")'
        )
    if found.lock_owner is not None:
        # The directory is right; a file in it is another user's (`describe` says
        # which and what to do): changing the directory would not help.
        return (
            f"the disk tier {found.path} is not usable: {found.describe()}. The sidecar "
            f"checks again every {retry_s:g} s and goes on by itself once it can open it "
            f'(docs/cache-format.md, "Files of other users")'
        )
    return (
        f"the disk tier {found.path} is not usable: {found.describe()}. The sidecar must be "
        f"able to write it. On Kubernetes it is the namespace's directory of the node "
        f"directory spec.cache.nodePath, which the chart's node-cache DaemonSet makes the "
        f"sidecar's user's with mode 2770 (the chart's nodeCache.uid and nodeCache.gid must "
        f"be {uid} and {gid}, the user the sidecar runs as); until the DaemonSet has run on "
        f"this node the sidecar checks again every {retry_s:g} s and goes on by itself. "
        f"Prepared by hand (nodeCache.prepare false, another policy.nodePaths entry, or a "
        f"sidecar outside Kubernetes): chown {uid}:{gid} DIR && chmod 2770 DIR on the node "
        f'(docs/operator.md, "The node disk tier")'
    )


def memory_reason(found: tiers.Unusable, *, retry_s: float) -> str:
    """Why the memory tier is unusable and what to change."""
    error = found.error
    if isinstance(error, tiers.LockTimeout):
        # The directory is right (writing it elsewhere would not help): a process
        # sharing it holds the tier's lock and does not run.
        who = "; ".join(error.holders) if error.holders else "no holder found in /proc/locks"
        return (
            f"the memory tier {found.path} is not usable now: this sidecar waited "
            f"{error.waited:g} s for the tier's lock {error.path}, held by {who}. Resume or "
            f"end that process (a trainer of this pod, or another process using the "
            f"directory); the sidecar checks again every {retry_s:g} s and goes on by "
            f'itself once it gets the lock (docs/cache-format.md, "A stopped process '
            f'holding a lock")'
        )
    return (
        f"the memory tier {found.path} is not usable: {found.describe()}. The sidecar must be "
        f"able to write it: on Kubernetes it is in the pod's run volume (an emptyDir, which "
        f"any user may write); started by hand, give {contract.ENV_MEMORY_DIR} (--memory-dir) "
        f"or the run directory a directory uid {found.uid} can write. Checked again every "
        f"{retry_s:g} s"
    )


def problems(memory_dir: Path, disk_dir: Path, *, retry_s: float) -> Mapping[str, str]:
    """What keeps the sidecar from using each tier directory, by tier name ("memory",
    "disk"); empty when it can use both. Blocking: a few system calls per directory."""
    found: dict[str, str] = {}
    memory = tiers.unusable(memory_dir)
    if memory is not None:
        found["memory"] = memory_reason(memory, retry_s=retry_s)
    disk = tiers.unusable(disk_dir)
    if disk is not None:
        found["disk"] = disk_reason(disk, retry_s=retry_s)
    return found


def _owner(path: Path) -> tiers.Owner | None:
    """The directory, or the nearest one above it that exists, with owner and mode."""
    for candidate in (path, *path.parents):
        try:
            st = os.stat(candidate)
        except OSError:
            continue
        return tiers.Owner(candidate, st.st_uid, st.st_gid, st.st_mode)
    return None


def creation_failure(path: Path, exc: OSError) -> str:
    """Why `path` could not be made, as the tier check says it of a tier directory: the
    error, the user this process runs as, the owner and mode of what is there."""
    return tiers.Unusable(
        path=path,
        step=f"creating the directory {path}",
        error=exc,
        uid=os.geteuid(),
        gid=os.getegid(),
        groups=tuple(os.getgroups()),
        owner=_owner(path),
    ).describe()
