"""What a DatasetMount author may ask of the node: the platform's allow-lists and caps.

A DatasetMount is written by a namespace user, but what it asks for lands on shared
nodes: `cache.nodePath` becomes a read-write hostPath, `sidecar.image` receives the
mount's Secret, `cache.memory` and `cache.disk` take node memory and disk. The platform
engineer sets the limits in the chart's values (`policy.*`), which reach the operator
as settings (`configuration.Settings`); the webhook refuses a pod whose DatasetMount
asks for more, with a message naming the field, the value and what is allowed
(docs/security.md), and the operator marks such a DatasetMount `Invalid` with the
reason `NotAllowed` (the same message). Pure functions: unit-tested without a cluster.
"""

from __future__ import annotations

import dataclasses
import posixpath

from shardcache import contract
from shardcache_operator import specs

GiB = 1 << 30
#: The Ready condition's reason of a DatasetMount the policy does not allow.
REASON = "NotAllowed"


@dataclasses.dataclass(frozen=True)
class Policy:
    """The platform's limits on DatasetMounts (defaults: the chart's defaults)."""

    #: hostPath directories `cache.nodePath` may name, exactly (no parents, no children):
    #: the one the chart's node-cache DaemonSet prepares.
    node_paths: tuple[str, ...] = (contract.DEFAULT_DISK_DIR,)
    #: `cache.nodePath` of a mount that names none (chart value nodeCache.path, the
    #: directory the node-cache DaemonSet prepares). Checked like a named one: the
    #: chart's default allow-list is this path alone.
    default_node_path: str = contract.DEFAULT_DISK_DIR
    #: Images `sidecar.image` may name besides the operator's default image, which
    #: is always allowed. Empty: only the default.
    sidecar_images: tuple[str, ...] = ()
    #: Cap on `cache.memory`, bytes: memory-backed volume per pod. 64 GiB is a large
    #: training node's share for one job's decoded shards.
    max_cache_memory: int = 64 * GiB
    #: Cap on `cache.disk`, bytes: the node disk tier. 1 TiB fits common local NVMe.
    max_cache_disk: int = 1024 * GiB


def violations(spec: specs.DatasetMountSpec, policy: Policy, *, default_image: str) -> list[str]:
    """Why `spec` asks for more than `policy` allows; empty when it does not."""
    found: list[str] = []
    path = spec.cache.node_path or policy.default_node_path
    if posixpath.normpath(path) != path or path not in policy.node_paths:
        asked = (
            f"spec.cache.nodePath {path!r}"
            if spec.cache.node_path is not None
            else f"spec.cache.nodePath (unset: the platform's default {path!r}, chart value "
            "nodeCache.path)"
        )
        found.append(
            f"{asked} is not allowed: the platform allows "
            f"{', '.join(repr(p) for p in policy.node_paths) or 'none'} "
            "(chart value policy.nodePaths)"
        )
    image = spec.sidecar.image
    if image is not None and image != default_image and image not in policy.sidecar_images:
        allowed = [default_image, *policy.sidecar_images]
        found.append(
            f"spec.sidecar.image {image!r} is not allowed: the sidecar receives the mount's "
            f"credentials, so only {', '.join(repr(i) for i in allowed)} may run it "
            "(chart value policy.sidecarImages); omit the field to use the default"
        )
    for field, size, cap, value in (
        ("cache.memory", spec.cache.memory, policy.max_cache_memory, "policy.maxCacheMemory"),
        ("cache.disk", spec.cache.disk, policy.max_cache_disk, "policy.maxCacheDisk"),
    ):
        if size > cap:
            found.append(
                f"spec.{field} {specs.format_bytes(size)} is over the platform's cap of "
                f"{specs.format_bytes(cap)} (chart value {value})"
            )
    return found


#: The chart's defaults, for callers (tests, offline tools) that set no policy.
DEFAULT = Policy()
