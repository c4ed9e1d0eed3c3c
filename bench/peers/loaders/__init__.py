"""One adapter per loader, behind a common interface (`base.Loader`).

Adapters import their peer lazily, so listing or running the torch-free loaders
(shardcache, pyarrow) never imports torch.
"""

from __future__ import annotations

import importlib

from bench.peers.loaders import base

#: Loader name -> "module:class". The order is the order of the table.
REGISTRY: dict[str, str] = {
    "shardcache-sidecar-sample": "bench.peers.loaders.shardcache_loaders:SampleSidecarLoader",
    "shardcache-sidecar": "bench.peers.loaders.shardcache_loaders:SidecarLoader",
    "shardcache-sidecar-disk": "bench.peers.loaders.shardcache_loaders:DiskSidecarLoader",
    "shardcache-embedded-sample": "bench.peers.loaders.shardcache_loaders:SampleEmbeddedLoader",
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
    "shardcache-sidecar-sample",
    "shardcache-sidecar",
    "shardcache-sidecar-disk",
    "shardcache-embedded-sample",
    "shardcache-embedded",
    "pyarrow",
    "in-memory-ceiling",
)

#: shardcache through its sidecar in block mode, one row per memory-tier medium (a
#: DatasetMount's `cache.medium`).
SIDECAR = ("shardcache-sidecar", "shardcache-sidecar-disk")
#: shardcache through its sidecar in sample mode: the RESULT line's shardcache figure,
#: set against the peers' per-sample shuffles.
SIDECAR_SAMPLE = ("shardcache-sidecar-sample",)

#: Loaders whose memory tier is a directory on the local disk's filesystem (medium
#: Disk: the decoded shards live in the page cache) instead of a tmpfs.
TIER_ON_DISK = ("shardcache-sidecar-disk",)

#: The peer family each loader belongs to: a family's figure is its fastest variant.
FAMILY: dict[str, str] = {
    "shardcache-sidecar-sample": "shardcache",
    "shardcache-sidecar": "shardcache",
    "shardcache-sidecar-disk": "shardcache",
    "shardcache-embedded-sample": "shardcache",
    "shardcache-embedded": "shardcache",
    "pyarrow": "pyarrow",
    "litdata": "litdata",
    "litdata-dataloader": "litdata",
    "mosaic": "mosaic",
    "mosaic-dataloader": "mosaic",
    "torch-mapstyle": "torch",
    "in-memory-ceiling": "ceiling",
}


#: What each loader's shuffle permutes (the table's "shuffle" column): "sample" rows
#: reorder single samples, coarser rows keep runs of consecutive samples together.
SAMPLE_SHUFFLE = "sample"
GRANULARITY: dict[str, str] = {
    "shardcache-sidecar-sample": "sample (65,536-row windows)",
    "shardcache-sidecar": "block (4,096-row runs)",
    "shardcache-sidecar-disk": "block (4,096-row runs)",
    "shardcache-embedded-sample": "sample (65,536-row windows)",
    "shardcache-embedded": "block (4,096-row runs)",
    "pyarrow": "file (row order kept)",
    "litdata": "sample (within a chunk)",
    "litdata-dataloader": "sample (within a chunk)",
    "mosaic": "sample (py1e)",
    "mosaic-dataloader": "sample (py1e)",
    "torch-mapstyle": "sample (global)",
    "in-memory-ceiling": "batch (a batch's rows kept together)",
}


def shuffles_samples(name: str) -> bool:
    return GRANULARITY.get(name, "").startswith(SAMPLE_SHUFFLE)


def create(name: str, setup: base.Setup) -> base.Loader:
    if name not in REGISTRY:
        raise SystemExit(f"unknown loader {name!r}; known: {', '.join(REGISTRY)}")
    module_name, _, class_name = REGISTRY[name].partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    loader: base.Loader = cls(setup)
    return loader
