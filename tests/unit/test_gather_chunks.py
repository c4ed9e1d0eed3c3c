"""Chunks: consecutive sample-mode batches of one window gathered by one copy
(`selections.gather_many`) and handed out as slices by `gather_ahead.gathered`, equal
to each batch gathered alone, in order, never mixing windows, the first chunks small."""

from __future__ import annotations

import threading
from collections.abc import Generator, Iterator, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from shardcache import gather, gather_ahead, selections
from tests.unit import test_gather

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> list[pa.RecordBatch]:
    tmp: Path = tmp_path_factory.mktemp("chunks")
    # Every type (the fallback's too), sliced sources among them.
    shards = [test_gather.shard(0, 50).slice(3, 40), test_gather.shard(1, 30)]
    return test_gather.mapped(tmp, [*shards, test_gather.shard(2, 70)])


def selections_of(
    gatherer: gather.Gatherer, sizes: Sequence[int], seed: int
) -> list[selections.Selection]:
    """Selections of `sizes` rows each, at random over the gatherer's sources (which
    stand for a whole manifest here: shard s is source s)."""
    rows = [len(s) for s in gatherer.sources]
    offsets = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64)
    total = int(sum(rows))
    slots = np.arange(len(rows), dtype=np.int64)
    rng = np.random.default_rng(seed)
    return [
        selections.Selection(gatherer, rng.integers(0, total, n), offsets, total, slots, [])
        for n in sizes
    ]


def test_a_chunk_gathers_each_batch_as_its_own_gather_would(
    sources: list[pa.RecordBatch],
) -> None:
    chunk = selections_of(gather.Gatherer(sources), [7, 1, 0, 30, 12], seed=3)
    got = selections.gather_many(chunk)
    assert [b.num_rows for b in got] == [7, 1, 0, 30, 12]
    for batch, selection in zip(got, chunk, strict=True):
        batch.validate(full=True)
        assert batch.equals(selection.gather())


def test_a_chunk_is_one_copy_its_batches_slices_of_it(sources: list[pa.RecordBatch]) -> None:
    chunk = selections_of(gather.Gatherer(sources), [5, 6], seed=4)
    first, second = selections.gather_many(chunk)
    values = [b.column("tokens").values.buffers()[1] for b in (first, second)]
    assert values[0].address == values[1].address


def test_a_chunk_of_two_windows_is_refused(sources: list[pa.RecordBatch]) -> None:
    chunk = selections_of(gather.Gatherer(sources), [3], seed=5)
    chunk += selections_of(gather.Gatherer(sources), [3], seed=6)
    with pytest.raises(ValueError, match="different gatherers"):
        selections.gather_many(chunk)


def test_chunks_hand_out_every_batch_in_order_equal_to_its_own_gather(
    sources: list[pa.RecordBatch], monkeypatch: pytest.MonkeyPatch
) -> None:
    windows = [gather.Gatherer(sources), gather.Gatherer(sources)]
    planned = selections_of(windows[0], [4] * 20, seed=7) + selections_of(
        windows[1], [4] * 9, seed=8
    )
    chunks: list[tuple[int, int]] = []
    many = selections.gather_many

    def recorded(chunk: Sequence[selections.Selection]) -> list[pa.RecordBatch]:
        chunks.append((len(chunk), windows.index(chunk[0].gatherer)))
        return many(chunk)

    monkeypatch.setattr(selections, "gather_many", recorded)
    # Room for 6 batches of 4 rows a chunk (the sources' mean row size, not the rows').
    room = int(6 * 4 * windows[0].row_bytes) + 1

    def items() -> Generator[tuple[int, selections.Selection], None, None]:
        yield from enumerate(planned)

    got = list(gather_ahead.gathered(items(), threads=2, chunk_bytes=room))
    assert [k for k, _ in got] == list(range(len(planned)))
    for (_, batch), selection in zip(got, planned, strict=True):
        assert batch.equals(selection.gather())
    # The first chunks grow 1, 2, 4, then as many as fit; a window's end cuts a chunk.
    assert chunks == [(1, 0), (2, 0), (4, 0), (6, 0), (6, 0), (1, 0), (6, 1), (3, 1)]


