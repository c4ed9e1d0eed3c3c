"""The env the webhook writes: the contract table's rows, valued for one pod.

The sidecar container gets every row marked `Container.SIDECAR`, the trainer containers
every row marked `Container.TRAINER` (`shardcache.contract.variables`). A row with a
spec field takes that field's value (in trainers: of the pod's first mount, the one
`shardcache.open()` reads by default); the rest the pod's layout decides (its run
directory, the port it was given, the pinned digest, the rank). Rows without a value
(no checkpoint, no pinned digest, no fixed rank) are left out, so the reader's default
applies. Spec fields are written even at their defaults: the pod shows the sidecar's
effective settings, and the output depends on the spec alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from shardcache import contract, errors
from shardcache.contract import mixture_sources, parsers, variables
from shardcache_operator import namespace_dirs, specs

#: Trainer variables a user may set on a container themselves: their value wins.
USER_WINS = frozenset({variables.MOUNT.env, variables.CHECKPOINT_DIR.env})


#: JSON name -> attribute name, per model class: the webhook resolves every spec
#: variable of every pod through this, so it is built once per class, not per call.
_JSON_FIELDS: dict[type[Any], dict[str, str]] = {}


def _json_fields(cls: type[Any]) -> dict[str, str]:
    fields = _JSON_FIELDS.get(cls)
    if fields is None:
        fields = {specs.field_info(f).json: f.name for f in dataclasses.fields(cls)}
        _JSON_FIELDS[cls] = fields
    return fields


def spec_value(spec: object, path: str) -> object:
    """The value at a JSON path below `spec` ("prefetch.depth"); None when an object on
    the way is absent (no `checkpoint`)."""
    value = spec
    for json_name in path.split("."):
        if value is None:
            return None
        if not dataclasses.is_dataclass(value) or isinstance(value, type):
            raise TypeError(f"{path}: {json_name!r} is below a plain value")
        value = getattr(value, _json_fields(type(value))[json_name])
    return value


def checkpoint_uri(spec: specs.DatasetMountSpec, ranked_by_index: bool) -> str | None:
    """Where this pod's sidecar publishes checkpoints (None: no checkpoints).

    Every pod's agent owns its prefix (two agents publishing one step to one prefix is
    refused as a duplicate), so a ranked pod publishes under `<uri>/rank-<rank>`. For an
    Indexed Job the rank is only known in the pod: `$(SHARDCACHE_RANK)` is expanded by
    the kubelet from the variable defined before it.
    """
    if spec.checkpoint is None:
        return None
    base = spec.checkpoint.uri.rstrip("/")
    if ranked_by_index:
        return f"{base}/rank-$({contract.ENV_RANK})"
    if spec.sharding.rank_from == "Fixed" and spec.sharding.rank is not None:
        return f"{base}/rank-{spec.sharding.rank}"
    return spec.checkpoint.uri


def mixture(
    spec: specs.DatasetMountSpec, *, digest: str | None, source_digests: Mapping[str, str]
) -> mixture_sources.Mixture | None:
    """The sources the sidecar of a multi-source mount serves (None: one source).

    The first is `spec.source` under `spec.mixture.name`; each further source carries
    the digest pinned for it (`status.mixture`, else its own `version`), as the first
    carries the mount's.
    """
    if spec.mixture is None:
        return None
    first = mixture_sources.Source(
        name=spec.mixture.name,
        weight=spec.mixture.weight,
        uri=spec.source.uri,
        format=spec.source.format,
        digest=digest,
    )
    further = tuple(
        mixture_sources.Source(
            name=s.name,
            weight=s.weight,
            uri=s.uri,
            format=s.format,
            digest=source_digests.get(s.name) or s.version,
        )
        for s in spec.mixture.sources
    )
    return mixture_sources.Mixture((first, *further), seed=spec.mixture.seed)


def namespace_subdir(namespace: str, uid: str | None) -> str:
    """The namespace's directory below the node path: `ns-<namespace>.<uid>`, keyed by
    its UID so that a namespace created again with the same name gets a directory of its
    own (`namespace_dirs`); `ns-<namespace>` where the UID is unknown (offline injection).
    A single path component either way (ValueError for anything that would not be)."""
    if uid is None:
        return namespace_dirs.legacy(namespace)
    return namespace_dirs.keyed(namespace, uid)


def disk_dir(namespace: str | None) -> str:
    """The sidecar's disk tier: one directory per namespace below the node path, mounted
    alone (`pod_volumes`) at `<default>/ns-<namespace>` in the sidecar (the UID keys the
    node's directory, `namespace_subdir`; the sidecar has no use for it).

    Tenants do not share cache entries: a sidecar of one namespace never reads what a
    sidecar of another wrote (the cost: a dataset two namespaces use is cached twice).
    """
    if not namespace:
        return contract.DEFAULT_DISK_DIR
    return f"{contract.DEFAULT_DISK_DIR}/{namespace_dirs.legacy(namespace)}"


def sidecar_env(
    mount: str,
    spec: specs.DatasetMountSpec,
    *,
    digest: str | None,
    namespace: str | None = None,
    run_dir: str,
    port: int,
    ui_port: int,
    world_size: int | None,
    rank_field: str | None,
    source_digests: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """The sidecar container's env.

    `world_size`: the pod's (annotation, else spec). `rank_field`: the downward API
    field path of the pod's rank (an Indexed Job's completion index), or None.
    `source_digests`: the digests pinned for a mixture's further sources, by name.
    """
    fixed_rank = spec.sharding.rank if spec.sharding.rank_from == "Fixed" else None
    layout: Mapping[str, object] = {
        variables.MOUNT.env: mount,
        variables.RUN_DIR.env: run_dir,
        variables.SOCKET.env: contract.socket_path(run_dir, mount),
        variables.MANIFEST_DIGEST.env: digest,
        variables.HANDED_MANIFESTS_DIR.env: variables.HANDED_MANIFESTS_DIR.default,
        # Always, with or without a secretRef (`pod_volumes`): where no Secret is mounted
        # the sidecar finds no files there and keeps the env's credentials.
        variables.CREDENTIALS_DIR.env: variables.CREDENTIALS_DIR.default,
        variables.MIXTURE.env: mixture(spec, digest=digest, source_digests=source_digests or {}),
        variables.MEMORY_DIR.env: contract.memory_dir(run_dir, mount),
        variables.DISK_DIR.env: disk_dir(namespace),
        variables.WORLD_SIZE.env: world_size,
        variables.RANK.env: fixed_rank,
        variables.METRICS_PORT.env: port,
        variables.UI_PORT.env: ui_port,
        variables.CHECKPOINT_URI.env: checkpoint_uri(spec, rank_field is not None),
    }
    env: list[dict[str, Any]] = []
    for variable in variables.injected_into(variables.Container.SIDECAR):
        if variable is variables.RANK and rank_field is not None:
            env.append({"name": variable.env, "valueFrom": {"fieldRef": {"fieldPath": rank_field}}})
            continue
        if variable.env in layout:
            value = layout[variable.env]
        elif variable.spec_field is not None:
            value = spec_value(spec, variable.spec_field)
        else:
            raise AssertionError(f"{variable.env}: no value for the sidecar")
        if value is not None:
            env.append({"name": variable.env, "value": parsers.render(value)})
    return env


def _set(env: list[dict[str, Any]], name: str, value: str) -> None:
    for entry in env:
        if entry.get("name") == name:
            if name not in USER_WINS:
                entry.clear()
                entry.update(name=name, value=value)
            return
    env.append({"name": name, "value": value})


def set_trainer_env(
    container: dict[str, Any],
    *,
    run_dir: str,
    mounts: Sequence[str],
    checkpoint_dir: str | None,
    first_spec: specs.DatasetMountSpec | None,
) -> None:
    """Write the trainer variables into `container`'s env (values the user set for
    `USER_WINS` stay). `mounts`: every mount of the pod, the default first.

    `first_spec`: the spec of `mounts[0]`, whose reading plan (seed, shuffle, block
    size) becomes `shardcache.open()`'s default in the trainer, the plan its sidecar
    warms up with; None when that mount was injected before (its values are already
    there and stay).
    """
    layout: Mapping[str, object] = {
        variables.RUN_DIR.env: run_dir,
        variables.MOUNTS.env: tuple(mounts),
        variables.MOUNT.env: mounts[0],
        variables.CHECKPOINT_DIR.env: checkpoint_dir,
    }
    given = container.get("env") or []  # `env:` alone is a null
    # The API server would refuse such a pod anyway; refused here with its field named,
    # not answered with a 500 (the fuzz test's examples: `env: 1`, `env: [null]`).
    name = container.get("name")
    if not isinstance(given, list):
        raise errors.InputError(
            f"container {name!r}: env: expected a list, found {type(given).__name__}"
        )
    for index, entry in enumerate(given):
        if not isinstance(entry, Mapping):
            raise errors.InputError(
                f"container {name!r}: env[{index}]: expected a mapping with a name, found "
                f"{type(entry).__name__}"
            )
    env = container["env"] = list(given)
    for variable in variables.injected_into(variables.Container.TRAINER):
        if variable.env in layout:
            value = layout[variable.env]
        elif variable.spec_field is not None:
            if first_spec is None:
                continue
            value = spec_value(first_spec, variable.spec_field)
        else:
            raise AssertionError(f"{variable.env}: no value for the trainer")
        if value is not None:
            _set(env, variable.env, parsers.render(value))
