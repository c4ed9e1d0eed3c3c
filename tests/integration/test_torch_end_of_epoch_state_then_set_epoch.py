"""A StatefulDataLoader state saved at the end of an epoch, then
`loader.load_state_dict(state)` + `ds.set_epoch(next)`: the pass reads the next epoch,
with any number of workers (docs/adapters.md, "Epochs").

With num_workers=0 it read the saved epoch again (s19 D1): torchdata loads the dataset's
state lazily, at `iter(loader)`, after the user's `set_epoch`, and the adapter let the
loaded state's epoch replace the one `set_epoch` chose.

A resumed loop written from epoch 0 (`loader.load_state_dict(state)`, then `for epoch in
range(epochs): ds.set_epoch(epoch)`) read every sample before the checkpoint a second
time, silently: `set_epoch`'s own refusal never saw the state, and the state's epoch then
won. It is refused at `iter(loader)` now, and `shardcache.torch.state_epoch(loader_state)`
says where the loop starts."""

from __future__ import annotations

import collections
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from torchdata.stateful_dataloader import StatefulDataLoader

import shardcache.torch
from shardcache import errors
from tests.support import torch_datasets

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]


@pytest.fixture
def make(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    with torch_datasets.over_written(tmp_path, monkeypatch) as factory:
        yield factory


def loader(ds: Any, workers: int) -> Any:
    return StatefulDataLoader(
        ds, batch_size=None, num_workers=workers,
        multiprocessing_context="fork" if workers else None,
    )  # fmt: skip


def uids(batches: Any) -> list[int]:
    return [int(u) for b in batches for u in b["uid"]]


@pytest.mark.parametrize("shuffle", ["block", "sample"])
@pytest.mark.parametrize("workers", [0, 2])
def test_end_of_epoch_state_then_set_epoch_reads_the_next_epoch(
    make: Any, workers: int, shuffle: str
) -> None:
    options = {"shuffle": shuffle, "window": 16}
    reference = make(**options)
    reference.set_epoch(1)
    epoch1 = uids(loader(reference, 0))

    first_ds = make(**options)
    first = loader(first_ds, workers)
    epoch0 = uids(first)  # the whole of epoch 0, then a checkpoint at the epoch boundary
    state = json.loads(json.dumps(first.state_dict()))
    assert epoch0 != epoch1

    # The resumed job: load the checkpoint, then the usual loop from the next epoch.
    ds = make(**options)
    resumed = loader(ds, workers)
    resumed.load_state_dict(state)
    ds.set_epoch(1)
    got = uids(resumed)
    assert got != epoch0, "the resumed run read epoch 0 again instead of epoch 1"
    assert got == epoch1
    if workers == 0:  # with workers the main process's copy read nothing (D2's refusal)
        assert ds.state_dict()["dataset"]["epoch"] == 1


@pytest.mark.parametrize("workers", [0, 2])
def test_set_epoch_before_loading_an_end_of_epoch_state_reads_the_next_epoch(
    make: Any, workers: int
) -> None:
    reference = make()
    reference.set_epoch(1)
    epoch1 = uids(loader(reference, 0))

    first = loader(make(), workers)
    uids(first)
    state = json.loads(json.dumps(first.state_dict()))

    ds = make()
    ds.set_epoch(1)
    resumed = loader(ds, workers)
    resumed.load_state_dict(state)
    assert uids(resumed) == epoch1


def test_a_mid_epoch_state_still_resumes_its_own_epoch(make: Any) -> None:
    reference = uids(loader(make(), 0))

    first_ds = make()
    first = loader(first_ds, 0)
    batches = iter(first)
    seen = uids([next(batches) for _ in range(4)])
    state = json.loads(json.dumps(first.state_dict()))

    ds = make()
    resumed = loader(ds, 0)
    resumed.load_state_dict(state)
    ds.set_epoch(0)
    assert seen + uids(resumed) == reference


EPOCHS = 3


def preempted_in_epoch_1(make: Any, workers: int, seen: collections.Counter[Any]) -> Any:
    ds = make()
    first = loader(ds, workers)
    for epoch in range(EPOCHS):
        ds.set_epoch(epoch)
        for i, batch in enumerate(first):
            seen.update((epoch, int(u)) for u in batch["uid"])
            if epoch == 1 and i == 4:
                return json.loads(json.dumps(first.state_dict()))
    raise AssertionError("never preempted")


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_loop_from_epoch_0_is_refused_at_iter(make: Any, workers: int) -> None:
    state = preempted_in_epoch_1(make, workers, collections.Counter())
    assert shardcache.torch.state_epoch(state) == 1
    ds = make()
    resumed = loader(ds, workers)
    resumed.load_state_dict(state)
    ds.set_epoch(0)
    with pytest.raises(errors.StateMismatchError) as refused:
        next(iter(resumed))
    message = str(refused.value)
    assert "a state of epoch 1" in message and "set_epoch(0)" in message
    assert "shardcache.torch.state_epoch(loader_state)" in message


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_loop_from_state_epoch_reads_every_sample_once_per_epoch(
    make: Any, workers: int
) -> None:
    seen: collections.Counter[Any] = collections.Counter()
    state = preempted_in_epoch_1(make, workers, seen)
    ds = make()
    resumed = loader(ds, workers)
    resumed.load_state_dict(state)
    for epoch in range(shardcache.torch.state_epoch(state), EPOCHS):
        ds.set_epoch(epoch)
        for batch in resumed:
            seen.update((epoch, int(u)) for u in batch["uid"])
    rows = sum(torch_datasets.SHARDS)
    assert max(seen.values()) == 1
    assert sorted(seen) == [(e, u) for e in range(EPOCHS) for u in range(rows)]


def test_state_epoch_reads_every_kind_of_state_and_refuses_a_mixtures() -> None:
    ds_state = {"digest": "sha256:d", "epoch": 4, "position": 0}
    adapter = {"version": 1, "dataset": ds_state, "split": [0, 1]}
    assert shardcache.torch.state_epoch(ds_state) == 4
    assert shardcache.torch.state_epoch(adapter) == 4
    assert shardcache.torch.state_epoch({"fetcher_state": {"dataset_iter_state": adapter}}) == 4
    workers = {
        "_snapshot": {"_worker_snapshots": {
            "worker_0": {"fetcher_state": {"dataset_iter_state": adapter}},
            "worker_1": {"dataset_state": {**adapter, "dataset": {**ds_state, "epoch": 3}}},
        }},
    }  # fmt: skip
    assert shardcache.torch.state_epoch(workers) == 3
    with pytest.raises(errors.StateMismatchError, match=r"a mixture has no epochs"):
        shardcache.torch.state_epoch({"version": 1, "mixture": {}})
    with pytest.raises(errors.StateMismatchError, match="found list"):
        shardcache.torch.state_epoch([adapter])
