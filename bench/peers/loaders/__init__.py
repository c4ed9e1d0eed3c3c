"""One adapter per loader, behind a common interface (`base.Loader`).

Adapters import their peer lazily, so listing or running the torch-free loaders
(shardcache, pyarrow) never imports torch.
"""

from __future__ import annotations

import importlib

from bench.peers.loaders import base

#: Loader name -> "module:class". The order is the order of the table.
REGISTRY: dict[str, str] = {
    "shardcache-sidecar": "bench.peers.loaders.shardcache_loaders:SidecarLoader",
    "shardcache-sidecar-disk": "bench.peers.loaders.shardcache_loaders:DiskSidecarLoader",
    "shardcache-embedded": "bench.peers.loaders.shardcache_loaders:EmbeddedLoader",
    "pyarrow": "bench.peers.loaders.pyarrow_loader:PyarrowLoader",
    "litdata": "bench.peers.loaders.litdata_loader:LitdataLoader",
    "litdata-dataloader": "bench.peers.loaders.litdata_loader:LitdataDataLoader",
    "mosaic": "bench.peers.loaders.mosaic_loader:MosaicLoader",
    "mosaic-dataloader": "bench.peers.loaders.mosaic_loader:MosaicDataLoader",
    "torch-mapstyle": "bench.peers.loaders.torch_mapstyle:TorchMapStyleLoader",
    "in-memory-ceiling": "bench.peers.loaders.ceiling:CeilingLoader",
}

#: Loaders that need nothing beyond shardcache's own dependencies (pyarrow, numpy).
TORCH_FREE = (
    "shardcache-sidecar",
    "shardcache-sidecar-disk",
    "shardcache-embedded",
    "pyarrow",
    "in-memory-ceiling",
)

#: shardcache through its sidecar, one row per memory-tier medium (a DatasetMount's
#: `cache.medium`); the RESULT line takes the fastest.
SIDECAR = ("shardcache-sidecar", "shardcache-sidecar-disk")

#: Loaders whose memory tier is a directory on the local disk's filesystem (medium
#: Disk: the decoded shards live in the page cache) instead of a tmpfs.
TIER_ON_DISK = ("shardcache-sidecar-disk",)

#: The peer family each loader belongs to: a family's figure is its fastest variant.
FAMILY: dict[str, str] = {
    "shardcache-sidecar": "shardcache",
    "shardcache-sidecar-disk": "shardcache",
    "shardcache-embedded": "shardcache",
    "pyarrow": "pyarrow",
    "litdata": "litdata",
    "litdata-dataloader": "litdata",
    "mosaic": "mosaic",
    "mosaic-dataloader": "mosaic",
    "torch-mapstyle": "torch",
    "in-memory-ceiling": "ceiling",
}


def create(name: str, setup: base.Setup) -> base.Loader:
    if name not in REGISTRY:
        raise SystemExit(f"unknown loader {name!r}; known: {', '.join(REGISTRY)}")
    module_name, _, class_name = REGISTRY[name].partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    loader: base.Loader = cls(setup)
    return loader
