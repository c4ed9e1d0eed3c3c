"""The torch adapter tests' dataset and a factory of `shardcache.torch` datasets over it.

Row counts that are multiples of neither the batch (6) nor the block (5): batches cross
block and shard boundaries, and an epoch ends on a short batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest

import shardcache.torch
from tests.support import datasets

SHARDS = [40, 25, 33, 17]

Factory = Callable[..., shardcache.torch.IterableDataset]


@contextlib.contextmanager
def iterable_datasets(
    uri: str, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Factory]:
    """`factory(**options)` opens an IterableDataset over `uri` (batches of 6 rows of
    `uid` and `tokens`, blocks of 5, unless `options` say otherwise) as rank 0 of 1
    unless told; every dataset made is closed at the end."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    made: list[shardcache.torch.IterableDataset] = []

    def factory(**kw: Any) -> shardcache.torch.IterableDataset:
        options: dict[str, Any] = {"batch_size": 6, "columns": ["uid", "tokens"], **kw}
        ds = shardcache.torch.IterableDataset(
            uri, cache_dir=str(cache_dir), block_size=5, **options
        )
        made.append(ds)
        return ds

    try:
        yield factory
    finally:
        for ds in made:
            ds.close()


@contextlib.contextmanager
def over_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shards: Sequence[int] = SHARDS
) -> Iterator[Factory]:
    """`iterable_datasets` over a dataset of `shards` rows written under `tmp_path`."""
    uri = str(tmp_path / "ds")
    datasets.write_dataset(pafs.LocalFileSystem(), uri, list(shards))
    with iterable_datasets(uri, tmp_path / "cache", monkeypatch) as factory:
        yield factory
