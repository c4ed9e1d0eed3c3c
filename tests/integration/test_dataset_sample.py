"""Sample-level shuffle (plan version 2) and `Dataset.take`, embedded (file:// source).

The stream is checked row by row against a direct pyarrow read of the rows the plan
names (`Dataset.sequence()`), across ranks, epochs, seeds and resumes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pytest

import shardcache
from shardcache import errors, plans
from tests.support import datasets

pytestmark = pytest.mark.integration

SHARDS = [300, 0, 170, 512, 45, 260]
TOTAL = sum(SHARDS)
WINDOW = 200
BLOCK = 64


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, pa.Table]:
    root = tmp_path_factory.mktemp("sample") / "ds"
    table = datasets.write_dataset(pafs.LocalFileSystem(), str(root), SHARDS)
    return str(root), table


def open_sample(uri: str, cache: Path, **kwargs: Any) -> shardcache.Dataset:
    kwargs.setdefault("shuffle", "sample")
    kwargs.setdefault("window", WINDOW)
    kwargs.setdefault("block_size", BLOCK)
    return shardcache.open(uri, cache_dir=cache, **kwargs)


def uids(batches: list[pa.RecordBatch]) -> list[int]:
    return [u for b in batches for u in b.column("uid").to_pylist()]


def test_batches_equal_a_direct_read_of_the_planned_rows_across_ranks(
    dataset: tuple[str, pa.Table], tmp_path: Path
) -> None:
    uri, table = dataset
    seen: list[int] = []
    for rank in range(3):
        with open_sample(uri, tmp_path / "c", seed=5, rank=rank, world_size=3) as ds:
            got = pa.Table.from_batches(list(ds.batches(37))).combine_chunks()
            seq = ds.sequence()
            lo, hi = plans.rank_bounds(seq.total, ds.params)
            want = table.take(pa.array(seq.indices(lo, hi))).combine_chunks()
            assert got.equals(want)
            seen += got.column("uid").to_pylist()
    assert sorted(seen) == list(range(TOTAL))
    # Rows of one batch come from several shards where a window spans them.
    offsets = np.asarray(plans.shard_offsets(SHARDS))
    with open_sample(uri, tmp_path / "c", seed=5) as ds:
        spans = [
            len(set(np.searchsorted(offsets, b.column("uid"), side="right") - 1))
            for b in ds.batches(64)
        ]
    assert max(spans) >= 2


def test_every_epoch_and_seed_reads_a_different_order_even_of_one_shard(tmp_path: Path) -> None:
    root = tmp_path / "one"
    datasets.write_dataset(pafs.LocalFileSystem(), str(root), [5000])
    orders = set()
    for seed in (0, 1):
        with open_sample(str(root), tmp_path / "c", seed=seed, window=4096, block_size=4096) as ds:
            for epoch in range(3):
                ds.set_epoch(epoch)
                got = uids(list(ds.batches(1000)))
                assert sorted(got) == list(range(5000))
                orders.add(tuple(got))
    assert len(orders) == 6


@pytest.mark.parametrize("batch_size", [50, 77])
def test_a_resume_at_every_batch_boundary_continues_exactly(
    dataset: tuple[str, pa.Table], tmp_path: Path, batch_size: int
) -> None:
    uri, _ = dataset
    with open_sample(uri, tmp_path / "c", seed=9, world_size=2, rank=1) as ds:
        whole = uids(list(ds.batches(batch_size)))
        saved: list[dict[str, Any]] = []
        ds.set_epoch(1)
        ds.set_epoch(0)
        for _ in ds.batches(batch_size):
            saved.append(ds.state_dict())
    assert len(whole) == TOTAL - TOTAL // 2
    with open_sample(uri, tmp_path / "c", seed=9, world_size=2, rank=1) as resumed:
        for state in saved:
            resumed.load_state_dict(state)
            assert uids(list(resumed.batches(batch_size))) == whole[state["position"] :]


def test_a_resume_mid_window_with_another_batch_size_continues_exactly(
    dataset: tuple[str, pa.Table], tmp_path: Path
) -> None:
    uri, _ = dataset
    with open_sample(uri, tmp_path / "c", seed=2) as ds:
        whole = uids(list(ds.batches(100)))
        state = ds.state_dict()
    for position in (1, WINDOW - 1, WINDOW + 13, TOTAL - 3):
        state = {**state, "position": position}
        with open_sample(uri, tmp_path / "c", seed=2) as resumed:
            resumed.load_state_dict(state)
            assert uids(list(resumed.batches(33))) == whole[position:]


def test_a_state_of_another_mode_or_window_is_refused(
    dataset: tuple[str, pa.Table], tmp_path: Path
) -> None:
    uri, _ = dataset
    with open_sample(uri, tmp_path / "c") as ds:
        next(iter(ds.batches(10)))
        state = ds.state_dict()
    assert (state["granularity"], state["window"]) == ("sample", WINDOW)
    with open_sample(uri, tmp_path / "c", window=WINDOW * 2) as other:
        with pytest.raises(errors.StateMismatchError, match="window: state has 200"):
            other.load_state_dict(state)
    with open_sample(uri, tmp_path / "c", shuffle="block") as block:
        with pytest.raises(errors.StateMismatchError, match="granularity: state has 'sample'"):
            block.load_state_dict(state)


def test_a_plan_version_1_state_resumes_with_version_1_semantics(
    dataset: tuple[str, pa.Table], tmp_path: Path
) -> None:
    uri, _ = dataset
    # shuffle=True is block mode, version 1's only shuffled plan.
    with shardcache.open(uri, cache_dir=tmp_path / "c", seed=4, block_size=BLOCK) as ds:
        whole = uids(list(ds.batches(40)))
        ds.set_epoch(1)
        ds.set_epoch(0)
        it = ds.batches(40)
        for _ in range(5):
            next(it)
        state = ds.state_dict()
        it.close()
    v1 = {k: v for k, v in state.items() if k not in ("granularity", "window")}
    v1["plan_version"] = 1
    with shardcache.open(uri, cache_dir=tmp_path / "c", seed=4, block_size=BLOCK) as resumed:
        resumed.load_state_dict(v1)
        assert uids(list(resumed.batches(40))) == whole[200:]
        assert resumed.state_dict()["plan_version"] == plans.PLAN_VERSION
    with open_sample(uri, tmp_path / "c", seed=4) as sample:
        with pytest.raises(errors.StateMismatchError, match="granularity: state has 'block'"):
            sample.load_state_dict(v1)


@pytest.mark.parametrize("shuffle", ["sample", "block", False])
def test_take_returns_the_rows_at_manifest_indices_in_the_order_asked(
    dataset: tuple[str, pa.Table], tmp_path: Path, shuffle: str | bool
) -> None:
    uri, table = dataset
    index = [TOTAL - 1, 0, 299, 300, 470, 470, 982, 5]
    with open_sample(uri, tmp_path / "c", shuffle=shuffle) as ds:
        got = ds.take(index)
        assert pa.Table.from_batches([got]).equals(table.take(pa.array(index)).combine_chunks())
        assert ds.take(np.asarray([7, 3]), columns=["uid"]).to_pydict() == {"uid": [7, 3]}
        assert ds.take([]).num_rows == 0
        # take() does not move the stream.
        assert ds.position == 0
        with pytest.raises(errors.InputError, match=f"sample index {TOTAL} is out of range"):
            ds.take([0, TOTAL])
        with pytest.raises(errors.InputError, match="sample index -1 is out of range"):
            ds.take([-1])
        with pytest.raises(errors.InputError, match="integer sample indices"):
            ds.take([0.5])


def test_take_names_an_index_past_int64s_range_as_it_was_asked(
    dataset: tuple[str, pa.Table], tmp_path: Path
) -> None:
    uri, _ = dataset
    huge = 2**63 + 5
    with open_sample(uri, tmp_path / "c") as ds:
        with pytest.raises(errors.InputError, match=f"sample index {huge} is out of range"):
            ds.take(np.asarray([3, huge], dtype=np.uint64))
        # In range, a uint64 index reads the row it names.
        got = ds.take(np.asarray([TOTAL - 1, 2], dtype=np.uint64), columns=["uid"])
        assert got.to_pydict() == {"uid": [TOTAL - 1, 2]}


def test_skip_batches_in_sample_mode_passes_over_whole_batches(
    dataset: tuple[str, pa.Table], tmp_path: Path
) -> None:
    uri, _ = dataset
    with open_sample(uri, tmp_path / "c", seed=1) as ds:
        whole = uids(list(ds.batches(50)))
        ds.set_epoch(1)
        ds.set_epoch(0)
        it = ds.batches(50)
        first = uids([next(it)])
        ds.skip_batches(2)
        rest = uids(list(it))
    assert first + rest == whole[:50] + whole[150:]


def test_the_ranks_runs_are_the_rows_it_reads_in_sample_mode_after_a_resize_too(
    dataset: tuple[str, pa.Table], tmp_path: Path
) -> None:
    uri, _ = dataset
    offsets = plans.shard_offsets(SHARDS)
    old: list[dict[str, Any]] = []
    for rank in range(2):
        with open_sample(uri, tmp_path / "c", seed=2, rank=rank, world_size=2) as ds:
            runs = ds.runs()  # cached before the state below changes the plan
            read = uids(list(ds.batches(50)))
            assert [offsets[r.shard] + i for r in runs for i in range(r.start, r.stop)] == read
        with open_sample(uri, tmp_path / "c", seed=2, rank=rank, world_size=2) as ds:
            first = next(iter(ds.batches(50)))
            assert first.num_rows == 50
            old.append(ds.state_dict())
    with open_sample(uri, tmp_path / "c", seed=2, rank=0, world_size=3) as ds:
        before = ds.runs()
        ds.load_state_dict(old)
        runs = ds.runs()
        assert runs != before
        read = uids(list(ds.batches(50)))
        assert [offsets[r.shard] + i for r in runs for i in range(r.start, r.stop)] == read


def test_take_names_an_index_past_uint64s_range_and_refuses_an_iterator_saying_so(
    dataset: tuple[str, pa.Table], tmp_path: Path
) -> None:
    uri, _ = dataset
    huge = 2**64 + 7
    with open_sample(uri, tmp_path / "c") as ds:
        # Python ints past uint64 make an array of objects: still an index, named as asked.
        with pytest.raises(errors.InputError, match=f"sample index {huge} is out of range"):
            ds.take([3, huge])
        with pytest.raises(errors.InputError, match=f"sample index {-huge} is out of range"):
            ds.take([-huge, 2])
        with pytest.raises(errors.InputError, match="found generator, an iterator: pass list"):
            ds.take(i for i in (1, 2))
        # Objects that are not ints (a bool among them) are still refused by type.
        with pytest.raises(errors.InputError, match="integer sample indices, found an array"):
            ds.take([huge, True])
        # A range is a sequence, not an iterator: taken.
        assert ds.take(range(2, 0, -1), columns=["uid"]).to_pydict() == {"uid": [2, 1]}
