"""`shardcache.open()`: embedded mode with a URI, sidecar mode without one."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shardcache import (
    _open_options,
    _plan_defaults,
    checkpoint,
    contract,
    datasets,
    embedded,
    errors,
    manifests,
    plans,
    ranks,
    source,
)
from shardcache.node import caches, tiers

GiB = 1 << 30

log = logging.getLogger(__name__)


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "shardcache"


def _default_memory_limit(memory_dir: Path) -> int:
    # A quarter of the memory-backed filesystem, at most 8 GiB: the decoded shards
    # share it with everything else the machine keeps in /dev/shm.
    try:
        total = shutil.disk_usage(memory_dir).total
    except OSError:
        return 2 * GiB
    return max(256 << 20, min(8 * GiB, total // 4))


def _default_disk_limit(disk_dir: Path) -> int:
    try:
        free = shutil.disk_usage(disk_dir).free
    except OSError:
        return 10 * GiB
    return max(1 * GiB, min(100 * GiB, free // 2))


def _disk_limit_within_volume(limit: int, disk_dir: Path) -> int:
    """A disk limit given at most its volume's size, as the sidecar's
    (`tiers.limit_within`): a larger one is only found out by a full disk. Said at
    WARNING: it was asked for (the default is sized from the free space)."""
    found = tiers.volume_under(disk_dir)
    within = tiers.limit_within(limit, found)
    if within != limit and found is not None:
        log.log(
            tiers.clamp_level(explicit=True),
            "disk_limit %d bytes exceeds the volume of %s, %d bytes (%d free): using %d "
            "bytes; give open() a disk_limit the volume can hold",
            limit,
            disk_dir,
            found.total,
            found.free,
            within,
        )
    return within


def open(
    source_uri: str | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    shuffle: bool | str | None = None,
    seed: int | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    epoch: int = 0,
    block_size: int | None = None,
    window: int | None = None,
    format: str | None = None,
    digest: str | None = None,
    memory_dir: str | os.PathLike[str] | None = None,
    memory_limit: int | None = None,
    disk_limit: int | None = None,
    prefetch_depth: int | None = None,
    fetch_concurrency: int | None = None,
    storage_options: Mapping[str, str] | None = None,
    retry: source.RetryPolicy | None = None,
    mount: str | None = None,
    resume_from: str | int | os.PathLike[str] | None = None,
    gather_threads: int | None = None,
    **options: Any,
) -> datasets.Dataset:
    """Open a dataset for one rank.

    With a URI (`file://…`, `s3://…`, anything pyarrow's filesystems open), the cache
    runs in this process under `cache_dir` (default `$XDG_CACHE_HOME/shardcache`); it
    is sized by `memory_limit` and `disk_limit` (bytes; default from the free space),
    reads ahead `prefetch_depth` shards with `fetch_concurrency` fetches at a time
    (`shardcache.node.caches.NodeSettings` says why its defaults, 4 and 4), and reads
    the store with `storage_options` and `retry`. Those options configure a cache in
    this process, so they are refused without a URI.

    Without a URI, the sidecar injected into the pod serves the dataset named by `mount`
    (default: $SHARDCACHE_MOUNT); its DatasetMount configures the cache, and `mount` is
    refused with a URI.

    `shuffle` is "block" (shards and blocks of `block_size` rows are permuted; batches
    are zero-copy slices), "sample" (rows are also permuted within windows of `window`
    rows spanning shards; each batch is gathered with one copy, and numpy is needed),
    False (manifest order) or True, the default mode: "block", or in a pod the
    DatasetMount's `spec.sharding.granularity` (docs/reading-plan.md).
    `shuffle`, `seed`, `block_size` and `window` left out (None) take, without a URI,
    the DatasetMount's `spec.sharding` values (shuffle and granularity, seed, blockSize,
    window), which the webhook writes into the trainer containers, so the trainer reads
    in the order the sidecar warmed its cache for; with a URI, or for a mount other than
    the pod's first, True ("block"), 0, `plans.DEFAULT_BLOCK_SIZE` and
    `plans.DEFAULT_WINDOW` (`shardcache._plan_defaults`). Given, they win.

    `rank` and `world_size` left out (None) are those of torch.distributed's default
    process group where the trainer imported torch and initialised one (it wins over
    the environment), else $RANK and $WORLD_SIZE, as torchrun sets them in every
    process (0 and 1 where unset): the default the torch and numpy adapters have too
    (`shardcache.ranks.given_or_env`). Given, they win. torch is never imported for it.

    `gather_threads` (sample mode): threads that gather the next batches while the
    caller works on the current one; 0 or 1 gathers each batch in the caller's thread.
    Left out, one per CPU the container's quota allows but one, at least 2 and at most
    4 (inline with one CPU). Gathering ahead copies consecutive batches in chunks of about
    16 MiB. It changes no batch, order or position (docs/reading-plan.md, "Gathering
    ahead").

    `digest` pins the manifest: a dataset that differs is an error.
    `resume_from` ("latest", a step, or a checkpoint directory) continues the data
    stream where a checkpoint committed with `data_state=` left it (see
    `shardcache.checkpoint`); "latest" with no checkpoint yet starts from the beginning.

    Raises `InputError` for an unknown option, an option of the wrong type or value, or
    an option the chosen mode does not use.
    """
    # Every named parameter, before any other local exists.
    given = {name: value for name, value in locals().items() if name != "options"}
    if options:
        raise errors.InputError(f"unknown option(s) {sorted(options)} for shardcache.open()")
    _open_options.check(given)
    found = ranks.given_or_env(rank, world_size)
    # Read the saved state first: a bad `resume_from` fails before any cache starts.
    state = (
        checkpoint.data_state(resume_from, world_size=found.world_size)
        if resume_from is not None
        else None
    )
    defaults = (
        _plan_defaults.from_env(os.environ, mount=mount)
        if source_uri is None
        else _plan_defaults.LIBRARY
    )
    plan = _plan_defaults.resolve(
        defaults, shuffle=shuffle, seed=seed, block_size=block_size, window=window
    )
    shuffled, granularity = plan.mode()
    params = plans.PlanParams(
        seed=plan.seed,
        epoch=epoch,
        rank=found.rank,
        world_size=found.world_size,
        shuffle=shuffled,
        block_size=plan.block_size,
        granularity=granularity,
        window=plan.window,
    )
    if params.sampled and importlib.util.find_spec("numpy") is None:
        # Found now, not at the first batch: the gather is numpy's (`shardcache.gather`).
        raise errors.InputError(
            "shuffle='sample' needs numpy, which is not installed: expected "
            "`pip install 'shardcache[sample]'` (or shuffle='block', which needs pyarrow only)"
        )
    if source_uri is None:
        from shardcache import sidecar_client

        shards = sidecar_client.SidecarProvider.from_env(mount=mount)
        if digest is not None and shards.manifest.digest != digest:
            raise errors.ManifestMismatchError(
                f"the sidecar serves {shards.manifest.digest}, expected {digest}"
            )
        return _resumed(datasets.Dataset(shards, params, gather_threads=gather_threads), state)

    source.check_storage_options(storage_options)
    manifest = manifests.resolve(
        source_uri, format=format, storage_options=storage_options, retry=retry
    )
    if digest is not None and manifest.digest != digest:
        raise errors.ManifestMismatchError(
            f"{source_uri} now resolves to {manifest.digest}, but {digest} was pinned: "
            "the dataset changed"
        )
    root = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    disk_dir = root / contract.DISK_SUBDIR
    mem_dir = Path(memory_dir) if memory_dir is not None else root / contract.MEMORY_SUBDIR
    mem_name = "memory_dir" if memory_dir is not None else "cache_dir"
    for name, made in (("cache_dir", disk_dir), (mem_name, mem_dir)):
        try:
            made.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError, PermissionError) as exc:
            raise errors.InputError(
                f"{name}: expected a directory this process can create and write, found "
                f"{made} not creatable ({type(exc).__name__}: {exc.strerror}); a path on "
                "the way is a file, or is not writable"
            ) from exc
    sized = caches.NodeSettings(
        disk_dir=disk_dir,
        memory_dir=mem_dir,
        disk_limit=_disk_limit_within_volume(disk_limit, disk_dir)
        if disk_limit is not None
        else _default_disk_limit(disk_dir),
        memory_limit=memory_limit if memory_limit is not None else _default_memory_limit(mem_dir),
    )
    # Options left out keep NodeSettings' defaults, so each default is written once.
    settings = dataclasses.replace(
        sized,
        prefetch_depth=sized.prefetch_depth if prefetch_depth is None else prefetch_depth,
        fetch_concurrency=sized.fetch_concurrency
        if fetch_concurrency is None
        else fetch_concurrency,
        retry=sized.retry if retry is None else retry,
    )
    node = caches.CacheNode(manifest, settings, storage_options=dict(storage_options or {}) or None)
    ds = datasets.Dataset(embedded.EmbeddedProvider(node), params, gather_threads=gather_threads)
    return _resumed(ds, state)


def _resumed(
    ds: datasets.Dataset, state: dict[str, Any] | list[dict[str, Any]] | None
) -> datasets.Dataset:
    if state is not None:
        try:
            ds.load_state_dict(state)
        except errors.ShardcacheError:
            ds.close()
            raise
    return ds
