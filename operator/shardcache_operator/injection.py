"""Pod injection: a pure function from (pod, DatasetMounts) to the injected pod.

The webhook and `shardcache inject` both call `inject`; nothing here talks to the API.
See docs/operator.md for the layout this produces. In short, per mount:

* one cache sidecar, appended to `initContainers` as a native sidecar
  (`restartPolicy: Always`, startupProbe on /readyz), after the user's own init
  containers so those still run first;
* one emptyDir (medium Memory unless `cache.medium: Disk`, sizeLimit = cache.memory + headroom)
  at `contract.mount_dir(run_dir, mount)` in the sidecar and the trainer containers: it
  holds the control socket and the memory tier the trainers mmap;
* one hostPath (DirectoryOrCreate) for the node disk tier, in the sidecar only, which
  mounts its namespace's directory alone (`subPath`);
* one emptyDir for checkpoints when `spec.checkpoint` is set, in both;
* in the namespaces of the operator's `manifest_namespaces` (chart:
  rbac.manifestNamespaces), when a source of the mount is pinned: one projected volume
  of the ConfigMaps the operator hands the pinned manifests in, each optional, read-only
  at `manifest_handoff.MOUNT_PATH` in the sidecar only (`hands_manifests`);
* when `spec.source.secretRef` is set: one secret volume of that Secret, read-only at
  `pod_volumes.CREDENTIALS_PATH` in the sidecar only (`mounts_credentials`), so that a
  key rotated in the Secret reaches the running sidecar (its `envFrom` never changes).

Idempotent: the pod annotation `shardcache.io/injected` lists the mounts already
injected, and those are skipped. Names of containers, volumes and ports never collide
with the pod's own: a taken name gets a numeric suffix. The annotation
`shardcache.io/pins` records what each mount's sidecar was given from its sources, so
that the job's later pods get the same (`job_pins`).

`inject` composes four parts, each a module of pure functions: names and ports
(`pod_names`), volumes (`pod_volumes`), the sidecar container (`sidecar_container`)
and the env of sidecar and trainers from the contract table (`pod_env`). The webhook
passes a `mount_parts.Cache`, so a burst's pods share one build of each mount's
volumes and sidecar (each pod gets its own copy).
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from shardcache import contract, errors
from shardcache_operator import (
    configuration,
    job_pins,
    manifest_handoff,
    mount_parts,
    pod_env,
    pod_names,
    pod_volumes,
    sidecar_container,
    specs,
)

#: Opt-in label. Value: one DatasetMount name, or several joined with "_" (a character
#: DatasetMount names cannot contain), e.g. `shardcache.io/mount: train_eval`.
LABEL_MOUNT = "shardcache.io/mount"
MOUNT_SEPARATOR = "_"
#: More mounts, comma-separated, for lists longer than a label value (63 characters).
ANNOTATION_MOUNTS = "shardcache.io/mounts"
#: Written by the injection: the mounts already injected, comma-separated.
ANNOTATION_INJECTED = "shardcache.io/injected"
#: Restricts which containers get the trainer env and mounts (comma-separated names).
ANNOTATION_CONTAINERS = "shardcache.io/containers"
#: Per-pod override of spec.sharding.worldSize.
ANNOTATION_WORLD_SIZE = "shardcache.io/world-size"
#: Ranks that read through the pod's sidecar; only admission's estimate of what their
#: sample-mode windows need reads it (`sample_room`).
ANNOTATION_LOCAL_RANKS = "shardcache.io/local-ranks"
#: Set by the Job controller on pods of Indexed Jobs.
ANNOTATION_JOB_INDEX = "batch.kubernetes.io/job-completion-index"

_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
#: A decimal number as the Job controller writes one (`re`'s \d would take any Unicode digit).
_ASCII_DECIMAL_RE = re.compile(r"[0-9]+")


@dataclasses.dataclass(frozen=True)
class Mount:
    """One DatasetMount to inject: its name, spec and the digest pinned in its status."""

    name: str
    spec: specs.DatasetMountSpec
    digest: str | None
    #: The namespace of the DatasetMount (and the pod): the sidecar keeps its disk tier
    #: in a directory of its own below the node path, so one tenant's sidecars never
    #: read what another's wrote (docs/security.md). None (offline, no namespace): the
    #: node path itself.
    namespace: str | None = None
    #: The namespace's UID: the node's directory is `ns-<namespace>.<uid>`, so that a
    #: namespace created again with the same name never gets the earlier one's entries
    #: (`namespace_dirs`). None (offline injection, no API to ask): `ns-<namespace>`.
    namespace_uid: str | None = None
    #: Digests pinned for the further sources of a mixture (status.mixture), by name.
    source_digests: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #: Whether these digests are the mount's current pins, whose manifests the operator
    #: hands (`hands_manifests`); False for a pod of a job given its job's older pin
    #: (`admission`), whose sidecar would only find another pin's manifest there.
    current_pins: bool = True


@dataclasses.dataclass(frozen=True)
class SidecarDefaults:
    """Operator-wide choices the DatasetMount spec does not make."""

    #: Image used when spec.sidecar.image is empty.
    image: str
    #: Run directory inside pods; each mount gets a subdirectory (see contract.mount_dir).
    run_dir: str = contract.DEFAULT_RUN_DIR
    #: Non-root UID/GID of the sidecar; the node disk path must be writable by it. The
    #: defaults are the operator's settings' (`configuration.Settings`, defined there once;
    #: the chart sets them from nodeCache.uid).
    run_as_user: int = configuration.Settings.sidecar_uid
    #: Seconds the sidecar may take to become ready (restore + warm-up) before kubelet
    #: restarts it.
    startup_timeout_seconds: int = configuration.Settings.startup_timeout_seconds
    #: First TCP port tried for a sidecar's probes/metrics; later mounts take the next free,
    #: up to `metrics_port_last` (the range the chart's NetworkPolicy opens).
    metrics_port: int = configuration.Settings.metrics_port_first
    metrics_port_last: int = configuration.Settings.metrics_port_last
    #: First TCP port tried for a sidecar's loopback web inspector.
    ui_port: int = contract.DEFAULT_UI_PORT
    #: Namespaces where the operator hands the pinned manifests to the sidecars in
    #: ConfigMaps (`configuration.Settings.manifest_namespaces`), so the webhook mounts
    #: them there. Empty by default: offline injection mounts none.
    manifest_namespaces: tuple[str, ...] = ()


def hands_manifests(mount: Mount, defaults: SidecarDefaults) -> bool:
    """Whether the mount's sidecar is handed its pinned manifests: its namespace is one
    where the operator writes them, and one of its sources is pinned. Not where another
    volume of the sidecar (the run directory, the checkpoints) is, holds or lies inside
    `manifest_handoff.MOUNT_PATH`: the pod would be invalid, or one volume hide the
    other; the sidecar resolves from the source then, as without the handoff."""
    if mount.namespace is None or mount.namespace not in defaults.manifest_namespaces:
        return False
    if not mount.current_pins:
        return False
    taken = [defaults.run_dir]
    if mount.spec.checkpoint is not None:
        taken.append(mount.spec.checkpoint.mount_path)
    if any(specs.paths_overlap(path, manifest_handoff.MOUNT_PATH) for path in taken):
        return False
    return bool(manifest_handoff.pinned_sources(mount.spec, mount.digest, mount.source_digests))


def mounts_credentials(mount: Mount, defaults: SidecarDefaults) -> bool:
    """Whether the mount's sidecar mounts the source's Secret as files: it has a
    `secretRef`. Not where another volume of the sidecar (the run directory, the
    checkpoints) is, holds or lies inside `pod_volumes.CREDENTIALS_PATH` (the spec's
    check of the checkpoint path knows only the sidecar's own directories): the pod
    would be invalid, or one volume hide the other; the sidecar keeps the credentials
    of its env alone then, as before the volume, and a rotated key reaches it only
    with a restart."""
    if mount.spec.source.secret_ref is None:
        return False
    taken = [defaults.run_dir]
    if mount.spec.checkpoint is not None:
        taken.append(mount.spec.checkpoint.mount_path)
    return not any(specs.paths_overlap(path, pod_volumes.CREDENTIALS_PATH) for path in taken)


def requested_mounts(metadata: Mapping[str, Any]) -> list[str]:
    """DatasetMount names a pod asks for, from its label and annotation, in order."""
    labels = metadata.get("labels") or {}
    annotations = metadata.get("annotations") or {}
    raw: list[str] = []
    if labels.get(LABEL_MOUNT):
        raw += str(labels[LABEL_MOUNT]).split(MOUNT_SEPARATOR)
    if annotations.get(ANNOTATION_MOUNTS):
        raw += str(annotations[ANNOTATION_MOUNTS]).split(",")
    result: list[str] = []
    for name in (part.strip() for part in raw):
        if not name:
            continue
        if not _NAME_RE.match(name):
            raise errors.InputError(
                f"{name!r} in {LABEL_MOUNT}/{ANNOTATION_MOUNTS} is not a DatasetMount name: "
                "expected lowercase letters, digits, '-' and '.'"
            )
        if name not in result:
            result.append(name)
    return result


def injected_mounts(pod: Mapping[str, Any]) -> list[str]:
    """Mounts already injected into `pod`: named by its `shardcache.io/injected`
    annotation *and* served by a native sidecar of ours in the pod.

    The annotation alone proves nothing: the pod author can write it, and a labelled
    pod must not skip injection that way (docs/security.md). The sidecar is recognised
    by its restart policy and the mount it serves ($SHARDCACHE_MOUNT in its env).
    """
    metadata = pod.get("metadata") or {}
    annotations = metadata.get("annotations") or {}
    value = str(annotations.get(ANNOTATION_INJECTED) or "")
    spec = pod.get("spec") or {}
    init = spec.get("initContainers") if isinstance(spec, Mapping) else None
    served: set[str] = set()
    for container in init if isinstance(init, list) else []:
        if not isinstance(container, Mapping) or container.get("restartPolicy") != "Always":
            continue
        env = container.get("env")
        for entry in env if isinstance(env, list) else []:
            if isinstance(entry, Mapping) and entry.get("name") == contract.ENV_MOUNT:
                served.add(str(entry.get("value")))
    return [name for name in value.split(",") if name and name in served]


def without_unearned_pins(pod: Mapping[str, Any]) -> dict[str, Any] | None:
    """`pod` (a copy) without the `job_pins.ANNOTATION_PINS` entries of mounts not
    injected into it, or None when it has none: a pod admitted without the cache keeps
    its author's annotations, and the pod watch would serve such a pin to the job's
    later pods (`job_pins`)."""
    metadata = pod.get("metadata")
    annotations = metadata.get("annotations") if isinstance(metadata, Mapping) else None
    if not isinstance(annotations, Mapping) or job_pins.ANNOTATION_PINS not in annotations:
        return None
    done = set(injected_mounts(pod))
    kept = {m: t for m, t in job_pins.annotation_pins(annotations).items() if m in done}
    value = job_pins.annotation_value(kept) if kept else None
    if value == annotations[job_pins.ANNOTATION_PINS]:
        return None
    result: dict[str, Any] = _copied(dict(pod))
    if value is None:
        del result["metadata"]["annotations"][job_pins.ANNOTATION_PINS]
    else:
        result["metadata"]["annotations"][job_pins.ANNOTATION_PINS] = value
    return result


def _copied(value: Any) -> Any:
    """A deep copy of a JSON-like value (dicts, lists, scalars): the admitted pod as
    the API server sends it, copied at about 2.5x the speed of `copy.deepcopy`, which
    anything else falls back to."""
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copied(v) for v in value]
    if value is None or isinstance(value, (str, int, float)):
        return value  # immutable (bool is an int)
    return copy.deepcopy(value)


def _containers(spec: Mapping[str, Any], key: str) -> list[dict[str, Any]]:
    value = spec.get(key) or []
    if not isinstance(value, list):
        raise errors.InputError(f"spec.{key}: expected a list, found {type(value).__name__}")
    for index, item in enumerate(value):
        if not isinstance(item, dict):
            raise errors.InputError(
                f"spec.{key}[{index}]: expected an object, found {type(item).__name__}"
            )
    return value


def _world_size(mount: Mount, annotations: Mapping[str, Any], indexed_job: bool) -> int | None:
    """The pod's world size (the annotation, else the spec's), refused where the pod's
    rank would not be below it: the sidecar would only fail at its start, in a pod the
    user sees as admitted."""
    override = positive_annotation(annotations, ANNOTATION_WORLD_SIZE)
    world_size = mount.spec.sharding.world_size if override is None else override
    if world_size is None:
        return None
    rank, where = _known_rank(mount.spec, annotations, indexed_job)
    if rank is not None and rank >= world_size:
        given = (
            f"annotation {ANNOTATION_WORLD_SIZE} ({override})"
            if override is not None
            else "spec.sharding.worldSize"
        )
        raise errors.InputError(
            f"DatasetMount {mount.name}: the pod's rank is {rank} ({where}), but its world "
            f"size is {world_size} ({given}); expected a rank below the world size"
        )
    return world_size


def _known_rank(
    spec: specs.DatasetMountSpec, annotations: Mapping[str, Any], indexed_job: bool
) -> tuple[int | None, str]:
    """The rank the pod's sidecar will read where admission can know it, and whence."""
    sharding = spec.sharding
    if sharding.rank_from == "Fixed" and sharding.rank is not None:
        return sharding.rank, "spec.sharding.rank"
    if _rank_field(spec, indexed_job) is not None:
        index = annotations.get(ANNOTATION_JOB_INDEX)
        if index is None:
            return None, ""
        # ASCII digits only: str.isdigit() is also true of '²' or '٣', which int()
        # refuses or reads as another number (the webhook answered 500 to '²').
        if not _ASCII_DECIMAL_RE.fullmatch(str(index)):
            raise errors.InputError(
                f"annotation {ANNOTATION_JOB_INDEX}: expected the Job's completion index, "
                f"a non-negative integer in ASCII digits, found {index!r}"
            )
        return int(str(index)), f"annotation {ANNOTATION_JOB_INDEX}"
    return None, ""


