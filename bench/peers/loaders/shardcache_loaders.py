"""shardcache, embedded (cache in the trainer process) and through a sidecar process.

Both read the same Parquet files as the pyarrow peer via `file://`, decode each shard
once into uncompressed Arrow IPC in a memory tier on /dev/shm, and hand the loop
zero-copy slices (block mode, `shuffle=True`) or, in the `-sample` rows, batches gathered
with one copy from windows of 65,536 rows spanning shards (`shuffle="sample"`: the
per-sample shuffle the peers' rows use). The sidecar is started the way the operator runs it (its own
process, `shardcache sidecar`, configured by the same environment variables the webhook
writes) with `ready_shards=0`, so the cold pass includes every fetch and decode; the
trainer finds it through $SHARDCACHE_RUN_DIR and $SHARDCACHE_MOUNT as an injected pod does.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shardcache_sidecar import launcher

import shardcache
from bench.peers.loaders import base
from shardcache import contract, plans

#: The sidecar's own defaults (sidecar/shardcache_sidecar/configuration.py): 4 GiB holds the
#: whole 1 GiB benchmark decoded, so the warm pass reads only resident shards.
SIDECAR_MEMORY_LIMIT = 4 << 30
SIDECAR_DISK_LIMIT = 50 << 30


class EmbeddedLoader:
    kind: base.Kind = "arrow"
    #: `shardcache.open(shuffle=…)`: True is block mode.
    shuffle: bool | str = True

    def __init__(self, setup: base.Setup) -> None:
        self._setup = setup
        self._uri = (setup.root / "parquet").resolve().as_uri()
        self._ds: shardcache.Dataset | None = None
        self.settings = (
            f"shardcache.open('file://…/parquet', {self._mode()}, "
            f"memory_dir=/dev/shm/…).batches({setup.batch_size}), cache in the trainer process"
        )

    def _mode(self) -> str:
        if self.shuffle == "sample":
            return f"shuffle='sample', window={plans.DEFAULT_WINDOW}"
        return f"shuffle={self.shuffle!r}, block_size={plans.DEFAULT_BLOCK_SIZE}"

    def _open(self) -> shardcache.Dataset:
        return shardcache.open(
            self._uri,
            cache_dir=self._setup.scratch / "cache",
            memory_dir=self._setup.shm_scratch / "mem",
            shuffle=self.shuffle,
            seed=self._setup.seed,
        )

    def _dataset(self) -> shardcache.Dataset:
        if self._ds is None:
            self._ds = self._open()
        return self._ds

    def epoch(self, epoch: int) -> Iterator[Any]:
        ds = self._dataset()
        ds.set_epoch(epoch)
        yield from ds.batches(self._setup.batch_size)

    def state(self, consumed: int) -> Any | None:
        return self._dataset().state_dict()

    def resume(self, state: Any) -> Iterator[Any]:
        if self._ds is not None:
            self._ds.close()
        self._ds = ds = self._open()
        ds.load_state_dict(state)
        yield from ds.batches(self._setup.batch_size)

    def close(self) -> None:
        if self._ds is not None:
            self._ds.close()
            self._ds = None


class SidecarLoader(EmbeddedLoader):
    #: Where the memory tier lives; the harness picks the directory (`setup.shm_scratch`).
    tier = "memory tier on /dev/shm: cache.medium Memory"

    def __init__(self, setup: base.Setup) -> None:
        super().__init__(setup)
        # The same launcher as `shardcache demo` and `make bench-read`: the env the
        # webhook writes, /readyz on its TCP port as the startup probe sees it.
        self._stack = contextlib.ExitStack()
        self._trainer_env, _ = self._stack.enter_context(
            launcher.sidecar(
                self._uri,
                {},
                setup.shm_scratch,
                memory_limit=SIDECAR_MEMORY_LIMIT,
                disk_limit=SIDECAR_DISK_LIMIT,
                extra_env={
                    contract.ENV_DISK_DIR: str(setup.scratch / "disk"),
                    contract.ENV_READY_SHARDS: "0",
                    contract.ENV_SEED: str(setup.seed),
                    contract.ENV_SHUFFLE: "true",
                },
            )
        )
        self.settings = (
            f"`shardcache sidecar` process (ready_shards=0, {self.tier}); trainer: "
            f"shardcache.open() via $SHARDCACHE_RUN_DIR/$SHARDCACHE_MOUNT, {self._mode()}, "
            f".batches({setup.batch_size})"
        )

    def _open(self) -> shardcache.Dataset:
        os.environ.pop(contract.ENV_SOCKET, None)
        os.environ.update(self._trainer_env)
        return shardcache.open(shuffle=self.shuffle, seed=self._setup.seed)

    def close(self) -> None:
        super().close()
        self._stack.close()


class DiskSidecarLoader(SidecarLoader):
    """The same sidecar with `cache.medium: Disk`: its memory tier is a directory on the
    local disk's filesystem (the harness passes one as `setup.shm_scratch`), so the
    decoded shards the trainer maps are page-cache pages of that filesystem."""

    def __init__(self, setup: base.Setup) -> None:
        self.tier = f"memory tier in a directory on {filesystem_type(setup.shm_scratch)} (cache.medium Disk)"
        super().__init__(setup)


class SampleEmbeddedLoader(EmbeddedLoader):
    """Embedded, in sample mode: per-sample shuffle within windows spanning shards."""

    shuffle = "sample"


class SampleSidecarLoader(SidecarLoader):
    """Through the sidecar, in sample mode (the fair row against the peers' shuffles)."""

    shuffle = "sample"


def filesystem_type(path: Path) -> str:
    """The type of the filesystem holding `path` (tmpfs, ext4, xfs, ...) from the mount
    table, so the settings line says where the memory tier really was."""
    target = os.path.realpath(path)
    best, fstype = "", "unknown"
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            # Mount points escape spaces as \040; good enough for the paths used here.
            point = fields[1].replace("\\040", " ")
            inside = target == point or target.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best):
                best, fstype = point, fields[2]
    return fstype
