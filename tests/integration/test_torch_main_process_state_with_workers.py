"""With DataLoader workers, the main process's `IterableDataset.state_dict()` is refused
once they have read, instead of silently saying "epoch start" (s19 D2): committed as a
checkpoint's data state (docs/checkpoints.md), a resume from it repeated every sample the
run already trained on. The refusal says what to commit instead."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.utils.data

from shardcache import errors
from tests.support import torch_datasets

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
]


@pytest.fixture
def make(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    with torch_datasets.over_written(tmp_path, monkeypatch) as factory:
        yield factory


def loader(ds: Any, workers: int, **kw: Any) -> Any:
    return torch.utils.data.DataLoader(
        ds, batch_size=None, num_workers=workers,
        multiprocessing_context="fork" if workers else None, **kw,
    )  # fmt: skip


def test_main_process_state_after_worker_batches_is_not_silently_the_epoch_start(make: Any) -> None:
    ds = make()
    batches = iter(loader(ds, 2))
    for _ in range(5):  # 5 batches of 6 rows trained on
        next(batches)
    try:
        state = ds.state_dict()
    except errors.ShardcacheError:
        return  # a clear refusal is fine
    assert state["dataset"]["position"] == 30, (
        f"state says position {state['dataset']['position']} after 30 rows were yielded: "
        "a resume from it repeats them"
    )


@pytest.mark.parametrize("persistent", [False, True])
def test_the_refusal_says_what_to_commit_instead(make: Any, persistent: bool) -> None:
    ds = make()
    for _ in loader(ds, 2, persistent_workers=persistent):
        pass
    with pytest.raises(errors.StateMismatchError) as refused:
        ds.state_dict()
    message = str(refused.value)
    assert "DataLoader workers" in message
    assert "StatefulDataLoader.state_dict()" in message
    assert "num_workers=0" in message


def test_a_main_process_pass_or_load_after_the_workers_makes_its_state_exact_again(
    make: Any,
) -> None:
    ds = make()
    for _ in loader(ds, 2):
        pass
    with pytest.raises(errors.StateMismatchError):
        ds.state_dict()

    batches = iter(loader(ds, 0))
    next(batches)
    next(batches)
    assert ds.state_dict()["dataset"]["position"] == 12

    other = make()
    for _ in loader(other, 2):
        pass
    saved = ds.state_dict()
    other.load_state_dict(saved)
    assert other.state_dict() == saved


def test_without_workers_the_state_is_the_position(make: Any) -> None:
    ds = make()
    batches = iter(loader(ds, 0))
    for _ in range(5):
        next(batches)
    assert ds.state_dict()["dataset"]["position"] == 30