def positive_annotation(annotations: Mapping[str, Any], name: str) -> int | None:
    """The positive integer the annotation `name` holds, None without it; InputError
    naming it when it holds anything else."""
    given = annotations.get(name)
    if given is None:
        return None
    try:
        value = int(str(given))
    except ValueError:
        value = 0
    if value < 1:
        raise errors.InputError(f"annotation {name}: expected a positive integer, found {given!r}")
    return value


def _trainer_names(pod_spec: Mapping[str, Any], annotations: Mapping[str, Any]) -> list[str]:
    all_names = [str(c.get("name")) for c in _containers(pod_spec, "containers")]
    chosen = annotations.get(ANNOTATION_CONTAINERS)
    if not chosen:
        return all_names
    wanted = [n.strip() for n in str(chosen).split(",") if n.strip()]
    unknown = [n for n in wanted if n not in all_names]
    if unknown:
        raise errors.InputError(
            f"annotation {ANNOTATION_CONTAINERS} names {', '.join(unknown)}, but the pod's "
            f"containers are {', '.join(all_names) or 'none'}"
        )
    return wanted


def _rank_field(spec: specs.DatasetMountSpec, indexed_job: bool) -> str | None:
    """The downward API field of the pod's rank, for an Indexed Job ranked by index.

    It reads the index the Job controller stamped on the pod, so a Job template
    injected offline gets the same env as a pod admitted online.
    """
    if spec.sharding.rank_from == "JobCompletionIndex" and indexed_job:
        return f"metadata.annotations['{ANNOTATION_JOB_INDEX}']"
    return None


