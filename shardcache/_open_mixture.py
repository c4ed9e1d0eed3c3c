"""`shardcache.open_mixture()`: the mixture a multi-source DatasetMount serves to a pod.

The pod's sidecar serves every source of the mount (`spec.source` and each of
`spec.mixture.sources`) and writes them, with their weights and the mixture's seed, to
`<run dir>/<mount>/mixture.json` (`contract.mixture_sources`). This opens one
`Dataset` per source through its own socket and mixes them (`shardcache.mixtures`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from shardcache import (
    _open_options,
    _plan_defaults,
    checkpoint,
    contract,
    datasets,
    errors,
    mixtures,
    plans,
    ranks,
)
from shardcache.contract import mixture_sources, variables
from shardcache.node import nested_json


def _read_capped(path: os.PathLike[str]) -> bytes:
    """The descriptor's bytes; an InputError when it is larger than any descriptor a
    sidecar writes (read no further than the cap, whatever the file holds)."""
    cap = mixture_sources.MAX_DESCRIPTOR_BYTES
    with open(path, "rb") as f:
        raw = f.read(cap + 1)
        if len(raw) > cap:
            size = os.fstat(f.fileno()).st_size
            raise errors.InputError(
                f"open_mixture(): {os.fspath(path)}: expected a mixture descriptor of at "
                f"most {cap} bytes (the sidecar writes a few KiB), found {max(size, len(raw))} "
                "bytes"
            )
    return raw


def descriptor(
    mount: str | None = None, *, environ: Mapping[str, str] | None = None
) -> tuple[mixture_sources.Mixture, str]:
    """The mixture the pod's sidecar serves for `mount` (default $SHARDCACHE_MOUNT), and
    the mount's directory."""
    env = os.environ if environ is None else environ
    name = mount or variables.MOUNT.get(env)
    if name is None:
        raise errors.InputError(
            "open_mixture(): expected a mount name or $SHARDCACHE_MOUNT (set by the "
            "shardcache webhook in a pod labelled shardcache.io/mount), found neither"
        )
    run_dir = variables.RUN_DIR.get(env) or contract.DEFAULT_RUN_DIR
    mount_dir = contract.mount_dir(run_dir, name)
    path = mount_dir / mixture_sources.DESCRIPTOR_NAME
    try:
        raw = _read_capped(path)
    except FileNotFoundError:
        raise errors.InputError(
            f"open_mixture(): mount {name!r} serves one source (its sidecar wrote no "
            f"{path}): use shardcache.open(), or give the DatasetMount spec.mixture"
        ) from None
    # Told before parsing: `json.loads` of a file nested a few thousand deep raised
    # RecursionError, which no caller expects from bad input.
    found = nested_json.depth(raw)
    if found > mixture_sources.MAX_DEPTH:
        raise errors.InputError(
            f"open_mixture(): {path}: expected a mixture descriptor nested at most "
            f"{mixture_sources.MAX_DEPTH} deep, found one nested {found} deep"
        )
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise errors.InputError(f"open_mixture(): {path} is not JSON: {exc}") from exc
    return mixture_sources.Mixture.from_json(data), str(mount_dir)


def open_mixture(
    mount: str | None = None,
    *,
    weights: mixtures.Weights | None = None,
    mix_seed: int | None = None,
    shuffle: bool | str | None = None,
    seed: int | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    epoch: int = 0,
    block_size: int | None = None,
    window: int | None = None,
    resume_from: str | int | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> mixtures.Mixture:
    """Open every source of the pod's multi-source mount and mix them.

    `weights` (a mapping or a schedule, `shardcache.mix`) replaces the mount's weights,
    `mix_seed` its seed (`spec.mixture.seed`). `shuffle`, `seed`, `rank`, `world_size`,
    `epoch`, `block_size` and `window` are every source's plan parameters, as for
    `shardcache.open()`: left out, `shuffle`, `seed`, `block_size` and `window` are the
    mount's `spec.sharding` (the plan every source's sidecar warmed up with), and
    `rank` and `world_size` an initialised torch.distributed process group's, else
    $RANK and $WORLD_SIZE (`shardcache.ranks.given_or_env`).
    `resume_from` continues from a checkpoint committed with
    `data_state=mixture.state_dict()`.
    """
    from shardcache import sidecar_client

    given = {
        "mount": mount,
        "shuffle": shuffle,
        "seed": seed,
        "rank": rank,
        "world_size": world_size,
        "epoch": epoch,
        "block_size": block_size,
        "window": window,
        "resume_from": resume_from,
    }
    # The options shared with open() are checked as open() checks them.
    for name, value in given.items():
        try:
            _open_options.check_value(name, value)
        except errors.InputError as exc:
            raise errors.InputError(
                str(exc).replace("shardcache.open():", "shardcache.open_mixture():", 1)
            ) from None
    if mix_seed is not None and (isinstance(mix_seed, bool) or not isinstance(mix_seed, int)):
        raise errors.InputError(f"open_mixture(): mix_seed: expected an int, found {mix_seed!r}")
    env = os.environ if environ is None else environ
    found = ranks.given_or_env(rank, world_size, env)
    mixture, mount_dir = descriptor(mount, environ=environ)
    state = checkpoint.data_state(resume_from) if resume_from is not None else None
    plan = _plan_defaults.resolve(
        _plan_defaults.from_env(env, mount=mount),
        shuffle=shuffle,
        seed=seed,
        block_size=block_size,
        window=window,
    )
    on, granularity = plan.mode()
    params = plans.PlanParams(
        seed=plan.seed,
        epoch=epoch,
        rank=found.rank,
        world_size=found.world_size,
        shuffle=on,
        block_size=plan.block_size,
        granularity=granularity,
        window=plan.window,
    )
    opened: dict[str, datasets.Dataset] = {}
    try:
        for source in mixture.sources:
            provider = sidecar_client.SidecarProvider.from_env(
                socket_path=mixture_sources.socket_of(mount_dir, mixture, source.name),
                memory_dir=mixture_sources.memory_of(mount_dir, mixture, source.name),
                environ=environ,
            )
            if source.digest is not None and provider.manifest.digest != source.digest:
                provider.close()
                raise errors.ManifestMismatchError(
                    f"source {source.name!r}: the sidecar serves {provider.manifest.digest}, "
                    f"the mount pinned {source.digest}"
                )
            opened[source.name] = datasets.Dataset(provider, params)
        mixed = mixtures.mix(
            opened,
            weights=weights if weights is not None else mixture.weights,
            seed=mixture.seed if mix_seed is None else mix_seed,
        )
        if isinstance(state, list):
            # Rank prefixes gathered for an elastic resume: a mixture's state is one
            # dict (its sources' states inside), and mixtures resume at one world size.
            raise errors.StateMismatchError(
                f"open_mixture(): resume_from={resume_from!r} gave the data states of "
                f"{len(state)} ranks (an elastic resume), expected one mixture state: "
                "a mixture resumes at the world size it was saved at"
            )
        if state is not None:
            mixed.load_state_dict(state)
    except BaseException:
        for ds in opened.values():
            ds.close()
        raise
    return mixed
