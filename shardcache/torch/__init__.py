"""PyTorch adapter (the `torch` extra): datasets, tensors and batches on the GPU.

    ds = shardcache.torch.IterableDataset("s3://bucket/tokens/", batch_size=16384,
                                          columns=["tokens"], pack=2048)
    loader = torchdata.stateful_dataloader.StatefulDataLoader(ds, batch_size=None,
                                                              num_workers=2)
    # or, with no CPU copy at all: batches already on this rank's GPU
    for batch in shardcache.torch.DevicePrefetcher(ds, depth=2): ...

Importing this module does not import torch: the client library stays light for
trainers that do not use the extra, and the names below load their modules (and torch)
on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from shardcache import errors

if TYPE_CHECKING:
    from shardcache.torch._datasets import IterableDataset
    from shardcache.torch._prefetch import DevicePrefetcher
    from shardcache.torch._rank_states import state_epoch
    from shardcache.torch._ranks import discover
    from shardcache.torch._tensors import collate

__all__ = ["DevicePrefetcher", "IterableDataset", "collate", "discover", "state_epoch"]

_MODULES = {
    "IterableDataset": "shardcache.torch._datasets",
    "DevicePrefetcher": "shardcache.torch._prefetch",
    "discover": "shardcache.torch._ranks",
    "collate": "shardcache.torch._tensors",
    "state_epoch": "shardcache.torch._rank_states",
}


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module 'shardcache.torch' has no attribute {name!r}")
    try:
        imported = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name not in ("torch", "numpy"):
            raise
        raise errors.missing_extra(exc, f"shardcache.torch.{name}", "torch") from exc
    return getattr(imported, name)
