"""The volumes one mount adds to a pod, and where the sidecar and the trainers mount them.

* the run volume: an emptyDir (medium Memory unless `cache.medium: Disk`, sizeLimit
  `run_volume_bytes(cache.memory)`, the tier plus headroom) at
  `contract.mount_dir(run_dir, mount)` in the sidecar and the trainers: it holds the
  control socket and the memory tier the trainers mmap;
* the disk tier: a hostPath (DirectoryOrCreate) at `cache.nodePath`, in the sidecar only;
* the checkpoint volume when `spec.checkpoint` is set: an emptyDir in both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from shardcache import contract, errors
from shardcache.contract import parsers
from shardcache_operator import pod_names, specs

MiB = 1 << 20
#: The run volume's room over the memory tier's limit, as a fraction of that limit.
#: The tier counts only its files, but a reader keeps the shard it just released
#: mapped until its next acquire returns (zero-copy slices of a batch that spans two
#: shards), so an evicted file's pages stay in the volume a while: about one decoded
#: shard per reader beyond the limit. The webhook knows neither the decoded shard size
#: nor the number of readers, so it gives a quarter of the tier (one shard per reader
#: when the tier holds four or more per reader, as its prefetch depth wants); when that
#: is not enough the tier treats ENOSPC as "no room yet" and evicts or waits.
RUN_VOLUME_HEADROOM = 0.25


def run_volume_bytes(memory_tier_bytes: int) -> int:
    """The run volume's sizeLimit: the memory tier plus `RUN_VOLUME_HEADROOM`, the
    headroom rounded up to whole MiB (so the quantity reads as one, e.g. 16Mi -> 20Mi)."""
    headroom = -(-int(memory_tier_bytes * RUN_VOLUME_HEADROOM) // MiB) * MiB
    return memory_tier_bytes + headroom


@dataclasses.dataclass(frozen=True)
class TrainerMount:
    """A volume the trainer containers mount; `what` names it in a refusal."""

    volume: str
    path: str
    what: str


@dataclasses.dataclass(frozen=True)
class MountVolumes:
    volumes: list[dict[str, Any]]
    sidecar_mounts: list[dict[str, Any]]
    trainer_mounts: list[TrainerMount]


def volumes_for(
    mount: str, spec: specs.DatasetMountSpec, names: pod_names.MountNames, *, run_dir: str
) -> MountVolumes:
    """The volumes of `mount` and their mount points (nothing is added to a pod here)."""
    run_source: dict[str, Any] = {
        "sizeLimit": parsers.quantity(run_volume_bytes(spec.cache.memory))
    }
    if spec.cache.medium == "Memory":
        run_source["medium"] = "Memory"
    mount_dir = str(contract.mount_dir(run_dir, mount))
    volumes: list[dict[str, Any]] = [
        {"name": names.run_volume, "emptyDir": run_source},
        {
            "name": names.disk_volume,
            "hostPath": {"path": spec.cache.node_path, "type": "DirectoryOrCreate"},
        },
    ]
    sidecar_mounts = [
        {"name": names.run_volume, "mountPath": mount_dir},
        {"name": names.disk_volume, "mountPath": contract.DEFAULT_DISK_DIR},
    ]
    trainer_mounts = [TrainerMount(names.run_volume, mount_dir, f"the {mount} cache")]
    if spec.checkpoint is not None and names.checkpoint_volume is not None:
        size = parsers.quantity(spec.checkpoint.size)
        volumes.append({"name": names.checkpoint_volume, "emptyDir": {"sizeLimit": size}})
        path = spec.checkpoint.mount_path
        sidecar_mounts.append({"name": names.checkpoint_volume, "mountPath": path})
        trainer_mounts.append(
            TrainerMount(names.checkpoint_volume, path, f"the {mount} checkpoints")
        )
    return MountVolumes(volumes, sidecar_mounts, trainer_mounts)


def _mount_paths(container: Mapping[str, Any]) -> set[str]:
    return {str(m.get("mountPath", "")).rstrip("/") for m in container.get("volumeMounts") or []}


def add_mount(container: dict[str, Any], mount: TrainerMount) -> None:
    """Mount a volume into a trainer container; `InputError` when the path is taken."""
    if mount.path.rstrip("/") in _mount_paths(container):
        raise errors.InputError(
            f"container {container.get('name')!r} already mounts something at {mount.path}, "
            f"where {mount.what} goes: remove that mount or change the DatasetMount's path"
        )
    container.setdefault("volumeMounts", []).append({"name": mount.volume, "mountPath": mount.path})
