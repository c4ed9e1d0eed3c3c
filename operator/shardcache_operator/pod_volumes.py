"""The volumes one mount adds to a pod, and where the sidecar and the trainers mount them.

* the run volume: an emptyDir (medium Memory unless `cache.medium: Disk`, sizeLimit
  `run_volume_bytes(cache.memory)`, the tier plus headroom) at
  `contract.mount_dir(run_dir, mount)` in the sidecar and the trainers: it holds the
  control socket and the memory tier the trainers mmap;
* the disk tier: a hostPath (DirectoryOrCreate) of `cache.nodePath`, in the sidecar only,
  which mounts only its namespace's directory in it (`subPath: ns-<namespace>.<uid>`,
  keyed by the namespace's UID: `namespace_dirs`);
* the checkpoint volume when `spec.checkpoint` is set: an emptyDir in both;
* the handed manifests when the injection chose to hand them (`MountNames.manifest_volume`,
  `injection.hands_manifests`): a projected volume of the operator's ConfigMaps, each
  optional (`manifest_handoff.volume`), read-only in the sidecar only;
* the source's credentials when `spec.source.secretRef` is set and the injection chose to
  mount them (`MountNames.credentials_volume`, `injection.mounts_credentials`): a secret
  volume of that Secret, read-only at `CREDENTIALS_PATH` in the sidecar only. The
  sidecar's env holds the same keys (`envFrom`), but env never changes in a running
  container; the kubelet updates a Secret volume's files when the Secret changes, so a
  rotated key reaches the sidecar without a restart (never mounted with `subPath`,
  whose files the kubelet does not update).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from shardcache import contract, errors
from shardcache.contract import parsers, variables
from shardcache_operator import manifest_handoff, pod_env, pod_names, specs

# Defined with the spec model, whose check of the sidecar's memory request needs them.
RUN_VOLUME_HEADROOM = specs.RUN_VOLUME_HEADROOM
run_volume_bytes = specs.run_volume_bytes

#: Where the sidecar mounts the source's Secret (the contract table's default, which
#: the webhook also writes into its env).
CREDENTIALS_PATH = variables.CREDENTIALS_DIR.required_default


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


def disk_mount(volume: str, namespace: str | None, uid: str | None = None) -> dict[str, Any]:
    """The sidecar's mount of the node disk tier: its namespace's directory alone.

    With the whole node path mounted, anything that ran in the sidecar container (an
    exec into it, a process compromised by hostile data) would reach every namespace's
    entries on the node. The kubelet creates a missing subPath directory as root with
    the mode of the volume's root, so the node path is prepared setgid and group
    writable (2770, group = the sidecar's; the chart's node-cache DaemonSet): the new
    `ns-<namespace>.<uid>` is then the sidecar group's to write. `uid`: the namespace's
    (None: unknown, offline injection: `ns-<namespace>`). No namespace (offline
    injection): the node path itself, as the env says (`pod_env.disk_dir`).
    """
    path = pod_env.disk_dir(namespace)
    if not namespace:
        return {"name": volume, "mountPath": path}
    subdir = pod_env.namespace_subdir(namespace, uid)
    return {"name": volume, "mountPath": path, "subPath": subdir}


def credentials_volume(name: str, secret: str) -> dict[str, Any]:
    """The volume `name` of the Secret `secret`, every key a file.

    Not optional: the sidecar's `envFrom` requires the Secret already. `defaultMode` is
    left at the API's 0644: the files belong to root (group: the pod's fsGroup, if it
    sets one), and the sidecar, a non-root user (`SidecarDefaults.run_as_user`), reads
    them by the read bit for others. Nothing else of the pod mounts the volume (no
    `TrainerMount`), so that bit lets no other container read them.
    """
    return {"name": name, "secret": {"secretName": secret}}


def credentials_mount(name: str) -> dict[str, Any]:
    """The sidecar's mount of the volume `name`: read-only, whole (no `subPath`)."""
    return {"name": name, "mountPath": CREDENTIALS_PATH, "readOnly": True}