def test_chunks_are_bounded_by_bytes_and_by_a_batch_count() -> None:
    class Sized:
        def __init__(self, rows: int, row_bytes: float) -> None:
            self.rows = rows
            self.gatherer = type("G", (), {"row_bytes": row_bytes})()

        def __len__(self) -> int:
            return self.rows

    def fit(rows: int, row_bytes: float, room: int) -> int:
        return gather_ahead.chunk_batches(Sized(rows, row_bytes), room)  # type: ignore[arg-type]

    assert fit(256, 4096.0, 8 << 20) == 8
    assert fit(256, 4096.0, 1 << 20) == 1
    # A batch larger than the room is gathered alone; tiny ones stop at the count.
    assert fit(256, 1 << 20, 8 << 20) == 1
    assert fit(1, 1.0, 8 << 20) == gather_ahead.MAX_CHUNK_BATCHES


class Pulled:
    """Planned selections as (key, selection) items, counting those the gatherer pulled."""

    def __init__(self, planned: Sequence[selections.Selection]) -> None:
        self.planned = planned
        self.count = 0

    def __iter__(self) -> Iterator[tuple[int, selections.Selection]]:
        for n, selection in enumerate(self.planned):
            self.count = n + 1
            yield n, selection


def test_chunks_pull_at_most_most_ahead_items_beyond_the_one_handed_over(
    sources: list[pa.RecordBatch],
) -> None:
    gatherer = gather.Gatherer(sources)
    planned = selections_of(gatherer, [1] * 400, seed=9)
    pulled = Pulled(planned)

    # Room for far more than MAX_CHUNK_BATCHES batches a chunk.
    ahead = gather_ahead.gathered(iter(pulled), threads=2, chunk_bytes=1 << 30)
    for handed in range(1, 200):
        next(ahead)
        assert pulled.count <= handed + gather_ahead.most_ahead(2)
    ahead.close()
    assert gather_ahead.most_ahead(1) == 0


def test_a_failed_chunk_raises_after_the_chunks_before_it_and_stops_the_threads(
    sources: list[pa.RecordBatch], monkeypatch: pytest.MonkeyPatch
) -> None:
    planned = selections_of(gather.Gatherer(sources), [2] * 30, seed=10)
    many = selections.gather_many

    def failing(chunk: Sequence[selections.Selection]) -> list[pa.RecordBatch]:
        if chunk[0] is planned[7]:  # the third chunk: batches 7 to 14
            raise OSError("chunk failed")
        return many(chunk)

    monkeypatch.setattr(selections, "gather_many", failing)

    def items() -> Generator[tuple[int, selections.Selection], None, None]:
        yield from enumerate(planned)

    got: list[int] = []
    with pytest.raises(OSError, match="chunk failed"):
        for key, _ in gather_ahead.gathered(items(), threads=2, chunk_bytes=1 << 30):
            got.append(key)
    # Chunks of 1, 2 and 4 batches came first, whole; nothing of the failed one.
    assert got == list(range(7))
    assert not [t for t in threading.enumerate() if t.name.startswith(gather_ahead.THREAD_NAME)]


@pytest.mark.parametrize("chunk_bytes", [0, 1 << 30])
def test_gathering_ahead_plans_into_at_most_three_windows_the_callers_included(
    sources: list[pa.RecordBatch], chunk_bytes: int
) -> None:
    # Small windows of 3 batches each: without the bound, 8 chunks ahead would plan (and
    # lease) 8 windows.
    planned = [
        s for w in range(30) for s in selections_of(gather.Gatherer(sources), [1] * 3, seed=w)
    ]
    pulled = Pulled(planned)

    ahead = gather_ahead.gathered(iter(pulled), threads=4, chunk_bytes=chunk_bytes)
    most = 0
    for handed, _ in ahead:
        # The caller's window, the next, and the window of the next chunk's first batch.
        windows = {id(s.gatherer) for s in planned[handed : pulled.count]}
        most = max(most, len(windows))
        assert len(windows) <= 3
    assert most == 3
