"""A second pass over the same epoch (iterating the numpy batches or the torch dataset
again without set_epoch, as a validation loop does) starts the epoch afresh. It moved
the dataset back by loading its own state at position 0, skips and all, and a skip of
that epoch then lay ahead of the position: refused as a state that contradicts itself
("the state contradicts itself; was it edited by hand?"). The skips are a
`skip_batches`, a skip the agent applied at restore, or the rows `drop_last` trims."""

from __future__ import annotations

from pathlib import Path

import pytest

import shardcache.numpy
from tests.support import datasets

pytestmark = pytest.mark.unit


def test_the_numpy_batches_read_an_epoch_again_after_a_skip(tmp_path: Path) -> None:
    uri, _ = datasets.write_local(tmp_path / "ds", [25, 25])
    with shardcache.numpy.Batches(
        uri, batch_size=10, columns=["uid"], cache_dir=tmp_path / "cache", rank=0, world_size=1
    ) as batches:
        it = iter(batches)
        first = [int(u) for u in next(it)["uid"]]
        batches.dataset.skip_batches(2)
        rest = [int(u) for b in it for u in b["uid"]]
        assert len(first) + len(rest) == 50 - 20
        again = [int(u) for b in batches for u in b["uid"]]
    assert sorted(again) == list(range(50))


@pytest.mark.parametrize("shuffle", [True, "sample", False])
def test_the_numpy_batches_read_a_drop_last_epoch_again_alike(
    tmp_path: Path, shuffle: bool | str
) -> None:
    uri, _ = datasets.write_local(tmp_path / "ds", [9, 6])
    with shardcache.numpy.Batches(
        uri, batch_size=3, columns=["uid"], cache_dir=tmp_path / "cache", rank=1,
        world_size=2, drop_last=True, shuffle=shuffle, window=8, block_size=4,
    ) as batches:  # fmt: skip
        first = [[int(u) for u in b["uid"]] for b in batches]
        again = [[int(u) for u in b["uid"]] for b in batches]
    assert len(first) == 2 and again == first


def test_the_torch_dataset_reads_a_drop_last_epoch_again_alike(tmp_path: Path) -> None:
    import shardcache.torch

    uri, _ = datasets.write_local(tmp_path / "ds", [9, 6])
    ds = shardcache.torch.IterableDataset(
        uri, batch_size=3, columns=["uid"], cache_dir=tmp_path / "cache", rank=1,
        world_size=2, drop_last=True,
    )  # fmt: skip
    try:
        first = [b["uid"].tolist() for b in ds]
        state = ds.state_dict()
        again = [b["uid"].tolist() for b in ds]
    finally:
        ds.close()
    assert len(first) == 2 and again == first
    assert state["dataset"]["skips"] == [{"epoch": 0, "start": 6, "stop": 8}]
