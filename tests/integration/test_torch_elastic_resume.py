"""Elastic resume (W -> W') through `shardcache.torch.IterableDataset` (s19 D3).

A state of another world size is refused with "pass the list of every old rank's state
(load_state_dict([...]))"; the adapter refused that list ("found list"), so a torch user
had no way to resume at another world size. It now takes the list of every old rank's
adapter state (one process per rank, same batch_size and pack) and reads this rank's
share of the rows no old rank consumed; what is not a rank-level position (a DataLoader
worker's cursor, a StatefulDataLoader's state) is refused saying what to commit."""

from __future__ import annotations

import collections
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.utils.data
from torchdata.stateful_dataloader import StatefulDataLoader

import shardcache.checkpoint
from shardcache import errors
from tests.support import torch_datasets

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]

ROWS = sum(torch_datasets.SHARDS)


@pytest.fixture
def make(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    with torch_datasets.over_written(tmp_path, monkeypatch) as factory:
        yield factory


def uids(batches: Any) -> list[int]:
    return [int(u) for b in batches for u in b["uid"]]


def old_run(make: Any, world: int, steps: int, **options: Any) -> tuple[list[int], list[Any]]:
    """`steps` batches read by each of `world` ranks; their rows and JSON'd states."""
    seen: list[int] = []
    states = []
    for rank in range(world):
        ds = make(rank=rank, world_size=world, **options)
        batches = iter(ds)
        seen += uids([next(batches) for _ in range(steps)])
        states.append(json.loads(json.dumps(ds.state_dict())))
    return seen, states


def assert_every_row_once(seen: list[int]) -> None:
    counts = collections.Counter(seen)
    assert sorted(counts) == list(range(ROWS))
    assert max(counts.values()) == 1


def test_the_world_size_refusals_advice_is_accepted_by_the_adapter(make: Any) -> None:
    seen: list[int] = []
    old = []
    for rank in range(2):
        ds = make(rank=rank, world_size=2)
        batches = iter(ds)
        seen += uids([next(batches), next(batches)])
        old.append(ds.state_dict())

    single = make(rank=0, world_size=3)
    with pytest.raises(errors.StateMismatchError, match="pass the list") as refused:
        single.load_state_dict(old[0])
        next(iter(single))
    assert "load_state_dict([...])" in str(refused.value)

    # Do what the refusal says.
    for rank in range(3):
        ds = make(rank=rank, world_size=3)
        ds.load_state_dict(old)
        seen += uids(ds)
    counts = collections.Counter(seen)
    assert sorted(counts) == list(range(sum(torch_datasets.SHARDS)))
    assert max(counts.values()) == 1


@pytest.mark.parametrize("shuffle", ["block", "sample"])
def test_new_ranks_with_dataloader_workers_read_the_rest_once_then_the_next_epoch(
    make: Any, shuffle: str
) -> None:
    seen, old = old_run(make, 3, 2, shuffle=shuffle, window=16)
    epoch1: list[int] = []
    for rank in range(2):
        ds = make(rank=rank, world_size=2, shuffle=shuffle, window=16)
        ds.load_state_dict(list(reversed(old)))  # any order
        loader = torch.utils.data.DataLoader(
            ds, batch_size=None, num_workers=2, multiprocessing_context="fork"
        )
        seen += uids(loader)
        ds.set_epoch(1)
        epoch1 += uids(loader)
    assert_every_row_once(seen)
    assert_every_row_once(epoch1)


def test_the_state_of_an_elastic_rank_before_its_first_batch_resumes_the_same(
    make: Any,
) -> None:
    seen, old = old_run(make, 2, 3)
    for rank in range(3):
        ds = make(rank=rank, world_size=3)
        ds.load_state_dict(old)
        state = json.loads(json.dumps(ds.state_dict()))
        again = make(rank=rank, world_size=3)
        again.load_state_dict(state)
        rest = uids(ds)
        assert uids(again) == rest
        seen += rest
    assert_every_row_once(seen)


def stateful_run(
    make: Any, world: int, steps: list[int], workers: list[int], **kw: Any
) -> tuple[list[int], list[Any]]:
    """Rank r reads `steps[r]` batches through a StatefulDataLoader of `workers[r]`
    workers; their rows and the loaders' JSON'd states."""
    seen: list[int] = []
    states = []
    for rank in range(world):
        count = workers[rank]
        loader = StatefulDataLoader(
            make(rank=rank, world_size=world, **kw.get("options", {})),
            batch_size=None,
            num_workers=count,
            multiprocessing_context="fork" if count else None,
            **kw.get("loader", {}),
        )
        batches = iter(loader)
        read = [next(batches) for _ in range(steps[rank])]
        seen += uids(b for b in read if "uid" in b)  # packed batches hold tokens only
        states.append(json.loads(json.dumps(loader.state_dict())))
    return seen, states


@pytest.mark.parametrize("shuffle", ["block", "sample"])
def test_every_old_ranks_statefuldataloader_state_resumes_at_another_world_size(
    make: Any, shuffle: str
) -> None:
    options = {"shuffle": shuffle, "window": 16}
    seen, old = stateful_run(make, 2, [3, 4], [2, 3], options=options)
    seen_0, old_0 = stateful_run(make, 1, [5], [0], options=options)
    for rank in range(3):
        ds = make(rank=rank, world_size=3, **options)
        ds.load_state_dict(old)
        seen += uids(StatefulDataLoader(ds, batch_size=None))
    assert_every_row_once(seen)
    for rank in range(2):  # a num_workers=0 loader's state too
        ds = make(rank=rank, world_size=2, **options)
        ds.load_state_dict(old_0)
        seen_0 += uids(ds)
    assert_every_row_once(seen_0)


def test_statefuldataloader_states_that_are_no_rank_position_are_refused(make: Any) -> None:
    _, stale = stateful_run(make, 2, [3, 3], [2, 2], loader={"snapshot_every_n_steps": 2})
    with pytest.raises(errors.StateMismatchError, match="steps after its last snapshot"):
        make(rank=0, world_size=3).load_state_dict(stale)
    options = {"pack": 8}
    _, packed = stateful_run(make, 2, [2, 2], [2, 2], options=options)
    with pytest.raises(errors.StateMismatchError, match="packed batches"):
        make(rank=0, world_size=3, **options).load_state_dict(packed)


def test_a_dataloader_workers_state_in_the_list_is_refused_with_what_to_commit(
    make: Any,
) -> None:
    worker = {"version": 1, "dataset": make(rank=0, world_size=2).state_dict()["dataset"],
              "skip": 0, "batch_size": 6, "pack": None, "split": [1, 2]}  # fmt: skip
    new = make(rank=0, world_size=3)
    with pytest.raises(errors.StateMismatchError, match=r"split \[1, 2\].*num_workers=0"):
        new.load_state_dict([worker, worker])
    with pytest.raises(errors.StateMismatchError, match="empty list"):
        new.load_state_dict([])


def test_states_of_other_batching_in_the_list_are_refused(make: Any) -> None:
    _, old = old_run(make, 2, 1)
    new = make(rank=0, world_size=3, batch_size=4)
    with pytest.raises(errors.StateMismatchError, match="batch_size: state has 6"):
        new.load_state_dict(old)
    packed = dict(old[0], pack=8, skip=3)
    with pytest.raises(errors.StateMismatchError, match="pack: state has 8"):
        make(rank=0, world_size=3).load_state_dict([packed, old[1]])


def test_resume_from_a_checkpoint_committed_with_adapter_states(
    make: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    monkeypatch.setenv("SHARDCACHE_CHECKPOINT_DIR", str(root))
    seen, old = old_run(make, 2, 2)
    step = root / "step-2"
    step.mkdir()
    shardcache.checkpoint.commit(step, step=2, data_state=old[0])

    # The same world size: rank 0's own state, committed as the adapter gave it.
    same = make(rank=0, world_size=2, resume_from=str(step))
    reference = make(rank=0, world_size=2)
    reference.load_state_dict(old[0])
    assert uids(same) == uids(reference)

    # Another world size: the checkpoint gives every old rank's state (what the agent
    # gathers for resume_from="latest" in a ranked pod).
    def gathered(resume_from: Any, **kw: Any) -> Any:
        assert kw["world_size"] == 3
        return old

    monkeypatch.setattr(shardcache.checkpoint, "data_state", gathered)
    for rank in range(3):
        seen += uids(make(rank=rank, world_size=3, resume_from="latest"))
    assert_every_row_once(seen)


def test_a_statefuldataloader_state_as_the_checkpoints_data_state_says_how_to_load_it(
    make: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    monkeypatch.setenv("SHARDCACHE_CHECKPOINT_DIR", str(root))
    loader = StatefulDataLoader(
        make(), batch_size=None, num_workers=2, multiprocessing_context="fork"
    )
    batches = iter(loader)
    next(batches)
    step = root / "step-1"
    step.mkdir()
    shardcache.checkpoint.commit(step, step=1, data_state=loader.state_dict())
    with pytest.raises(errors.StateMismatchError, match=r"StatefulDataLoader.load_state_dict"):
        make(resume_from=str(step))
