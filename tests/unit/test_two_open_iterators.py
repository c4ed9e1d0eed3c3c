"""Two `batches()` iterators open on one Dataset share its position in every mode: a
batch one of them hands out is a move for the other, which reads on from there
(docs/reading-plan.md, "Moves between two batches"). Block mode and manifest order used
to walk a cursor of their own each: rows handed out twice, and a state past the epoch's
end that `load_state_dict` refused. Regression tests of the s19 explorer's D6."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

import shardcache
from tests.support import datasets

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("shuffle", [True, False, "sample"])
@pytest.mark.parametrize("threads", [0, 2])
def test_two_open_iterators_hand_out_each_row_once(
    tmp_path: Path, shuffle: bool | str, threads: int
) -> None:
    uri, _ = datasets.write_local(tmp_path / "ds", [13, 7, 9])
    with shardcache.open(
        uri,
        cache_dir=tmp_path / "cache",
        shuffle=shuffle,
        window=8,
        block_size=4,
        gather_threads=threads,
    ) as ds:
        first, second = ds.batches(3), ds.batches(3)
        seen: list[int] = []
        for _ in range(20):
            for it in (first, second):
                batch = next(it, None)
                if batch is not None:
                    seen += batch.column("uid").to_pylist()
        state = ds.state_dict()
        n = len(ds)
        with shardcache.open(
            uri, cache_dir=tmp_path / "cache", shuffle=shuffle, window=8, block_size=4
        ) as plain:
            # The same rows in the same order as one iterator reads them.
            expected = [u for b in plain.batches(3) for u in b.column("uid").to_pylist()]
    repeated = [u for u, c in collections.Counter(seen).items() if c > 1]
    assert not repeated, f"{len(repeated)} rows handed out twice"
    assert seen == expected
    assert state["position"] == n


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_second_iterator_started_mid_epoch_reads_on_from_the_shared_position(
    tmp_path: Path, shuffle: bool
) -> None:
    """A peek iterator opened beside the loop: the loop's next batch follows the peek's,
    and a state taken then resumes exactly."""
    uri, _ = datasets.write_local(tmp_path / "ds", [13, 7, 9])

    def opened() -> shardcache.Dataset:
        return shardcache.open(
            uri, cache_dir=tmp_path / "cache", shuffle=shuffle, window=8, block_size=4
        )

    with opened() as plain:
        expected = [b.column("uid").to_pylist() for b in plain.batches(4)]
    with opened() as ds:
        loop = ds.batches(4)
        got = [next(loop).column("uid").to_pylist(), next(loop).column("uid").to_pylist()]
        got.append(next(ds.batches(4)).column("uid").to_pylist())  # the peek
        got.append(next(loop).column("uid").to_pylist())
        state = ds.state_dict()
    assert got == expected[:4]
    with opened() as resumed:
        resumed.load_state_dict(state)
        assert [b.column("uid").to_pylist() for b in resumed.batches(4)] == expected[4:]


@pytest.mark.parametrize("shuffle", [True, "sample"])
def test_one_dataset_as_two_mixture_sources_is_refused_or_reads_each_row_once(
    tmp_path: Path, shuffle: bool | str
) -> None:
    """The same mechanism through `shardcache.mix({"a": ds, "b": ds})`: one Dataset object
    as two sources (a copy-paste slip)."""
    uri, _ = datasets.write_local(tmp_path / "ds", [13, 7, 9])
    with shardcache.open(
        uri, cache_dir=tmp_path / "cache", shuffle=shuffle, window=8, block_size=4
    ) as ds:
        try:
            mixed = shardcache.mix({"a": ds, "b": ds}, weights={"a": 1, "b": 1}, seed=0)
        except shardcache.errors.InputError:
            return  # a clear refusal is fine
        seen = [u for b in mixed.batches(3, steps=9) for u in b.column("uid").to_pylist()]
    repeated = [u for u, c in collections.Counter(seen).items() if c > 1]
    assert not repeated, f"{len(repeated)} rows handed out twice"
