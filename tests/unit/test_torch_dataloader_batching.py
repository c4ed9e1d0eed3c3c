"""`shardcache.torch.IterableDataset` yields whole batches. A DataLoader that batches
(`DataLoader(ds)`, whose default batch_size is 1, or `batch_size=k`) stacked k of them
into one, a silent leading dimension ([k, B]) that trained on the wrong shapes. It is
refused at the first batch, in the main process and in DataLoader workers, and
`batch_size=None` reads the dataset's batches unchanged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.utils.data

import shardcache.torch
from shardcache import errors
from tests.support import datasets

pytestmark = pytest.mark.unit


def dataset(tmp_path: Path) -> shardcache.torch.IterableDataset:
    uri, _ = datasets.write_local(tmp_path / "ds", [25, 25])
    return shardcache.torch.IterableDataset(
        uri, batch_size=10, columns=["uid"], cache_dir=tmp_path / "cache", rank=0, world_size=1
    )


@pytest.mark.parametrize("options", [{}, {"batch_size": 3}, {"batch_size": 3, "num_workers": 1}])
def test_a_dataloader_that_batches_the_whole_batches_is_refused_not_stacked(
    tmp_path: Path, options: dict[str, Any]
) -> None:
    loader = torch.utils.data.DataLoader(dataset(tmp_path), **options)
    with pytest.raises(errors.InputError, match=r"expected DataLoader\(ds, batch_size=None\)"):
        next(iter(loader))


def test_a_dataloader_with_batch_size_none_yields_the_datasets_batches(tmp_path: Path) -> None:
    ds = dataset(tmp_path)
    plain = [b["uid"].tolist() for b in ds]
    loaded = [b["uid"].tolist() for b in torch.utils.data.DataLoader(ds, batch_size=None)]
    assert loaded == plain and [len(b) for b in loaded] == [10] * 5
