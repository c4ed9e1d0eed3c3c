"""`shardcache.torch.IterableDataset(drop_last=True)` through real DataLoader workers:
every rank of a data-parallel job yields the same number of batches per epoch (rank
sizes differ by one row; a rank with one batch more waited at the epoch's end in a
collective its peers never joined). The s19 explorer's D0 through the adapter."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.utils.data

from tests.support import torch_datasets

pytestmark = [
    pytest.mark.integration,
    # torchdata 0.11 (its latest) still calls an API torch has since deprecated.
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]


@pytest.fixture
def make(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    with torch_datasets.over_written(tmp_path, monkeypatch) as factory:
        yield factory


@pytest.mark.parametrize(("shuffle", "workers"), [(True, 0), (True, 2), ("sample", 2)])
def test_every_rank_yields_the_same_number_of_batches_with_drop_last(
    make, shuffle: bool | str, workers: int
) -> None:  # type: ignore[no-untyped-def]
    # 115 rows over 3 ranks: 38, 38 and 39 rows, so 12, 12 and 13 batches of 3 each.
    counts = []
    for rank in range(3):
        ds = make(rank=rank, world_size=3, batch_size=3, drop_last=True, shuffle=shuffle)
        loader = torch.utils.data.DataLoader(
            ds,
            batch_size=None,
            num_workers=workers,
            multiprocessing_context="fork" if workers else None,
        )
        counts.append(sum(1 for _ in loader))
    assert counts == [12, 12, 12]
