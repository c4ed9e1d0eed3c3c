"""`shardcache.gather`: rows of several shards in any order, equal to Arrow's `take`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hypothesis
import hypothesis.strategies as st
import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pytest

from shardcache import datasets, errors, gather

pytestmark = pytest.mark.unit

BOUNDED = hypothesis.settings(max_examples=60, deadline=None)


def shard(i: int, n: int) -> pa.RecordBatch:
    rng = np.random.default_rng(i)
    lens = rng.integers(0, 12, n)
    return pa.record_batch(
        {
            "tokens": pa.array(
                [list(range(i * 1000 + k, i * 1000 + k + int(m))) for k, m in enumerate(lens)],
                pa.list_(pa.int32()),
            ),
            "wide": pa.array([[k] * int(m) for k, m in enumerate(lens)], pa.large_list(pa.int64())),
            "text": pa.array([f"{i}-{k}" * int(m) for k, m in enumerate(lens)]),
            "large_text": pa.array([f"{i}:{k}" for k in range(n)], pa.large_string()),
            "blob": pa.array([bytes([k % 256]) * int(m) for k, m in enumerate(lens)], pa.binary()),
            "score": pa.array(rng.random(n)),
            "small": pa.array(rng.integers(-100, 100, n).astype(np.int8)),
            "vec": pa.FixedSizeListArray.from_arrays(
                pa.array(rng.random(n * 3).astype(np.float32)), 3
            ),
            "flag": pa.array(rng.random(n) > 0.5),
            "maybe": pa.array([None if k % 3 == 0 else k for k in range(n)], pa.int64()),
            "record": pa.array([{"a": k, "b": str(k)} for k in range(n)]),
            "nested": pa.array([[[k], [k, i]] for k in range(n)]),
            "category": pa.array([f"c{k % 4}" for k in range(n)]).dictionary_encode(),
        }
    )


def mapped(tmp_path: Path, batches: list[pa.RecordBatch]) -> list[pa.RecordBatch]:
    """The batches as memory-mapped IPC files, as the reader sees shards."""
    out = []
    for i, batch in enumerate(batches):
        path = tmp_path / f"s{i}.arrow"
        with pa.OSFile(str(path), "wb") as f, ipc.new_file(f, batch.schema) as w:
            w.write_batch(batch)
        out.append(datasets.read_shard(path))
    return out


def check(sources: list[pa.RecordBatch], index: np.ndarray) -> None:
    whole = pa.Table.from_batches(sources).combine_chunks()
    sizes = np.cumsum([0] + [len(s) for s in sources])
    source_of = (np.searchsorted(sizes, index, side="right") - 1).astype(np.int64)
    got = gather.gather(sources, source_of, (index - sizes[source_of]).astype(np.int64))
    got.validate(full=True)
    assert pa.Table.from_batches([got]).equals(whole.take(pa.array(index, pa.int64())))


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> list[pa.RecordBatch]:
    tmp = tmp_path_factory.mktemp("gather")
    # Sliced sources too: offsets that do not start at 0.
    return mapped(tmp, [shard(0, 50).slice(3, 40), shard(1, 30), shard(2, 70)])


@BOUNDED
@hypothesis.given(st.lists(st.integers(min_value=0, max_value=139), max_size=300))
def test_a_gather_equals_arrow_take_of_the_same_rows_for_every_type(
    sources: list[pa.RecordBatch], index: list[int]
) -> None:
    check(sources, np.asarray(index, dtype=np.int64))


def test_lists_strings_and_fixed_width_columns_take_no_fallback(
    sources: list[pa.RecordBatch], monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object) -> pa.Array:
        raise AssertionError("fell back to pyarrow.compute.take")

    fast: Callable[..., pa.Array] = refuse
    monkeypatch.setattr(gather, "_fallback", fast)
    names = ["tokens", "wide", "text", "large_text", "blob", "score", "small", "vec"]
    check([s.select(names) for s in sources], np.asarray([139, 0, 5, 44, 40, 5, 100]))


def test_rows_of_one_shard_and_no_rows(sources: list[pa.RecordBatch]) -> None:
    check(sources[1:2], np.asarray([29, 0, 0, 13]))
    empty = gather.gather(sources, np.zeros(0, np.int64), np.zeros(0, np.int64))
    assert empty.num_rows == 0 and empty.schema == sources[0].schema


def test_a_gathered_batch_owns_its_memory_not_the_mappings(
    sources: list[pa.RecordBatch],
) -> None:
    got = gather.gather(sources, np.asarray([2, 0]), np.asarray([1, 1]))
    lo = min(s.column("tokens").values.buffers()[1].address for s in sources)
    addr = got.column("tokens").values.buffers()[1].address
    spans = [
        (b.address, b.address + b.size)
        for s in sources
        for b in s.column("tokens").values.buffers()[1:]
        if b is not None
    ]
    assert lo > 0 and not any(a <= addr < z for a, z in spans)


def ragged(seed: int, n: int, *, nulls: bool, packed: int | None) -> pa.RecordBatch:
    """A shard of the variable-width types the gather copies itself: row lengths
    random (or all `packed`), empty rows, and optionally null rows and null values."""
    rng = np.random.default_rng(seed)
    lens = np.full(n, packed) if packed is not None else rng.integers(0, 40, n)
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(lens, out=offsets[1:])
    total = int(offsets[-1])
    values = pa.array(rng.integers(-(2**31), 2**31 - 1, total).astype(np.int32))
    row_nulls = pa.array(rng.random(n) < 0.2) if nulls else None
    if nulls:
        values = pa.array(values.to_numpy(), mask=rng.random(total) < 0.1)
    text = [bytes(rng.integers(0, 256, int(m)).astype(np.uint8)).hex()[: int(m)] for m in lens]
    return pa.record_batch(
        {
            "tokens": pa.ListArray.from_arrays(pa.array(offsets), values, mask=row_nulls),
            "wide": pa.LargeListArray.from_arrays(
                pa.array(offsets.astype(np.int64)), pa.array(rng.random(total).astype(np.float64))
            ),
            "text": pa.array(text, pa.string()),
            "blob": pa.array([t.encode() for t in text], pa.large_binary()),
            "uid": pa.array(rng.integers(0, 2**62, n)),
            "pair": pa.FixedSizeListArray.from_arrays(
                pa.array(rng.random(2 * n).astype(np.float32)), 2
            ),
        }
    )


@BOUNDED
@hypothesis.given(
    seed=st.integers(0, 2**16),
    sizes=st.lists(st.integers(0, 60), min_size=1, max_size=4),
    cut=st.integers(0, 5),
    nulls=st.booleans(),
    packed=st.none() | st.integers(0, 9),
    draws=st.integers(0, 200),
)
def test_a_gather_of_ragged_sliced_and_null_rows_equals_arrow_take(
    tmp_path_factory: pytest.TempPathFactory,
    seed: int,
    sizes: list[int],
    cut: int,
    nulls: bool,
    packed: int | None,
    draws: int,
) -> None:
    # Shards of random lengths (some empty), each sliced `cut` rows in, as mapped files.
    tmp = tmp_path_factory.mktemp("ragged")
    whole = [ragged(seed + i, n + cut, nulls=nulls, packed=packed) for i, n in enumerate(sizes)]
    sources = [s.slice(cut) for s in mapped(tmp, whole)]
    total = sum(sizes)
    hypothesis.assume(total > 0)
    index = np.random.default_rng(seed).integers(0, total, draws)
    check(sources, index)


def test_rows_of_one_length_are_copied_without_arrow_take(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sources = mapped(tmp_path, [ragged(i, 30, nulls=False, packed=8) for i in range(3)])
    index = np.asarray([89, 0, 31, 31, 64, 2])
    whole = pa.Table.from_batches(sources).combine_chunks()
    expected = whole.take(pa.array(index))

    class Refuse:
        def call(self, *args: object, **kwargs: object) -> pa.Array:
            raise AssertionError("called Arrow's take")

    def refuse(*args: object, **kwargs: object) -> pa.Array:
        raise AssertionError("called pyarrow.compute.take")

    monkeypatch.setattr(pc, "take", refuse)
    monkeypatch.setattr(gather, "_TAKE", Refuse())
    sizes = np.asarray([0, 30, 60])
    source_of = np.searchsorted(sizes, index, side="right") - 1
    got = gather.gather(sources, source_of, index - sizes[source_of])
    got.validate(full=True)
    assert pa.Table.from_batches([got]).equals(expected)


def test_fixed_width_rows_come_from_any_shard_in_one_copy_with_empty_shards_between(
    tmp_path: Path,
) -> None:
    shards = [ragged(0, 5, nulls=False, packed=None), ragged(1, 0, nulls=False, packed=None)]
    sources = mapped(tmp_path, [*shards, ragged(2, 7, nulls=False, packed=None)])
    check([s.select(["uid", "pair"]) for s in sources], np.asarray([11, 0, 5, 4, 4, 6]))


def test_fixed_width_values_at_any_byte_alignment_gather_the_same_bytes() -> None:
    # Arrow's buffers are 64-byte aligned, so the mapped shards' values are viewed as
    # integers of their width; values that start one byte off (a foreign buffer) are
    # not, and take the item view: the same bytes either way.
    raw = pa.py_buffer(bytes(1) + np.arange(100, 105, dtype=np.int64).tobytes())
    odd = pa.record_batch([pa.Array.from_buffers(pa.int64(), 5, [None, raw.slice(1)])], ["v"])
    even = pa.record_batch([pa.array(np.arange(7, dtype=np.int64))], ["v"])
    for sources, aligned in (([even, even.slice(2)], True), ([even, odd], False)):
        gatherer = gather.Gatherer(sources)
        sizes = np.cumsum([0] + [len(s) for s in sources])
        index = np.asarray([len(sources[0]) + 1, 0, sizes[-1] - 1, 3, 3])
        source_of = (np.searchsorted(sizes, index, side="right") - 1).astype(np.int64)
        got = gatherer.gather(source_of, (index - sizes[source_of]).astype(np.int64))
        got.validate(full=True)
        whole = pa.Table.from_batches(sources).combine_chunks()
        assert pa.Table.from_batches([got]).equals(whole.take(pa.array(index)))
        fixed = gatherer._fixed[0]
        assert fixed is not None and (fixed.words is not None) == aligned


def test_the_rows_first_and_last_bytes_are_read_first_and_nothing_past_the_span(
    tmp_path: Path,
) -> None:
    # Empty rows at the start and the end of each source: the last source's last row
    # starts past the span's last byte, where a read would be out of the mapping.
    texts = [["", "ab", "cdef", ""], ["g", "", ""]]
    sources = mapped(tmp_path, [pa.record_batch({"text": pa.array(t)}) for t in texts])
    built = gather._Span.build([s.column(0) for s in sources])
    assert built is not None
    read: list[npt.NDArray[np.int64]] = []

    class Recording(np.ndarray):  # type: ignore[type-arg]
        def __getitem__(self, key: Any) -> Any:
            read.append(np.asarray(key).copy())
            return np.asarray(self)[key]

    span = dataclasses.replace(built, data=built.data.view(Recording))
    source_of = np.asarray([1, 0, 0, 1, 1, 0, 0], dtype=np.int64)
    row_of = np.asarray([0, 2, 1, 2, 1, 0, 3], dtype=np.int64)
    got = span.take(source_of, row_of)
    assert got is not None and got.to_pylist() == ["g", "cdef", "ab", "", "", "", ""]
    (edges,) = read
    data = bytes(built.data)
    assert all(-len(data) <= e < len(data) for e in edges)
    # Each non-empty row's first and last byte, in the asked order.
    starts, ends = edges[: len(row_of)], edges[len(row_of) :]
    assert [chr(data[i]) for i in starts[:3]] == ["g", "c", "a"]
    assert [chr(data[i]) for i in ends[:3]] == ["g", "f", "b"]


def views(i: int, n: int) -> pa.RecordBatch:
    """A shard of the types Arrow's `take` has no kernel for: views (what Polars
    writes), inline (up to 12 bytes) and not, and run-end encoded columns; with nulls,
    and inside structs and lists."""
    text = [None if k % 5 == 0 else f"{i}-{k}" + "long text " * (k % 3) for k in range(n)]
    runs = [f"run {k // 4}" if k % 7 else None for k in range(i * n, (i + 1) * n)]
    return pa.record_batch(
        {
            "text": pa.array(text, pa.string_view()),
            "blob": pa.array([t.encode() if t else None for t in text], pa.binary_view()),
            "runs": pc.run_end_encode(pa.array(runs)),
            "record": pa.array(
                [None if k % 6 == 1 else {"t": text[k], "k": k} for k in range(n)],
                pa.struct([("t", pa.string_view()), ("k", pa.int64())]),
            ),
            "tags": pa.array(
                [None if k % 4 == 3 else [text[k], "x" * (k % 20)][: k % 3] for k in range(n)],
                pa.large_list(pa.string_view()),
            ),
        }
    )


def test_view_and_run_end_encoded_columns_gather_as_their_rows_in_their_type(
    tmp_path: Path,
) -> None:
    sources = mapped(tmp_path, [views(0, 40), views(1, 25)])
    sources = [sources[0].slice(3, 30), sources[1]]  # offsets that do not start at 0
    index = np.asarray([54, 0, 7, 7, 29, 31, 40, 12, 3], dtype=np.int64)
    sizes = np.cumsum([0] + [len(s) for s in sources])
    source_of = (np.searchsorted(sizes, index, side="right") - 1).astype(np.int64)
    got = gather.gather(sources, source_of, (index - sizes[source_of]).astype(np.int64))
    got.validate(full=True)
    assert got.schema == sources[0].schema
    rows = pa.Table.from_batches(sources).to_pylist()
    assert got.to_pylist() == [rows[i] for i in index]
    # Copies of the rows: a held batch keeps no shard's mapping alive.
    spans = [
        (b.address, b.address + b.size)
        for s in sources
        for column in s.columns
        for b in column.buffers()
        if b is not None and b.size
    ]
    for column in got.columns:
        for b in column.buffers():
            assert b is None or not any(a <= b.address < z for a, z in spans)


def test_a_column_no_gather_can_take_is_refused_naming_it(tmp_path: Path) -> None:
    kind = pa.map_(pa.string_view(), pa.int64())
    sources = mapped(tmp_path, [pa.record_batch({"m": pa.array([[("a", 1)]] * 3, kind)})])
    with pytest.raises(errors.InputError, match=r"cannot gather column 'm' of type map<"):
        gather.gather(sources, np.zeros(2, np.int64), np.asarray([2, 0]))
