"""A resumed training loop that starts at epoch 0 again (`load_state_dict(state)`, then
`for epoch in range(epochs): ds.set_epoch(epoch)`, as the README showed) used to read
every sample before the checkpoint a second time, silently. `set_epoch` to an epoch
before a state just loaded is now refused, and `epoch` says where the loop starts
(docs/reading-plan.md, "Moves between two batches"). Regression tests of the s20
trainer explorer's D1."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

import shardcache
import shardcache.numpy
from shardcache import errors
from tests.support import datasets

pytestmark = pytest.mark.unit

EPOCHS = 2


def _preempted_in_epoch_1(
    uri: str, cache: Path, seen: collections.Counter[tuple[int, int]]
) -> dict[str, object]:
    with shardcache.open(uri, cache_dir=cache, rank=0, world_size=1) as ds:
        for epoch in range(EPOCHS):
            ds.set_epoch(epoch)
            for i, batch in enumerate(ds.batches(10)):
                seen.update((epoch, u) for u in batch.column("uid").to_pylist())
                if epoch == 1 and i == 2:
                    return ds.state_dict()
    raise AssertionError("never preempted")


def test_a_resumed_loop_from_epoch_0_is_refused_instead_of_reading_samples_again(
    tmp_path: Path,
) -> None:
    uri, _ = datasets.write_local(tmp_path / "ds", [25, 25])
    seen: collections.Counter[tuple[int, int]] = collections.Counter()
    state = _preempted_in_epoch_1(uri, tmp_path / "cache", seen)
    with shardcache.open(uri, cache_dir=tmp_path / "cache", rank=0, world_size=1) as ds:
        ds.load_state_dict(state)
        with pytest.raises(errors.StateMismatchError) as refused:
            ds.set_epoch(0)
        message = str(refused.value)
        assert "epoch 1" in message and "range(ds.epoch, epochs)" in message
        # Refused without moving: the loaded position stands.
        assert (ds.epoch, ds.position) == (1, 30)


def test_a_resumed_loop_from_ds_epoch_reads_every_sample_once(tmp_path: Path) -> None:
    uri, _ = datasets.write_local(tmp_path / "ds", [25, 25])
    seen: collections.Counter[tuple[int, int]] = collections.Counter()
    state = _preempted_in_epoch_1(uri, tmp_path / "cache", seen)
    with shardcache.open(uri, cache_dir=tmp_path / "cache", rank=0, world_size=1) as ds:
        ds.load_state_dict(state)
        assert ds.epoch == 1
        for epoch in range(ds.epoch, EPOCHS):
            ds.set_epoch(epoch)
            for batch in ds.batches(10):
                seen.update((epoch, u) for u in batch.column("uid").to_pylist())
    assert max(seen.values()) == 1
    assert sum(seen.values()) == 2 * 50


def test_going_back_an_epoch_after_reading_is_still_allowed(tmp_path: Path) -> None:
    uri, _ = datasets.write_local(tmp_path / "ds", [25, 25])
    seen: collections.Counter[tuple[int, int]] = collections.Counter()
    state = _preempted_in_epoch_1(uri, tmp_path / "cache", seen)
    with shardcache.open(uri, cache_dir=tmp_path / "cache", rank=0, world_size=1) as ds:
        ds.load_state_dict(state)
        next(iter(ds.batches(10)))
        ds.set_epoch(0)  # a batch was read since the load: the documented move back
        assert (ds.epoch, ds.position) == (0, 0)


def test_the_numpy_batches_refuse_a_loop_from_epoch_0_after_a_load(tmp_path: Path) -> None:
    uri, _ = datasets.write_local(tmp_path / "ds", [25, 25])
    with shardcache.numpy.Batches(
        uri, batch_size=10, columns=["uid"], cache_dir=tmp_path / "cache", rank=0, world_size=1
    ) as batches:
        batches.set_epoch(1)
        it = iter(batches)
        next(it)
        state = batches.state_dict()
    with shardcache.numpy.Batches(
        uri, batch_size=10, columns=["uid"], cache_dir=tmp_path / "cache", rank=0, world_size=1
    ) as batches:
        batches.load_state_dict(state)
        assert batches.epoch == 1
        with pytest.raises(errors.StateMismatchError):
            batches.set_epoch(0)
        batches.set_epoch(1)  # the loaded epoch keeps the position
        rows = sum(len(b["uid"]) for b in batches)
    assert rows == 50 - 10


def test_the_torch_dataset_refuses_a_loop_from_epoch_0_after_a_load(tmp_path: Path) -> None:
    import shardcache.torch

    uri, _ = datasets.write_local(tmp_path / "ds", [25, 25])
    cache = tmp_path / "cache"
    ds = shardcache.torch.IterableDataset(
        uri, batch_size=10, columns=["uid"], cache_dir=cache, rank=0, world_size=1
    )
    ds.set_epoch(1)
    it = iter(ds)
    next(it)
    state = ds.state_dict()
    ds.close()
    resumed = shardcache.torch.IterableDataset(
        uri, batch_size=10, columns=["uid"], cache_dir=cache, rank=0, world_size=1
    )
    resumed.load_state_dict(state)
    assert resumed.epoch == 1
    with pytest.raises(errors.StateMismatchError):
        resumed.set_epoch(0)
    resumed.set_epoch(1)
    rows = sum(len(b["uid"]) for b in resumed)
    resumed.close()
    assert rows == 50 - 10


def test_the_numpy_batches_go_back_to_an_epoch_whose_batches_were_skipped(
    tmp_path: Path,
) -> None:
    """Their set_epoch is the dataset's: back in an epoch read before, the pass starts
    afresh and reads the rows its earlier pass skipped (it used to reload a state that
    still called them skipped, ahead of position 0, which is refused)."""
    uri, _ = datasets.write_local(tmp_path / "ds", [25, 25])
    with shardcache.numpy.Batches(
        uri, batch_size=10, columns=["uid"], cache_dir=tmp_path / "cache", rank=0, world_size=1
    ) as batches:
        it = iter(batches)
        next(it)
        batches.dataset.skip_batches(2)
        assert len([u for b in it for u in b["uid"]]) == 50 - 30
        batches.set_epoch(1)
        assert len([u for b in batches for u in b["uid"]]) == 50
        batches.set_epoch(0)
        again = sorted(int(u) for b in batches for u in b["uid"])
    assert again == list(range(50))
