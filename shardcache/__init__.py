"""shardcache: a node-local dataset cache that hands trainers zero-copy Arrow batches.

ds = shardcache.open("s3://bucket/tokens/", rank=rank, world_size=world, seed=0)
ds.set_epoch(epoch)
for batch in ds.batches(1024):          # pyarrow.RecordBatch, memory-mapped
    ...
state = ds.state_dict()                 # resume later with ds.load_state_dict(state)
"""

from __future__ import annotations

from shardcache._open import open
from shardcache._open_mixture import open_mixture
from shardcache.datasets import Dataset
from shardcache.errors import (
    CacheError,
    InputError,
    ManifestMismatchError,
    ShardcacheError,
    SidecarUnavailableError,
    SourceError,
    StateMismatchError,
)
from shardcache.manifests import Manifest, resolve
from shardcache.mixtures import Mixture, Schedule, mix
from shardcache.plans import PlanParams

__version__ = "0.1.0"

__all__ = [
    "CacheError",
    "Dataset",
    "InputError",
    "Manifest",
    "ManifestMismatchError",
    "Mixture",
    "PlanParams",
    "Schedule",
    "ShardcacheError",
    "SidecarUnavailableError",
    "SourceError",
    "StateMismatchError",
    "__version__",
    "mix",
    "open",
    "open_mixture",
    "resolve",
]
