"""`shardcache.batching.Reader`: a rank's stream split across loader processes, packed
token sequences, and resumable state, without any framework."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pytest

import shardcache
from shardcache import batching, errors, gather
from tests.support import datasets

pytestmark = pytest.mark.unit

Opener = Callable[..., shardcache.Dataset]

SHARDS = [40, 25, 33, 17]


@pytest.fixture
def uri(tmp_path: Path) -> str:
    datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / "ds"), SHARDS)
    return str(tmp_path / "ds")


@pytest.fixture
def open_ds(uri: str, tmp_path: Path) -> Iterator[object]:
    opened: list[shardcache.Dataset] = []

    def opener(**kw: object) -> shardcache.Dataset:
        # Small shuffle blocks: most batches cross a block or shard boundary.
        ds = shardcache.open(uri, cache_dir=tmp_path / "cache", block_size=5, **kw)  # type: ignore[arg-type]
        opened.append(ds)
        return ds

    yield opener
    for ds in opened:
        ds.close()


def uids(batch: batching.HostBatch) -> list[int]:
    return [u for piece in batch.pieces for u in piece.column("uid").to_pylist()]


def tokens(batch: batching.HostBatch) -> list[int]:
    return [t for arr in batch.tokens for t in arr.to_pylist()]


def stream(ds: shardcache.Dataset) -> list[int]:
    return [u for b in ds.batches(7) for u in b.column("uid").to_pylist()]


def test_pieces_concatenate_to_the_batches_of_the_plain_path(open_ds) -> None:  # type: ignore[no-untyped-def]
    plain = [b.column("uid").to_pylist() for b in open_ds().batches(7)]
    pieces = [
        batching.concat_pieces(p).column("uid").to_pylist() for p in open_ds().batch_pieces(7)
    ]
    assert pieces == plain
    assert any(len(p) > 1 for p in open_ds().batch_pieces(7))


@pytest.mark.parametrize("count", [1, 2, 3, 4])
def test_workers_together_read_the_rank_stream_in_order_once(open_ds, count: int) -> None:  # type: ignore[no-untyped-def]
    expected = stream(open_ds(rank=1, world_size=2))
    options = batching.Options(batch_size=7, columns=("uid",))
    per_worker = [
        [
            uids(b)
            for b in batching.Reader(
                open_ds(rank=1, world_size=2), options, batching.Split(i, count)
            )
        ]
        for i in range(count)
    ]
    # A DataLoader takes one batch from each worker in turn.
    merged = [u for group in itertools.zip_longest(*per_worker) for b in group if b for u in b]
    assert merged == expected


@pytest.mark.parametrize("count", [1, 3])
@pytest.mark.parametrize("stop", [0, 1, 2, 5])
def test_resume_from_each_workers_state_yields_exactly_the_rest(
    open_ds: Opener, count: int, stop: int
) -> None:
    options = batching.Options(batch_size=6, columns=("uid",))
    for index in range(count):
        full = [uids(b) for b in batching.Reader(open_ds(), options, batching.Split(index, count))]
        first = batching.Reader(open_ds(), options, batching.Split(index, count))
        it = iter(first)
        head = [uids(next(it)) for _ in range(min(stop, len(full)))]
        resumed = batching.Reader(open_ds(), options, batching.Split(index, count))
        resumed.load_state_dict(first.state_dict())
        assert head + [uids(b) for b in resumed] == full


@pytest.mark.parametrize("length", [1, 4, 9, 50])
def test_packing_emits_every_token_once_in_order(open_ds, length: int) -> None:  # type: ignore[no-untyped-def]
    all_tokens = [
        t for b in open_ds().batches(100) for row in b.column("tokens").to_pylist() for t in row
    ]
    options = batching.Options(batch_size=3, columns=("tokens",), pack=length, pad_value=-1)
    out = list(batching.Reader(open_ds(), options))
    flat = [t for b in out for t in tokens(b)]
    assert all(b.shape == (3, length) for b in out[:-1])
    last = out[-1]
    assert last.shape is not None and last.shape[1] == length
    pad = len(flat) - len(all_tokens)
    assert 0 <= pad < length
    assert flat[: len(all_tokens)] == all_tokens and flat[len(all_tokens) :] == [-1] * pad


def test_packing_with_drop_last_drops_only_the_tail(open_ds) -> None:  # type: ignore[no-untyped-def]
    all_tokens = [
        t for b in open_ds().batches(100) for row in b.column("tokens").to_pylist() for t in row
    ]
    options = batching.Options(batch_size=2, columns=("tokens",), pack=8, drop_last=True)
    flat = [t for b in batching.Reader(open_ds(), options) for t in tokens(b)]
    assert len(flat) == len(all_tokens) // 16 * 16
    assert flat == all_tokens[: len(flat)]


@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("stop", [1, 3, 7])
def test_packed_resume_carries_the_remainder_exactly(open_ds, count: int, stop: int) -> None:  # type: ignore[no-untyped-def]
    options = batching.Options(batch_size=2, columns=("tokens",), pack=11)
    for index in range(count):
        full = [
            tokens(b) for b in batching.Reader(open_ds(), options, batching.Split(index, count))
        ]
        first = batching.Reader(open_ds(), options, batching.Split(index, count))
        it = iter(first)
        head = [tokens(next(it)) for _ in range(min(stop, len(full)))]
        state = first.state_dict()
        resumed = batching.Reader(open_ds(), options, batching.Split(index, count))
        resumed.load_state_dict(state)
        assert head + [tokens(b) for b in resumed] == full


def test_packed_state_is_small_and_json(open_ds) -> None:  # type: ignore[no-untyped-def]
    import json

    reader = batching.Reader(
        open_ds(), batching.Options(batch_size=2, columns=("tokens",), pack=11)
    )
    next(iter(reader))
    assert len(json.dumps(reader.state_dict())) < 1024


def test_state_from_another_worker_count_is_refused(open_ds) -> None:  # type: ignore[no-untyped-def]
    options = batching.Options(batch_size=4)
    state = batching.Reader(open_ds(), options, batching.Split(0, 2)).state_dict()
    with pytest.raises(errors.StateMismatchError, match="split: state has \\[0, 2\\]"):
        batching.Reader(open_ds(), options, batching.Split(0, 3)).load_state_dict(state)


def test_options_take_numpy_integers_as_ints_and_refuse_other_types(open_ds) -> None:  # type: ignore[no-untyped-def]
    import json

    import numpy as np

    options = batching.Options(batch_size=np.int64(4), pack=np.int32(5), columns=("tokens",))  # type: ignore[arg-type]
    assert (type(options.batch_size), type(options.pack)) == (int, int)
    reader = batching.Reader(open_ds(), options)
    next(iter(reader))
    json.dumps(reader.state_dict())
    for field, value in [
        ("batch_size", 2.5),
        ("batch_size", True),
        ("batch_size", "4"),
        ("pack", 0),
    ]:
        kw: dict[str, Any] = {"batch_size": 4, field: value}
        with pytest.raises(errors.InputError, match=f"^{field}: expected an int >= 1, found"):
            batching.Options(**kw)


def test_a_reader_state_refused_for_its_skip_leaves_the_reader_where_it_was(open_ds) -> None:  # type: ignore[no-untyped-def]
    options = batching.Options(batch_size=3, columns=("tokens",), pack=4)
    saved = batching.Reader(open_ds(), options)
    it = iter(saved)
    for _ in range(3):
        next(it)
    state = saved.state_dict()
    reader = batching.Reader(open_ds(), options)
    before = reader.state_dict()
    for bad in (-1, "2", None):
        with pytest.raises(errors.InputError, match="reader state: skip"):
            reader.load_state_dict({**state, "skip": bad})
        assert reader.state_dict() == before and reader.dataset.position == 0


def test_packing_refuses_a_column_that_is_not_a_token_list(open_ds) -> None:  # type: ignore[no-untyped-def]
    options = batching.Options(batch_size=2, pack=4, pack_column="uid")
    with pytest.raises(errors.InputError, match="expected one of the list columns"):
        next(iter(batching.Reader(open_ds(), options)))


def test_pad_type_follows_the_token_type() -> None:
    assert pa.array([0], type=pa.int32()).type == pa.int32()


@pytest.mark.parametrize("count", [2, 3])
@pytest.mark.parametrize("threads", [0, 2])
def test_sample_mode_workers_read_the_stream_once_and_gather_only_their_own_batches(
    open_ds: Opener, monkeypatch: pytest.MonkeyPatch, count: int, threads: int
) -> None:
    sample: dict[str, Any] = dict(shuffle="sample", window=30, seed=4, gather_threads=threads)
    expected = stream(open_ds(rank=1, world_size=2, **sample))
    gathers: list[int] = []
    original = gather.Gatherer.gather

    def counted(self: gather.Gatherer, source_of: Any, row_of: Any) -> pa.RecordBatch:
        gathers.append(len(row_of))  # list.append: safe from the pool's threads
        return original(self, source_of, row_of)

    monkeypatch.setattr(gather.Gatherer, "gather", counted)
    options = batching.Options(batch_size=7, columns=("uid",))
    per_worker = [
        [
            uids(b)
            for b in batching.Reader(
                open_ds(rank=1, world_size=2, **sample), options, batching.Split(i, count)
            )
        ]
        for i in range(count)
    ]
    merged = [u for group in itertools.zip_longest(*per_worker) for b in group if b for u in b]
    assert merged == expected
    # Every batch gathered once, by the worker it is dealt to (not by every worker):
    # the rows gathered are the rows handed out (gathering ahead copies several of a
    # worker's batches at once, so gathers and batches need not pair up).
    assert sum(gathers) == sum(len(b) for w in per_worker for b in w)


@pytest.mark.parametrize("pack", [None, 5])
@pytest.mark.parametrize("stop", [0, 1, 4])
def test_sample_mode_worker_resume_from_each_state_yields_exactly_the_rest(
    open_ds: Opener, pack: int | None, stop: int
) -> None:
    sample: dict[str, Any] = dict(shuffle="sample", window=30, seed=2, gather_threads=2)
    column = "uid" if pack is None else "tokens"
    options = batching.Options(batch_size=6, columns=(column,), pack=pack)
    show: Callable[[batching.HostBatch], list[int]] = uids if pack is None else tokens
    for index in range(3):
        split = batching.Split(index, 3)
        full = [show(b) for b in batching.Reader(open_ds(**sample), options, split)]
        first = batching.Reader(open_ds(**sample), options, split)
        it = iter(first)
        head = [show(next(it)) for _ in range(min(stop, len(full)))]
        resumed = batching.Reader(open_ds(**sample), options, split)
        resumed.load_state_dict(first.state_dict())
        assert head + [show(b) for b in resumed] == full


def test_a_bad_stride_is_refused(open_ds: Opener) -> None:
    with pytest.raises(errors.InputError, match="stride must be an int >= 1, got 0"):
        next(open_ds().batch_pieces(7, stride=0))