def _parts(mount: Mount, key: mount_parts.Key, defaults: SidecarDefaults) -> mount_parts.Parts:
    """The mount's volumes and sidecar container; a pure function of `mount.spec` and
    `key` (which `mount_parts.Cache` relies on)."""
    names = key.names
    # Whether to hand manifests is in the key (`names.manifest_volume`, decided from
    # `key.namespace` and `key.defaults`), and so are the digests that say which.
    # Whether to mount the Secret is too (`names.credentials_volume`, decided from the
    # spec and `key.defaults.run_dir`); which Secret is the spec's.
    handed = (
        manifest_handoff.pinned_sources(mount.spec, key.digest, dict(key.source_digests))
        if names.manifest_volume is not None
        else []
    )
    volumes = pod_volumes.volumes_for(
        mount.name,
        mount.spec,
        names,
        run_dir=defaults.run_dir,
        namespace=mount.namespace,
        namespace_uid=mount.namespace_uid,
        manifest_sources=handed,
    )
    env = pod_env.sidecar_env(
        mount.name,
        mount.spec,
        digest=mount.digest,
        namespace=mount.namespace,
        run_dir=defaults.run_dir,
        port=names.port,
        ui_port=names.ui_port,
        world_size=key.world_size,
        rank_field=key.rank_field,
        source_digests=dict(key.source_digests),
    )
    sidecar = sidecar_container.build(
        mount.spec,
        names,
        image=defaults.image,
        env=env,
        volume_mounts=volumes.sidecar_mounts,
        run_as_user=defaults.run_as_user,
        startup_timeout_seconds=defaults.startup_timeout_seconds,
    )
    return mount_parts.Parts(volumes=volumes, sidecar=sidecar)


