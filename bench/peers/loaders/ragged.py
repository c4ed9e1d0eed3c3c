"""Batching variable-length samples for torch DataLoaders: the collate every peer gets.

torch's default collate stacks equal-shape tensors and fails on ragged token lists, so
per-sample loaders behind a DataLoader get this one: a batch becomes (uids, all token
ids concatenated, offsets), tensors so worker processes hand them over through shared
memory rather than pickling. It is what a packing trainer does anyway.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np


def collate(samples: Sequence[dict[str, Any]]) -> tuple[Any, Any, Any]:
    import torch

    tokens = [np.asarray(s["tokens"]) for s in samples]
    offsets = np.zeros(len(tokens) + 1, dtype=np.int64)
    np.cumsum([len(t) for t in tokens], out=offsets[1:])
    uids = np.fromiter((int(s["uid"]) for s in samples), dtype=np.int64, count=len(samples))
    return (
        torch.from_numpy(uids),
        torch.from_numpy(np.concatenate(tokens).astype(np.int32, copy=False)),
        torch.from_numpy(offsets),
    )


def as_arrays(batches: Any) -> Iterator[tuple[Any, Any, Any]]:
    """Tensor triples from a DataLoader as numpy views (no copy)."""
    for uids, values, offsets in batches:
        yield uids.numpy(), values.numpy(), offsets.numpy()
