"""Whether the mount's largest shard can be decoded in the sidecar's memory limit.

The sidecar decodes a shard whole, within its memory limit less what the process
itself holds (`shardcache.node.quotas.decode_room`: limit - volume - base, the webhook
adding the memory tier's volume on top of the spec's limit), and refuses a shard whose
decoded size alone is over that room (`kind=cache`, and its readiness reason `warm`;
docs/faults.md). With the default limit (1Gi) that is about 768 MiB. It learns this
when a pod first reads the shard; the operator can say it when it pins the manifest.

The operator knows each shard's stored size, not its decoded size (the sidecar reads
that from the shard's metadata before decoding). A Parquet or Arrow shard decodes to
about its stored size or more (compression and encodings only shrink what is stored),
so a stored size already over the room is refused, whatever the exact decoded size.
JSON Lines text decodes smaller than it is stored: nothing is said for it. A shard
under the room may still be over it once decoded; only the sidecar can tell.
Pure functions of the spec and the pinned manifest's largest shard, which status records
(status.largestShard) so that the condition is judged again when the limit changes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from shardcache.contract import parsers
from shardcache.node import quotas
from shardcache_operator import specs

#: Formats whose decoded size is at least about their stored size.
DECODED_AT_LEAST_STORED = frozenset({"parquet", "arrow"})
#: The Warning Event's reason, and the status condition's type (`status.decode_room_condition`).
REASON = "ShardTooLargeToDecode"
LIMIT_FIELD = "spec.sidecar.resources.limits.memory"


@dataclasses.dataclass(frozen=True)
class Largest:
    """The pinned manifest's largest shard at the source (status.largestShard, and each
    status.mixture entry's: recorded at the pin, so a kept pin can be judged again)."""

    path: str
    bytes: int

    def recorded(self) -> dict[str, Any]:
        """As status stores it."""
        return {"path": self.path, "bytes": self.bytes}


def read_recorded(value: object) -> Largest | None:
    """A stored largestShard, or None when there is none or it is not one (a path string
    and a non-negative integer size): a shard size not read is not judged."""
    if not isinstance(value, Mapping):
        return None
    path, size = value.get("path"), value.get("bytes")
    if not isinstance(path, str) or not isinstance(size, int) or isinstance(size, bool):
        return None
    return Largest(path, size) if size >= 0 else None


def needed_limit(stored: int) -> int:
    """The smallest memory limit, in whole MiB, whose room holds `stored` bytes decoded
    at their stored size: the shard plus the process's base (`quotas.BASE_MEMORY_BYTES`,
    its most)."""
    need = stored + quotas.BASE_MEMORY_BYTES
    return -(-need // specs.MiB) * specs.MiB


@dataclasses.dataclass(frozen=True)
class Room:
    """What the spec's sidecar can decode a shard in."""

    #: spec.sidecar.resources.limits.memory as the spec writes it.
    given: str
    #: The limit less the sidecar process's base, in bytes.
    bytes: int


def room(spec: specs.DatasetMountSpec) -> Room | None:
    """The decode room of the spec's sidecar; None when it has no memory limit."""
    given = spec.sidecar.resources.limits.get("memory")
    if given is None:
        return None
    limit = specs.memory_bytes(given, path=LIMIT_FIELD)
    return Room(str(given), max(0, limit - quotas.BASE_MEMORY_BYTES))


def judged(fmt: str) -> bool:
    """Whether a shard of format `fmt` is judged by its stored size at all."""
    return fmt in DECODED_AT_LEAST_STORED


def over(shard: Largest, space: Room) -> bool:
    return shard.bytes > space.bytes


def refusal_text(fmt: str, shard: Largest, space: Room) -> str:
    """What to tell the mount's owner of `shard` (of format `fmt`), over `space`."""
    return (
        f"shard {shard.path!r} is {specs.format_bytes(shard.bytes)} at the source, "
        f"{specs.format_bytes(shard.bytes - space.bytes)} over the "
        f"{specs.format_bytes(space.bytes)} the sidecar can decode a shard in ({LIMIT_FIELD} "
        f"{space.given} less {parsers.quantity(quotas.BASE_MEMORY_BYTES)} for the sidecar "
        f"process): a {fmt} shard decodes to about its stored size or more, so the sidecar "
        f"refuses it when a pod reads it (a cache error, the sidecar not ready with reason "
        f"warm). Set {LIMIT_FIELD} to at least {parsers.quantity(needed_limit(shard.bytes))} "
        f"(more where the shard is compressed: its decoded size counts, which only the "
        f"sidecar reads, from its metadata), or split the shard"
    )
