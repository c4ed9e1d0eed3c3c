"""With `drop_last`, the rows after a rank's last whole batch are never handed out; the
state says the epoch is done. They are recorded as a skip, so `shardcache lineage` (which
rebuilds what each rank read from its states) says they were skipped, not read."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

import shardcache
from shardcache import batching, states
from shardcache.lineage import history, queries
from tests.support import datasets

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("shuffle", [True, "sample", False])
def test_lineage_says_the_rows_drop_last_trimmed_were_skipped_not_read(
    tmp_path: Path, shuffle: bool | str
) -> None:
    uri, _ = datasets.write_local(tmp_path / "ds", [9, 6])  # ranks of 7 and 8 rows
    handed: dict[int, list[int]] = {}
    chains: dict[int, list[history.Checkpoint]] = {}
    for rank in range(2):
        with shardcache.open(
            uri, cache_dir=tmp_path / "cache", rank=rank, world_size=2, shuffle=shuffle,
            window=8, block_size=4,
        ) as ds:  # fmt: skip
            handed[rank] = [
                u for b in ds.batches(3, drop_last=True) for u in b.column("uid").to_pylist()
            ]
            state = ds.state_dict()
            digest, shard_rows = ds.manifest.digest, [s.rows for s in ds.manifest.shards]
            assert state["position"] == len(ds)  # the epoch is done
            trimmed = [s for s in state["skips"] if s["epoch"] == 0]
            assert trimmed == [{"epoch": 0, "start": 6, "stop": len(ds)}]
        chains[rank] = [history.Checkpoint(1, states.parse(state))]
    assert [len(h) for h in handed.values()] == [6, 6]
    hist = history.build(digest, shard_rows, chains)
    got = queries.reads(hist, range(15))
    read = {(r.rank, r.index) for r in got if r.status == "read"}
    assert read == {(rank, uid) for rank, uids in handed.items() for uid in uids}
    skipped = {r.index for r in got if r.status == "skipped"}
    assert skipped == set(range(15)) - {u for uids in handed.values() for u in uids}
    assert len(skipped) == 3


def test_a_drop_last_epoch_that_ends_on_a_whole_batch_records_no_skip(tmp_path: Path) -> None:
    uri, _ = datasets.write_local(tmp_path / "ds", [8, 8])
    with shardcache.open(uri, cache_dir=tmp_path / "cache", rank=0, world_size=2) as ds:
        assert sum(b.num_rows for b in ds.batches(4, drop_last=True)) == 8
        assert ds.state_dict()["skips"] == []


@pytest.mark.parametrize("workers", [1, 2])
def test_a_loader_state_taken_at_the_last_whole_batch_loads_and_reads_nothing_again(
    tmp_path: Path, workers: int
) -> None:
    """The dataset records the trim as it makes the last batch, before the loader hands
    it out: a loader state then stands at its cursor, without a skip ahead of it."""
    uri, _ = datasets.write_local(tmp_path / "ds", [9, 6])
    options = batching.Options(batch_size=3, columns=("uid",), drop_last=True)

    def reader(index: int) -> batching.Reader:
        ds = shardcache.open(uri, cache_dir=tmp_path / "cache", rank=1, world_size=2)
        opened.append(ds)
        return batching.Reader(ds, options, batching.Split(index, workers))

    opened: list[shardcache.Dataset] = []
    try:
        for index in range(workers):
            first = reader(index)
            got = [b for b in itertools.islice(first, 2 // workers)]
            assert sum(p.num_rows for b in got for p in b.pieces) == 6 // workers
            state = first.state_dict()
            again = reader(index)
            again.load_state_dict(state)  # was refused: a skip ahead of the position
            assert list(again) == []
            assert again.state_dict()["dataset"]["position"] == 8
    finally:
        for ds in opened:
            ds.close()