def refuse_unsafe_pod(pod_spec: Mapping[str, Any], mounts: Sequence[Mount]) -> None:
    """Refuse pod settings that defeat the sidecar's isolation (docs/security.md).

    * `shareProcessNamespace` or `hostPID` (unless every mount allows it): the trainer
      could read /proc/<sidecar>/environ, i.e. the credentials only the sidecar is given
      (with `hostPID` so could every other hostPID pod of the node).
    * `hostNetwork`: the sidecar's ports would bind the node's addresses, so its probes
      and its loopback-only inspector would be reachable node-wide, and two such pods on
      one node would collide on the same port.
    """
    names = ", ".join(m.name for m in mounts)
    strict = [m.name for m in mounts if not m.spec.admission.allow_share_process_namespace]
    shared = [f for f in ("shareProcessNamespace", "hostPID") if pod_spec.get(f) is True]
    if shared and strict:
        raise errors.InputError(
            f"pods using DatasetMount {', '.join(strict)} cannot set {' and '.join(shared)}: "
            "the trainer could read the cache sidecar's environment, which holds the "
            "source's credentials; remove it, or set spec.admission."
            "allowShareProcessNamespace: true on the DatasetMount"
        )
    if pod_spec.get("hostNetwork") is True:
        raise errors.InputError(
            f"pods using DatasetMount {names} cannot set hostNetwork: the cache sidecar's "
            "ports would open on the node's network and collide with other pods; run the "
            "pod without hostNetwork"
        )


