"""An adapter's state handed where a Dataset's is expected is named as one (s19 D4 item 1).

`shardcache.open(resume_from=...)` of a checkpoint committed with
`data_state=torch_ds.state_dict()` gets the torch/numpy adapter's wrapper
(`{"version", "dataset", "split", ...}`); the refusal points at `state["dataset"]`, as a
mixture's state gets a pointer at `sources.<name>`, instead of "not a shardcache state"."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import shardcache
from shardcache import errors
from tests.support import datasets


@pytest.fixture
def ds(tmp_path: Path) -> Iterator[shardcache.Dataset]:
    uri, _ = datasets.write_local(tmp_path / "ds", [40, 25, 33, 17])
    with shardcache.open(uri, cache_dir=tmp_path / "cache") as opened:
        yield opened


def test_an_adapter_state_is_named_as_one_and_points_at_its_dataset_state(
    ds: shardcache.Dataset,
) -> None:
    wrapped = {"version": 1, "dataset": ds.state_dict(), "batch_size": 6, "pack": None,
               "skip": 0, "split": [0, 1]}  # fmt: skip
    with pytest.raises(errors.StateMismatchError) as refused:
        ds.load_state_dict(wrapped)
    assert "not a shardcache state" not in str(refused.value)
    assert "state['dataset']" in str(refused.value)
    ds.load_state_dict(wrapped["dataset"])  # what the note says to pass


def test_a_list_of_adapter_states_is_named_with_the_failing_entry(
    ds: shardcache.Dataset,
) -> None:
    wrapped = {"version": 1, "dataset": ds.state_dict(), "batch_size": 6, "pack": None,
               "skip": 0, "split": [0, 1]}  # fmt: skip
    with pytest.raises(errors.StateMismatchError, match=r"state 0: .*state\['dataset'\]"):
        ds.load_state_dict([wrapped])
