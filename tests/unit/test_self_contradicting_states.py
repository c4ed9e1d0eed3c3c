"""Hand-edited states that contradict themselves are refused with a message saying what
was expected and found: a skip of the state's epoch ending after its position (the rows
it calls skipped would be read), segments past the end of the epoch's global sequence
(len() would count rows that are never read). The library's own states, the agent's
clamped skip and a set_epoch back to an epoch read before, still load."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import shardcache
from shardcache import datasets as sc_datasets
from shardcache import errors, states
from tests.support import datasets

pytestmark = pytest.mark.unit

ROWS = [40, 25, 33, 17]  # 115 rows


@pytest.fixture
def ds(tmp_path: Path) -> Iterator[sc_datasets.Dataset]:
    uri, _ = datasets.write_local(tmp_path / "ds", ROWS)
    with shardcache.open(uri, cache_dir=tmp_path / "cache", shuffle=False) as opened:
        yield opened


def _skip(epoch: int, start: int, stop: int) -> dict[str, int]:
    return {"epoch": epoch, "start": start, "stop": stop}


@pytest.mark.parametrize(
    ("position", "skip"),
    [(12, _skip(0, 20, 30)), (100, _skip(0, 100, 300)), (25, _skip(0, 20, 30))],
)
def test_a_skip_of_the_states_epoch_ending_after_its_position_is_refused(
    ds: sc_datasets.Dataset, position: int, skip: dict[str, int]
) -> None:
    state = ds.state_dict() | {"position": position, "skips": [skip]}
    with pytest.raises(
        errors.StateMismatchError,
        match=rf"expected every skip of epoch 0 to end at or before the position {position}",
    ):
        ds.load_state_dict(state)
    assert (ds.position, ds.skips) == (0, ())  # all or nothing


def test_the_parser_refuses_it_for_every_reader_of_states(ds: sc_datasets.Dataset) -> None:
    # The agent and the lineage tools parse states with the same function.
    state = ds.state_dict() | {"position": 12, "skips": [_skip(0, 20, 30)]}
    with pytest.raises(errors.StateMismatchError, match=r"found \[\{'epoch': 0, 'start': 20"):
        states.parse(state)


def test_skips_behind_the_position_and_of_earlier_epochs_load(ds: sc_datasets.Dataset) -> None:
    behind = ds.state_dict() | {"position": 30, "skips": [_skip(0, 20, 30)]}
    ds.load_state_dict(behind)
    assert ds.position == 30
    earlier = ds.state_dict() | {"epoch": 1, "position": 0, "skips": [_skip(0, 20, 30)]}
    ds.load_state_dict(earlier)
    assert (ds.epoch, ds.position) == (1, 0)


def test_the_agents_skip_past_the_epochs_end_is_still_cut_there(ds: sc_datasets.Dataset) -> None:
    # The agent skips without knowing the dataset: the position is the skip's end.
    state = ds.state_dict() | {"position": 300, "skips": [_skip(0, 100, 300)], "batch_size": 4}
    ds.load_state_dict(state)
    assert ds.position == 115
    assert ds.skips == (states.Skip(0, 100, 115),)


@pytest.mark.parametrize("ranges", [[[100, 200]], [[0, 10], [110, 116]]])
def test_segments_past_the_end_of_the_epoch_are_refused(
    ds: sc_datasets.Dataset, ranges: list[list[int]]
) -> None:
    state = ds.state_dict() | {"segments": {"epoch": 0, "ranges": ranges}, "position": 0}
    with pytest.raises(
        errors.StateMismatchError,
        match=rf"expected ranges within the epoch's 115 samples \[0, 115\), found one ending "
        rf"at {ranges[-1][1]}",
    ):
        ds.load_state_dict(state)
    assert len(ds) == 115  # unchanged


def test_segments_within_the_epoch_load(ds: sc_datasets.Dataset) -> None:
    state = ds.state_dict() | {"segments": {"epoch": 0, "ranges": [[0, 10], [100, 115]]}}
    ds.load_state_dict(state)
    assert len(ds) == 25
    assert sum(b.num_rows for b in ds.batches(4)) == 25


def test_a_state_after_set_epoch_back_to_an_epoch_with_skips_loads(
    ds: sc_datasets.Dataset,
) -> None:
    it = ds.batches(4)
    next(it)
    ds.skip_batches(2)
    next(it)
    ds.set_epoch(1)
    ds.set_epoch(0)  # epoch 0 again: read afresh, its earlier skips no longer hold
    next(it)
    state = ds.state_dict()
    assert (state["position"], state["skips"]) == (4, [])
    ds.load_state_dict(state)
    assert ds.position == 4
    it.close()