#: The pod's container lists, in the order a refusal names them.
CONTAINER_KEYS = ("initContainers", "containers", "ephemeralContainers")


def refuse_undeclared_volumes(pod_spec: Mapping[str, Any]) -> None:
    """Refuse a container that mounts a volume the submitted pod does not declare.

    The API server checks the pod *after* the webhooks, so a mount of a volume the
    injection is about to add (`shardcache-<mount>-disk`, a name anyone can predict)
    would pass its check: a trainer would get the node disk tier, every namespace's
    directory in it (with `subPath`, another's alone). Without the injection such a
    pod is invalid anyway, so refusing every undeclared name costs no valid pod.
    """
    declared = {str(v.get("name")) for v in _containers(pod_spec, "volumes")}
    for key in CONTAINER_KEYS:
        for index, container in enumerate(_containers(pod_spec, key)):
            for field in ("volumeMounts", "volumeDevices"):
                where = f"spec.{key}[{index}].{field}"
                used = container.get(field) or []
                if not isinstance(used, list):
                    raise errors.InputError(
                        f"{where}: expected a list, found {type(used).__name__}"
                    )
                for item in used:
                    name = item.get("name") if isinstance(item, Mapping) else None
                    if isinstance(name, str) and name in declared:
                        continue
                    raise errors.InputError(
                        f"{where} of container {container.get('name')!r} names volume "
                        f"{name!r}, which the pod does not declare: expected one of its "
                        f"spec.volumes ({', '.join(sorted(declared)) or 'none'}); the "
                        "volumes the cache injection adds are the sidecar's own"
                    )


def metrics_ports_free(pod: Mapping[str, Any], defaults: SidecarDefaults) -> int:
    """How many more sidecars `pod` can take with a probe/metrics port inside the range
    (`SidecarDefaults.metrics_port` to `metrics_port_last`): the range's ports none of
    its containers, our sidecars already injected among them, declares."""
    pod_spec = pod.get("spec") or {}
    if not isinstance(pod_spec, Mapping):
        raise errors.InputError(f"spec: expected an object, found {type(pod_spec).__name__}")
    taken = pod_names.Taken(
        containers=_containers(pod_spec, "containers"),
        init_containers=_containers(pod_spec, "initContainers"),
        ephemeral=(),
        volumes=(),
    )
    return taken.free(defaults.metrics_port, defaults.metrics_port_last)


