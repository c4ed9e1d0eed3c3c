"""Whether a pod's run volume has room for the evicted shards its ranks still map.

A rank keeps the batch it last used while it asks for its next shard, a zero-copy
slice that maps its whole shard; once the memory tier evicted that shard its pages
stay in the run volume beyond the tier's limit. So the volume holds the tier plus
about one decoded shard per local rank. The webhook sizes it as spec.cache.memory
plus `specs.RUN_VOLUME_HEADROOM` of it (`specs.run_volume_bytes`); when the local
ranks' shards take more than that headroom, every rank can end up waiting for room
that only the waiting ranks hold, and the sidecar fails their reads
(`shardcache.node.volume_cycles`). The webhook knows, before the pod runs, the local
ranks (`sample_room.local_ranks`) and the pinned manifest's totals, so admission
warns. An estimate: the average shard's source bytes stand for the largest decoded
shard, which is bigger (Parquet decodes to two to four times its bytes), so the
warning says "at least". Pure functions of the pod, the spec and the status.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from shardcache_operator import injection, sample_room, specs


def average_shard_bytes(spec: specs.DatasetMountSpec, status: Mapping[str, Any]) -> int | None:
    """The largest average source bytes per shard among the mount's pinned sources;
    None before every source is pinned."""
    pins = [status]
    if spec.mixture is not None:
        pinned = status.get("mixture")
        by_name = {
            p.get("name"): p
            for p in (pinned if isinstance(pinned, list) else [])
            if isinstance(p, Mapping)
        }
        pins = [by_name.get(source.name, {}) for source in spec.mixture.sources]
    largest = 0
    for pin in pins:
        shards, nbytes = pin.get("shards"), pin.get("bytes")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (shards, nbytes)):
            return None
        assert isinstance(shards, int) and isinstance(nbytes, int)
        if shards > 0:
            largest = max(largest, -(-nbytes // shards))
    return largest


def headroom(memory: int) -> int:
    """The run volume's room beyond the memory tier's limit (`specs.run_volume_bytes`)."""
    return specs.run_volume_bytes(memory) - memory


def memory_needed(ranks: int, shard_bytes: int) -> int:
    """The smallest spec.cache.memory, in whole MiB, whose headroom holds `ranks`
    shards of `shard_bytes` (the headroom is at least that fraction of it)."""
    least = math.ceil(ranks * shard_bytes / specs.RUN_VOLUME_HEADROOM)
    return -(-least // specs.MiB) * specs.MiB


def warning(
    where: str,
    spec: specs.DatasetMountSpec,
    status: Mapping[str, Any],
    pod: Mapping[str, Any],
) -> str | None:
    """What to tell the pod's creator when its local ranks' shards do not fit in the run
    volume's headroom, else None. InputError for a malformed local-ranks annotation."""
    ranks, how = sample_room.local_ranks(pod)
    shard = average_shard_bytes(spec, status)
    if shard is None or shard == 0:
        return None
    memory = spec.cache.memory
    if ranks * shard <= headroom(memory):
        return None
    fmt = specs.format_bytes
    who = f"{ranks} ranks ({how})" if ranks > 1 else "one rank"
    return (
        f"{where}: the pod's run volume ({fmt(specs.run_volume_bytes(memory))}: "
        f"spec.cache.memory {fmt(memory)} plus {fmt(headroom(memory))} of headroom) may not "
        f"hold the shards its ranks keep mapped after the memory tier evicted them: {who} "
        f"each keep one, at least {fmt(shard)} (the average shard's source bytes; decoded "
        f"shards take more), {fmt(ranks * shard)} or more in all. When they do not fit, "
        "every rank waits for room only the waiting ranks hold and the sidecar fails their "
        f"reads. Raise spec.cache.memory to at least {fmt(memory_needed(ranks, shard))}, "
        f"or set the annotation {injection.ANNOTATION_LOCAL_RANKS} to the ranks the pod "
        'really runs (docs/operator.md, "The run volume")'
    )