def volumes_for(
    mount: str,
    spec: specs.DatasetMountSpec,
    names: pod_names.MountNames,
    *,
    run_dir: str,
    namespace: str | None = None,
    namespace_uid: str | None = None,
    manifest_sources: Sequence[tuple[str, str, str]] = (),
) -> MountVolumes:
    """The volumes of `mount` and their mount points (nothing is added to a pod here).
    `manifest_sources`: the pinned sources whose manifests the volume named
    `names.manifest_volume` hands the sidecar (`manifest_handoff.pinned_sources`);
    without that name, or with none of them usable, no such volume. The source's
    Secret is mounted where `names.credentials_volume` names a volume for it."""
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
            # The operator fills in the platform's default (`mounts.Store`); a spec
            # nothing filled in (offline injection, tests) gets the chart's default.
            "hostPath": {
                "path": spec.cache.node_path or contract.DEFAULT_DISK_DIR,
                "type": "DirectoryOrCreate",
            },
        },
    ]
    sidecar_mounts = [
        {"name": names.run_volume, "mountPath": mount_dir},
        disk_mount(names.disk_volume, namespace, namespace_uid),
    ]
    trainer_mounts = [TrainerMount(names.run_volume, mount_dir, f"the {mount} cache")]
    if spec.checkpoint is not None and names.checkpoint_volume is not None:
        check_checkpoint_path(spec.checkpoint.mount_path, run_dir=run_dir)
        size = parsers.quantity(spec.checkpoint.size)
        volumes.append({"name": names.checkpoint_volume, "emptyDir": {"sizeLimit": size}})
        path = spec.checkpoint.mount_path
        sidecar_mounts.append({"name": names.checkpoint_volume, "mountPath": path})
        trainer_mounts.append(
            TrainerMount(names.checkpoint_volume, path, f"the {mount} checkpoints")
        )
    if names.manifest_volume is not None:
        handed = manifest_handoff.volume(names.manifest_volume, mount, manifest_sources)
        if handed is not None:
            # The sidecar's alone: the trainers never mount it (no TrainerMount).
            volumes.append(handed)
            sidecar_mounts.append(manifest_handoff.volume_mount(names.manifest_volume))
    secret_ref = spec.source.secret_ref
    if names.credentials_volume is not None and secret_ref is not None:
        # The sidecar's alone, as its envFrom is: the trainers never mount it.
        volumes.append(credentials_volume(names.credentials_volume, secret_ref.name))
        sidecar_mounts.append(credentials_mount(names.credentials_volume))
    return MountVolumes(volumes, sidecar_mounts, trainer_mounts)


def check_checkpoint_path(path: str, *, run_dir: str) -> None:
    """`InputError` when the checkpoint path is, holds or lies inside the run directory.

    The spec's own check knows only the default run directory; the operator's may be
    another, and there the trainers mount every mount's run volume too.
    """
    if specs.paths_overlap(path, run_dir):
        raise errors.InputError(
            f"spec.checkpoint.mountPath: {path!r} is, holds or lies inside the sidecars' "
            f"run directory {run_dir} (operator setting RUN_DIR): choose another "
            "directory, such as the default /checkpoints"
        )


def _taken_by(container: Mapping[str, Any], path: str) -> str | None:
    """The volume `container` already mounts at `path`, else None."""
    for mounted in container.get("volumeMounts") or []:
        if str(mounted.get("mountPath", "")).rstrip("/") == path.rstrip("/"):
            return str(mounted.get("name"))
    return None


def add_mount(container: dict[str, Any], mount: TrainerMount) -> None:
    """Mount a volume into a trainer container; `InputError` when the path is taken."""
    volume = _taken_by(container, mount.path)
    if volume is None:
        # `or`: a YAML `volumeMounts:` with nothing under it is a null, not a list.
        mounts = container.get("volumeMounts") or []
        container["volumeMounts"] = [*mounts, {"name": mount.volume, "mountPath": mount.path}]
        return
    name = container.get("name")
    if pod_names.is_checkpoint_volume(volume):
        # Two DatasetMounts of the pod with the default /checkpoints: the user has no
        # mount of their own to remove.
        raise errors.InputError(
            f"container {name!r} already mounts the checkpoints of another DatasetMount at "
            f"{mount.path} (volume {volume!r}), where {mount.what} must go: give each "
            "DatasetMount of the pod its own spec.checkpoint.mountPath"
        )
    raise errors.InputError(
        f"container {name!r} already mounts something at {mount.path} (volume {volume!r}), "
        f"where {mount.what} must go: remove that mount or change the DatasetMount's path"
    )