def inject(
    pod: Mapping[str, Any],
    mounts: Sequence[Mount],
    *,
    defaults: SidecarDefaults,
    indexed_job: bool | None = None,
    cache: mount_parts.Cache | None = None,
) -> dict[str, Any]:
    """The pod (or pod template) with `mounts` injected; `pod` itself is not changed.

    `indexed_job`: whether the pod belongs to an Indexed Job; None means "look for the
    completion-index annotation", which the Job controller sets on the pods it creates.
    `cache`: where the mounts' built parts are kept between calls (the webhook's); the
    pod returned then shares them with other pods' and must not be changed.
    Raises `InputError` when the pod cannot take the injection (e.g. a container already
    mounts something at a path the injection needs), with a message naming it.
    """
    result: dict[str, Any] = _copied(dict(pod))
    metadata = result.setdefault("metadata", {})
    annotations = dict(metadata.get("annotations") or {})
    pod_spec = result.setdefault("spec", {})
    done = injected_mounts(result)
    todo = [m for m in mounts if m.name not in done]
    if not todo:
        return result
    refuse_unsafe_pod(pod_spec, todo)
    refuse_undeclared_volumes(pod_spec)
    if indexed_job is None:
        indexed_job = ANNOTATION_JOB_INDEX in annotations

    containers = _containers(pod_spec, "containers")
    init_containers = _containers(pod_spec, "initContainers")
    volumes = _containers(pod_spec, "volumes")
    taken = pod_names.Taken(
        containers=containers,
        init_containers=init_containers,
        ephemeral=_containers(pod_spec, "ephemeralContainers"),
        volumes=volumes,
    )
    trainers = [c for c in containers if c.get("name") in _trainer_names(pod_spec, annotations)]

    new_init: list[dict[str, Any]] = []
    all_mounts = [*done, *(m.name for m in todo)]
    checkpoint_dir: str | None = None
    for mount in todo:
        names = taken.allocate(
            mount.name,
            first_port=defaults.metrics_port,
            last_port=defaults.metrics_port_last,
            first_ui_port=defaults.ui_port,
            checkpoints=mount.spec.checkpoint is not None,
            manifests=hands_manifests(mount, defaults),
            credentials=mounts_credentials(mount, defaults),
        )
        key = mount_parts.Key(
            mount=mount.name,
            digest=mount.digest,
            namespace=mount.namespace,
            namespace_uid=mount.namespace_uid,
            names=names,
            defaults=defaults,
            world_size=_world_size(mount, annotations, indexed_job),
            rank_field=_rank_field(mount.spec, indexed_job),
            source_digests=tuple(sorted(mount.source_digests.items())),
        )
        parts = cache.get(mount.spec, key) if cache is not None else None
        if parts is None:
            parts = _parts(mount, key, defaults)
            if cache is not None:
                cache.put(mount.spec, key, parts)
        volumes += parts.volumes.volumes
        for trainer_mount in parts.volumes.trainer_mounts:
            for trainer in trainers:
                pod_volumes.add_mount(trainer, trainer_mount)
        if mount.spec.checkpoint is not None:
            checkpoint_dir = checkpoint_dir or mount.spec.checkpoint.mount_path
        new_init.append(parts.sidecar)

    first = todo[0] if todo[0].name == all_mounts[0] else None
    for trainer in trainers:
        pod_env.set_trainer_env(
            trainer,
            run_dir=defaults.run_dir,
            mounts=all_mounts,
            checkpoint_dir=checkpoint_dir,
            first_spec=None if first is None else first.spec,
        )

    # After the user's init containers: those still run first, in their order, and any
    # native sidecars of theirs (e.g. a network proxy) are up before ours fetch data.
    pod_spec["initContainers"] = [*init_containers, *new_init]
    pod_spec["containers"] = containers
    pod_spec["volumes"] = volumes
    annotations[ANNOTATION_INJECTED] = ",".join(all_mounts)
    # What each mount's sidecar was given, for the pods of the same job admitted later
    # (`job_pins`). Entries of mounts injected before stay; anything else a pod's author
    # wrote there goes: only what the injection wrote may pin a job.
    pins = {
        name: text for name, text in job_pins.annotation_pins(annotations).items() if name in done
    }
    for mount in todo:
        pins[mount.name] = job_pins.pin_of(mount.spec, mount.digest, mount.source_digests).text()
    annotations[job_pins.ANNOTATION_PINS] = job_pins.annotation_value(pins)
    metadata["annotations"] = annotations
    return result


def json_patch(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[dict[str, Any]]:
    """RFC 6902 operations turning `before` into `after` (both from `inject`).

    Only the four fields `inject` may change are compared, each replaced whole: the
    patch stays small and readable in audit logs.
    """
    ops: list[dict[str, Any]] = []
    for parent, key in (
        ("metadata", "annotations"),
        ("spec", "initContainers"),
        ("spec", "containers"),
        ("spec", "volumes"),
    ):
        old = (before.get(parent) or {}).get(key)
        new = (after.get(parent) or {}).get(key)
        if new is None or old == new:
            continue
        op = "add" if old is None else "replace"
        ops.append({"op": op, "path": f"/{parent}/{key}", "value": new})
    return ops
