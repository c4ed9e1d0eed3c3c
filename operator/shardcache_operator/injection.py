"""Pod injection: a pure function from (pod, DatasetMounts) to the injected pod.

The webhook and `shardcache inject` both call `inject`; nothing here talks to the API.
See docs/operator.md for the layout this produces. In short, per mount:

* one cache sidecar, appended to `initContainers` as a native sidecar
  (`restartPolicy: Always`, startupProbe on /readyz), after the user's own init
  containers so those still run first;
* one emptyDir (medium Memory unless `cache.medium: Disk`, sizeLimit = cache.memory)
  at `contract.mount_dir(run_dir, mount)` in the sidecar and the trainer containers: it
  holds the control socket and the memory tier the trainers mmap;
* one hostPath (DirectoryOrCreate) for the node disk tier, in the sidecar only;
* one emptyDir for checkpoints when `spec.checkpoint` is set, in both.

Idempotent: the pod annotation `shardcache.io/injected` lists the mounts already
injected, and those are skipped. Names of containers, volumes and ports never collide
with the pod's own: a taken name gets a numeric suffix.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

from shardcache import contract, errors
from shardcache_operator import specs

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
#: Set by the Job controller on pods of Indexed Jobs.
ANNOTATION_JOB_INDEX = "batch.kubernetes.io/job-completion-index"

_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
_PORT_NAME_LIMIT = 15


@dataclasses.dataclass(frozen=True)
class Mount:
    """One DatasetMount to inject: its name, spec and the digest pinned in its status."""

    name: str
    spec: specs.DatasetMountSpec
    digest: str | None


@dataclasses.dataclass(frozen=True)
class SidecarDefaults:
    """Operator-wide choices the DatasetMount spec does not make."""

    #: Image used when spec.sidecar.image is empty.
    image: str
    #: Run directory inside pods; each mount gets a subdirectory (see contract.mount_dir).
    run_dir: str = contract.DEFAULT_RUN_DIR
    #: Non-root UID/GID of the sidecar; the node disk path must be writable by it.
    run_as_user: int = 65532
    #: Seconds the sidecar may take to become ready (restore + warm-up) before kubelet
    #: restarts it; generous because a checkpoint restore can be large.
    startup_timeout_seconds: int = 600
    #: First TCP port tried for a sidecar's probes/metrics; later mounts take the next free.
    metrics_port: int = contract.DEFAULT_METRICS_PORT


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


def injected_mounts(metadata: Mapping[str, Any]) -> list[str]:
    annotations = metadata.get("annotations") or {}
    value = str(annotations.get(ANNOTATION_INJECTED) or "")
    return [name for name in value.split(",") if name]


def _dns_label(text: str, *, limit: int = 63) -> str:
    label = re.sub(r"[^a-z0-9-]", "-", text.lower()).strip("-")
    if len(label) <= limit:
        return label
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    return f"{label[: limit - 9].rstrip('-')}-{digest}"


def _unique(base: str, taken: set[str], *, limit: int = 63) -> str:
    """`base`, or `base-2`, `base-3`, ... whichever is free; recorded in `taken`."""
    candidate, n = base[:limit], 1
    while candidate in taken:
        n += 1
        suffix = f"-{n}"
        candidate = base[: limit - len(suffix)] + suffix
    taken.add(candidate)
    return candidate


def _containers(spec: Mapping[str, Any], key: str) -> list[dict[str, Any]]:
    value = spec.get(key) or []
    if not isinstance(value, list):
        raise errors.InputError(f"spec.{key}: expected a list, found {type(value).__name__}")
    return value


def _set_env(env: list[dict[str, Any]], name: str, value: str, *, keep: bool = False) -> None:
    for entry in env:
        if entry.get("name") == name:
            if not keep:
                entry.clear()
                entry.update(name=name, value=value)
            return
    env.append({"name": name, "value": value})


def quantity(size: int) -> str:
    """Bytes as the shortest exact Kubernetes quantity: 4294967296 -> "4Gi"."""
    for unit, factor in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if size and size % factor == 0:
            return f"{size // factor}{unit}"
    return str(size)


def _memory_limit(resources: specs.ResourcesSpec, extra: int) -> dict[str, str]:
    limits = dict(resources.limits)
    if extra and "memory" in limits:
        memory = specs.parse_quantity(limits["memory"], path="spec.sidecar.resources.limits")
        limits["memory"] = quantity(memory + extra)
    return limits


def _sidecar_env(
    mount: Mount,
    *,
    defaults: SidecarDefaults,
    port: int,
    indexed_job: bool,
    world_size: int | None,
) -> list[dict[str, Any]]:
    spec = mount.spec
    run_dir = defaults.run_dir
    values: list[tuple[str, str]] = [
        (contract.ENV_MOUNT, mount.name),
        (contract.ENV_RUN_DIR, run_dir),
        (contract.ENV_SOCKET, str(contract.socket_path(run_dir, mount.name))),
        (contract.ENV_SOURCE_URI, spec.source.uri),
        (contract.ENV_SOURCE_FORMAT, spec.source.format),
    ]
    if mount.digest:
        values.append((contract.ENV_MANIFEST_DIGEST, mount.digest))
    values += [
        (contract.ENV_MEMORY_DIR, str(contract.memory_dir(run_dir, mount.name))),
        (contract.ENV_MEMORY_LIMIT, str(spec.cache.memory)),
        (contract.ENV_DISK_DIR, contract.DEFAULT_DISK_DIR),
        (contract.ENV_DISK_LIMIT, str(spec.cache.disk)),
        (contract.ENV_PREFETCH_DEPTH, str(spec.prefetch.depth)),
        (contract.ENV_FETCH_CONCURRENCY, str(spec.prefetch.concurrency)),
        (contract.ENV_READY_SHARDS, str(spec.prefetch.ready_shards)),
        (contract.ENV_SEED, str(spec.sharding.seed)),
        (contract.ENV_SHUFFLE, "true" if spec.sharding.shuffle else "false"),
    ]
    if spec.sharding.block_size is not None:
        values.append((contract.ENV_BLOCK_SIZE, str(spec.sharding.block_size)))
    if world_size is not None:
        values.append((contract.ENV_WORLD_SIZE, str(world_size)))
    if spec.sharding.rank_from == "Fixed" and spec.sharding.rank is not None:
        values.append((contract.ENV_RANK, str(spec.sharding.rank)))
    values.append((contract.ENV_METRICS_PORT, str(port)))
    if spec.checkpoint is not None:
        values += [
            (contract.ENV_CHECKPOINT_DIR, spec.checkpoint.mount_path),
            (contract.ENV_CHECKPOINT_KEEP_LAST, str(spec.checkpoint.keep_last)),
            (contract.ENV_CHECKPOINT_RESTORE, spec.checkpoint.restore),
            # Written even at their defaults, like every other spec field: the pod shows
            # the agent's effective settings, and the output depends on the spec alone.
            (
                contract.ENV_CHECKPOINT_RESTORE_FALLBACK,
                "true" if spec.checkpoint.restore_fallback else "false",
            ),
            (contract.ENV_CHECKPOINT_CONCURRENCY, str(spec.checkpoint.concurrency)),
            (
                contract.ENV_CHECKPOINT_VERIFY_UPLOADS,
                "true" if spec.checkpoint.verify_uploads else "false",
            ),
            (contract.ENV_CHECKPOINT_UPLOAD_BUFFER, str(spec.checkpoint.upload_buffer)),
        ]
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in values]
    ranked_by_index = spec.sharding.rank_from == "JobCompletionIndex" and indexed_job
    if ranked_by_index:
        # The downward API reads the index the Job controller stamped on the pod, so a
        # Job template injected offline gets the same env as a pod admitted online.
        env.append(
            {
                "name": contract.ENV_RANK,
                "valueFrom": {
                    "fieldRef": {"fieldPath": f"metadata.annotations['{ANNOTATION_JOB_INDEX}']"}
                },
            }
        )
    if spec.checkpoint is not None:
        env.append(
            {"name": contract.ENV_CHECKPOINT_URI, "value": checkpoint_uri(spec, ranked_by_index)}
        )
    return env


def checkpoint_uri(spec: specs.DatasetMountSpec, ranked_by_index: bool) -> str:
    """Where this pod's sidecar publishes checkpoints.

    Every pod's agent owns its prefix (two agents publishing one step to one prefix is
    refused as a duplicate), so a ranked pod publishes under `<uri>/rank-<rank>`. For an
    Indexed Job the rank is only known in the pod: `$(SHARDCACHE_RANK)` is expanded by
    the kubelet from the variable defined just before it.
    """
    assert spec.checkpoint is not None
    base = spec.checkpoint.uri.rstrip("/")
    if ranked_by_index:
        return f"{base}/rank-$({contract.ENV_RANK})"
    if spec.sharding.rank_from == "Fixed" and spec.sharding.rank is not None:
        return f"{base}/rank-{spec.sharding.rank}"
    return spec.checkpoint.uri


def _probe(path: str, port: int, *, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "timeoutSeconds": 2,
        "failureThreshold": failures,
    }


def _world_size(mount: Mount, annotations: Mapping[str, Any]) -> int | None:
    override = annotations.get(ANNOTATION_WORLD_SIZE)
    if override is None:
        return mount.spec.sharding.world_size
    try:
        value = int(str(override))
    except ValueError:
        value = 0
    if value < 1:
        raise errors.InputError(
            f"annotation {ANNOTATION_WORLD_SIZE}: expected a positive integer, found {override!r}"
        )
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


def _mount_paths(container: Mapping[str, Any]) -> set[str]:
    return {str(m.get("mountPath", "")).rstrip("/") for m in container.get("volumeMounts") or []}


def _add_mount(container: dict[str, Any], volume: str, path: str, *, what: str) -> None:
    if path.rstrip("/") in _mount_paths(container):
        raise errors.InputError(
            f"container {container.get('name')!r} already mounts something at {path}, "
            f"where {what} goes: remove that mount or change the DatasetMount's path"
        )
    container.setdefault("volumeMounts", []).append({"name": volume, "mountPath": path})


def inject(
    pod: Mapping[str, Any],
    mounts: Sequence[Mount],
    *,
    defaults: SidecarDefaults,
    indexed_job: bool | None = None,
) -> dict[str, Any]:
    """The pod (or pod template) with `mounts` injected; `pod` itself is not changed.

    `indexed_job`: whether the pod belongs to an Indexed Job; None means "look for the
    completion-index annotation", which the Job controller sets on the pods it creates.
    Raises `InputError` when the pod cannot take the injection (e.g. a container already
    mounts something at a path the injection needs), with a message naming it.
    """
    result = copy.deepcopy(dict(pod))
    metadata = result.setdefault("metadata", {})
    annotations = dict(metadata.get("annotations") or {})
    pod_spec = result.setdefault("spec", {})
    done = injected_mounts(metadata)
    todo = [m for m in mounts if m.name not in done]
    if not todo:
        return result
    if indexed_job is None:
        indexed_job = ANNOTATION_JOB_INDEX in annotations

    containers = _containers(pod_spec, "containers")
    init_containers = _containers(pod_spec, "initContainers")
    ephemeral = _containers(pod_spec, "ephemeralContainers")
    volumes = _containers(pod_spec, "volumes")
    taken_containers = {str(c.get("name")) for c in [*containers, *init_containers, *ephemeral]}
    taken_volumes = {str(v.get("name")) for v in volumes}
    every = [*containers, *init_containers]
    taken_ports = {
        int(p["containerPort"])
        for c in every
        for p in c.get("ports") or []
        if isinstance(p.get("containerPort"), int)
    }
    taken_port_names = {str(p.get("name")) for c in every for p in c.get("ports") or []}
    trainers = [c for c in containers if c.get("name") in _trainer_names(pod_spec, annotations)]

    new_init: list[dict[str, Any]] = []
    all_mounts = [*done, *(m.name for m in todo)]
    checkpoint_dir: str | None = None
    for mount in todo:
        spec = mount.spec
        base = _dns_label(f"shardcache-{mount.name}", limit=56)
        sidecar_name = _unique(base, taken_containers)
        run_volume = _unique(f"{base}-run", taken_volumes)
        disk_volume = _unique(f"{base}-disk", taken_volumes)
        port = defaults.metrics_port
        while port in taken_ports:
            port += 1
        taken_ports.add(port)
        port_name = _unique("shardcache", taken_port_names, limit=_PORT_NAME_LIMIT)

        run_source: dict[str, Any] = {"sizeLimit": quantity(spec.cache.memory)}
        if spec.cache.medium == "Memory":
            run_source["medium"] = "Memory"
        volumes.append({"name": run_volume, "emptyDir": run_source})
        volumes.append(
            {
                "name": disk_volume,
                "hostPath": {"path": spec.cache.node_path, "type": "DirectoryOrCreate"},
            }
        )
        mount_dir = str(contract.mount_dir(defaults.run_dir, mount.name))
        sidecar_mounts = [
            {"name": run_volume, "mountPath": mount_dir},
            {"name": disk_volume, "mountPath": contract.DEFAULT_DISK_DIR},
        ]
        for trainer in trainers:
            _add_mount(trainer, run_volume, mount_dir, what=f"the {mount.name} cache")
        if spec.checkpoint is not None:
            ckpt_volume = _unique(f"{base}-ckpt", taken_volumes)
            volumes.append(
                {"name": ckpt_volume, "emptyDir": {"sizeLimit": quantity(spec.checkpoint.size)}}
            )
            path = spec.checkpoint.mount_path
            sidecar_mounts.append({"name": ckpt_volume, "mountPath": path})
            for trainer in trainers:
                _add_mount(trainer, ckpt_volume, path, what=f"the {mount.name} checkpoints")
            checkpoint_dir = checkpoint_dir or path

        extra_memory = spec.cache.memory if spec.cache.medium == "Memory" else 0
        sidecar: dict[str, Any] = {
            "name": sidecar_name,
            "image": spec.sidecar.image or defaults.image,
            "imagePullPolicy": spec.sidecar.image_pull_policy,
            "command": ["shardcache", "sidecar"],
            # A native sidecar: starts before the trainers, runs beside them, stops after.
            "restartPolicy": "Always",
            "env": _sidecar_env(
                mount,
                defaults=defaults,
                port=port,
                indexed_job=indexed_job,
                world_size=_world_size(mount, annotations),
            ),
            "ports": [{"name": port_name, "containerPort": port, "protocol": "TCP"}],
            "startupProbe": _probe(
                "/readyz", port, period=1, failures=max(1, defaults.startup_timeout_seconds)
            ),
            "readinessProbe": _probe("/readyz", port, period=5, failures=3),
            "livenessProbe": _probe("/healthz", port, period=10, failures=6),
            "resources": {
                "requests": dict(spec.sidecar.resources.requests),
                "limits": _memory_limit(spec.sidecar.resources, extra_memory),
            },
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": defaults.run_as_user,
                "runAsGroup": defaults.run_as_user,
                "readOnlyRootFilesystem": True,
                "allowPrivilegeEscalation": False,
                "capabilities": {"drop": ["ALL"]},
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "volumeMounts": sidecar_mounts,
            "terminationMessagePolicy": "FallbackToLogsOnError",
        }
        if spec.source.secret_ref is not None:
            # Credentials reach the sidecar only; trainer containers never see them.
            sidecar["envFrom"] = [{"secretRef": {"name": spec.source.secret_ref.name}}]
        new_init.append(sidecar)

    for trainer in trainers:
        env = trainer.setdefault("env", [])
        _set_env(env, contract.ENV_RUN_DIR, defaults.run_dir)
        _set_env(env, contract.ENV_MOUNTS, ",".join(all_mounts))
        # A user-chosen default mount wins over ours.
        _set_env(env, contract.ENV_MOUNT, all_mounts[0], keep=True)
        if checkpoint_dir is not None:
            _set_env(env, contract.ENV_CHECKPOINT_DIR, checkpoint_dir, keep=True)

    # After the user's init containers: those still run first, in their order, and any
    # native sidecars of theirs (e.g. a network proxy) are up before ours fetch data.
    pod_spec["initContainers"] = [*init_containers, *new_init]
    pod_spec["containers"] = containers
    pod_spec["volumes"] = volumes
    annotations[ANNOTATION_INJECTED] = ",".join(all_mounts)
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
