"""Sample-mode batches gathered on the device (`_device_gather`), carried out on the CPU.

On the CPU the prefetcher's window path runs the same torch ops as on a GPU: each
window's rows copied once into a table (host to host), each batch gathered from it by
index. Every batch must equal the plain path's (the CPU gather, then collation) across
windows, shards, epochs, seeds, ranks, an elastic-free resume mid-window and mixtures;
what the device path does not cover must come through today's path unchanged.
"""

from __future__ import annotations

import itertools
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pytest
import torch

import shardcache
import shardcache.torch
from shardcache import batching, errors, gather, selections
from shardcache.torch import _device_gather, _host_memory
from tests.support import datasets

pytestmark = [pytest.mark.integration]

#: Row counts that are multiples of neither the batch (6), the block (5) nor the window
#: (16): batches cross window and shard boundaries, windows span shards, and the epoch
#: ends on a short batch.
SHARDS = [40, 25, 33, 17]
WINDOW = 16


@pytest.fixture
def make(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    uri = str(tmp_path / "ds")
    datasets.write_dataset(pafs.LocalFileSystem(), uri, SHARDS)
    made: list[shardcache.torch.IterableDataset] = []

    def factory(**kw: Any) -> shardcache.torch.IterableDataset:
        options: dict[str, Any] = {
            "batch_size": 6,
            "columns": ["uid", "tokens"],
            "shuffle": "sample",
            "window": WINDOW,
            "block_size": 5,
        }
        options.update(kw)
        ds = shardcache.torch.IterableDataset(uri, cache_dir=str(tmp_path / "cache"), **options)
        made.append(ds)
        return ds

    yield factory
    for ds in made:
        ds.close()


def _assert_equal(
    got: list[dict[str, torch.Tensor]], expected: list[dict[str, torch.Tensor]]
) -> None:
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert list(a.keys()) == list(b.keys()), i
        for key in a:
            assert a[key].dtype == b[key].dtype, (i, key)
            assert a[key].shape == b[key].shape, (i, key)
            assert torch.equal(a[key], b[key]), (i, key)


def _on_device(prefetcher: shardcache.torch.DevicePrefetcher) -> list[dict[str, torch.Tensor]]:
    # `_windowed` is the path a GPU takes; on the CPU `iter()` would take the plain one.
    return list(prefetcher._windowed())


class _RegisterAll:
    def register(self, address: int, size: int) -> bool:
        return True

    def unregister(self, address: int) -> None:
        pass


EXTRAS = [
    {},
    {"lists": "padded"},
    {"lists": "padded", "pad_to": 16, "pad_value": -1},
    {"drop_last": True},
    {"batch_size": 1},
    {"batch_size": 40},
    {"seed": 3, "epoch": 2},
    {"rank": 1, "world_size": 3},
    {"columns": ["tokens"]},
    {"columns": ["uid"]},
    {"window": 7, "block_size": 3, "columns": ["tokens", "uid"]},
]


@pytest.mark.parametrize("extra", EXTRAS)
def test_device_gather_yields_the_plain_paths_tensors(make: Any, extra: dict[str, Any]) -> None:
    plain = list(make(**extra))
    prefetcher = shardcache.torch.DevicePrefetcher(make(**extra), device="cpu")
    _assert_equal(_on_device(prefetcher), plain)
    stats = prefetcher.stats
    assert stats.fallback == ""
    assert stats.device_gathered == len(plain) and stats.cpu_gathered == 0
    # Every window copied once: fewer copies than batches once batches are small.
    assert stats.gather_windows > 0
    if extra.get("batch_size", 6) < WINDOW:
        assert stats.gather_windows < len(plain)


def test_each_window_is_copied_once_per_pass(make: Any) -> None:
    ds = make(batch_size=4)
    prefetcher = shardcache.torch.DevicePrefetcher(ds, device="cpu")
    batches = _on_device(prefetcher)
    total = sum(SHARDS)
    windows = -(-total // WINDOW)
    assert prefetcher.stats.gather_windows == windows
    assert sum(len(b["uid"]) for b in batches) == total
    # Nothing stays on the device after the pass.
    assert prefetcher._gathers is not None and prefetcher._gathers.resident == 0


def test_epochs_through_set_epoch_match_the_plain_path(make: Any) -> None:
    plain_ds, fast_ds = make(), make()
    prefetcher = shardcache.torch.DevicePrefetcher(fast_ds, device="cpu")
    for epoch in range(3):
        plain_ds.set_epoch(epoch)
        prefetcher.set_epoch(epoch)
        _assert_equal(_on_device(prefetcher), list(plain_ds))


def test_registered_windows_are_copied_from_the_mappings(make: Any) -> None:
    plain = list(make())
    ds = make()
    prefetcher = shardcache.torch.DevicePrefetcher(ds, device="cpu")
    registry = _host_memory.Registry(_RegisterAll(), settle=lambda: None)
    ds.shardcache_dataset().add_mapping_listener(registry)
    prefetcher._registered = registry
    _assert_equal(_on_device(prefetcher), plain)
    stats = prefetcher.stats
    # Every window's values came straight from the mappings; no token staged.
    assert stats.direct_bytes > 0 and stats.staged_bytes == 0
    assert stats.device_gathered == len(plain)


@pytest.mark.parametrize("stop", [1, 2, 5, 9])
def test_a_state_taken_mid_window_resumes_at_the_exact_next_batch(make: Any, stop: int) -> None:
    plain = list(make())
    first = shardcache.torch.DevicePrefetcher(make(), device="cpu")
    it = first._windowed()
    assert isinstance(it, Generator)
    head = [next(it) for _ in range(stop)]
    # Batches gathered ahead but not handed over are not in the state.
    assert first.stats.batches == stop
    state = first.state_dict()
    it.close()
    again = shardcache.torch.DevicePrefetcher(make(), device="cpu")
    again.load_state_dict(state)
    _assert_equal(head + _on_device(again), plain)


def test_device_gather_off_takes_todays_path(make: Any) -> None:
    plain = list(make())
    prefetcher = shardcache.torch.DevicePrefetcher(make(), device="cpu", device_gather=False)
    _assert_equal(_on_device(prefetcher), plain)
    assert prefetcher.stats.device_gathered == 0 and prefetcher.stats.gather_windows == 0


@pytest.mark.parametrize("extra", [{"pack": 5}, {"pack": 7, "drop_last": True}])
def test_packed_batches_are_gathered_on_the_cpu_as_before(make: Any, extra: dict[str, Any]) -> None:
    plain = list(make(columns=["tokens"], **extra))
    prefetcher = shardcache.torch.DevicePrefetcher(make(columns=["tokens"], **extra), device="cpu")
    _assert_equal(_on_device(prefetcher), plain)
    assert prefetcher.stats.device_gathered == 0 and prefetcher.stats.fallback == ""


def test_a_gather_that_fails_falls_back_to_the_cpu_gather(
    make: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls = itertools.count()

    def flaky(self: Any, chosen: Any, copying: Any) -> Any:
        if next(calls) == 2:
            raise RuntimeError("CUDA error: out of memory (simulated)")
        return real(self, chosen, copying)

    real = _device_gather.DeviceGather.gather
    monkeypatch.setattr(_device_gather.DeviceGather, "gather", flaky)
    plain = list(make())
    prefetcher = shardcache.torch.DevicePrefetcher(make(), device="cpu")
    _assert_equal(_on_device(prefetcher), plain)
    stats = prefetcher.stats
    assert "simulated" in stats.fallback and "gathering on the CPU" in caplog.text
    assert stats.device_gathered == 2 and stats.cpu_gathered == len(plain) - 2
    assert prefetcher.device_gather is False  # and for later passes too


def test_a_column_the_device_cannot_gather_goes_through_todays_path(make: Any) -> None:
    # Strings have no tensor form: the plain path refuses them, and so must this one,
    # with the same error, after the device gather gave the window up.
    with pytest.raises(errors.InputError, match="text"):
        list(make(columns=["uid", "text"]))
    prefetcher = shardcache.torch.DevicePrefetcher(make(columns=["uid", "text"]), device="cpu")
    with pytest.raises(errors.InputError, match="text"):
        _on_device(prefetcher)
    assert "Unsupported" in prefetcher.stats.fallback


def test_selections_gather_to_the_plain_batches_byte_for_byte(tmp_path: Path) -> None:
    uri = str(tmp_path / "ds")
    datasets.write_dataset(pafs.LocalFileSystem(), uri, SHARDS)
    options: dict[str, Any] = {
        "cache_dir": str(tmp_path / "cache"),
        "shuffle": "sample",
        "window": WINDOW,
        "block_size": 5,
        "seed": 7,
    }
    with shardcache.open(uri, **options) as plain, shardcache.open(uri, **options) as chosen:
        expected = list(plain.batches(6, columns=["uid", "tokens"]))
        got = list(chosen.batch_selections(6, columns=["uid", "tokens"]))
        assert [s.gather() for s in got] == expected
        assert chosen.state_dict() == plain.state_dict()
        for selection, batch in zip(got, expected, strict=True):
            # The window parts name the same rows: row i of a part is the window's
            # block-level row `rows[i]`.
            uids = [
                _window_uids(part.window)[int(r)] for part in selection.parts for r in part.rows
            ]
            assert uids == batch.column("uid").to_pylist()
        # One object per window, shared by its batches.
        windows = {id(p.window) for s in got for p in s.parts}
        assert len(windows) == -(-sum(SHARDS) // WINDOW)


def test_window_parts_follow_an_elastic_resumes_segments(tmp_path: Path) -> None:
    # Three ranks save mid-epoch; two resume: each new rank's stream is segments of the
    # sequence cut anywhere, so a batch may lie in several windows' parts.
    uri = str(tmp_path / "ds")
    datasets.write_dataset(pafs.LocalFileSystem(), uri, SHARDS)
    options: dict[str, Any] = {
        "cache_dir": str(tmp_path / "cache"),
        "shuffle": "sample",
        "window": WINDOW,
        "block_size": 5,
        "seed": 4,
    }
    saved = []
    for rank in range(3):
        with shardcache.open(uri, rank=rank, world_size=3, **options) as ds:
            for _ in itertools.islice(ds.batches(7), 1 + rank):
                pass
            saved.append(ds.state_dict())
    several = 0
    for rank in range(2):
        with (
            shardcache.open(uri, rank=rank, world_size=2, **options) as plain,
            shardcache.open(uri, rank=rank, world_size=2, **options) as chosen,
        ):
            plain.load_state_dict(saved)
            chosen.load_state_dict(saved)
            expected = [b.column("uid").to_pylist() for b in plain.batches(9)]
            got = list(chosen.batch_selections(9))
            assert [s.gather().column("uid").to_pylist() for s in got] == expected
            for selection, batch in zip(got, expected, strict=True):
                uids = [
                    _window_uids(part.window)[int(r)] for part in selection.parts for r in part.rows
                ]
                assert uids == batch
                several += len(selection.parts) > 1
    assert several  # some batch crossed a window's end or a segment's


def _window_uids(window: selections.WindowRows) -> list[int]:
    table = pa.Table.from_batches(window.pieces)
    assert table.num_rows == window.rows
    return list(table.column("uid").to_pylist())


def test_batch_selections_refuses_a_block_mode_dataset(tmp_path: Path) -> None:
    uri = str(tmp_path / "ds")
    datasets.write_dataset(pafs.LocalFileSystem(), uri, [10])
    with shardcache.open(uri, cache_dir=str(tmp_path / "cache")) as ds:
        with pytest.raises(errors.InputError, match="sample-mode"):
            next(ds.batch_selections(4))


def test_a_deferring_reader_split_over_workers_yields_the_same_rows(tmp_path: Path) -> None:
    # What a DataLoader worker would read: every count-th batch, gathered or deferred.
    uri = str(tmp_path / "ds")
    datasets.write_dataset(pafs.LocalFileSystem(), uri, SHARDS)
    options: dict[str, Any] = {
        "cache_dir": str(tmp_path / "cache"),
        "shuffle": "sample",
        "window": WINDOW,
        "block_size": 5,
    }
    opts = batching.Options(batch_size=6, columns=("uid", "tokens"))
    for index in range(2):
        split = batching.Split(index, 2)
        with shardcache.open(uri, **options) as a, shardcache.open(uri, **options) as b:
            plain = list(batching.Reader(a, opts, split))
            deferred = batching.Reader(b, opts, split, defer_gather=True)
            got = []
            for batch in deferred:
                assert batch.selections and not batch.pieces
                got.append(batch.gathered())
            assert [x.pieces for x in got] == [x.pieces for x in plain]


def test_a_sample_mode_mixture_is_gathered_on_the_device(tmp_path: Path) -> None:
    uris = {}
    for name, rows in {"web": [23, 17, 30], "code": [11, 14]}.items():
        datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / name), rows)
        uris[name] = str(tmp_path / name)
    common: dict[str, Any] = {
        "cache_dir": str(tmp_path / "cache"),
        "block_size": 5,
        "seed": 1,
        "shuffle": "sample",
        "window": 16,
        "batch_size": 4,
        "columns": ["uid", "tokens"],
    }
    steps = 60
    plain_ds = shardcache.torch.IterableDataset(
        mixture=uris, weights={"web": 3, "code": 1}, mix_seed=3, **common
    )
    fast_ds = shardcache.torch.IterableDataset(
        mixture=uris, weights={"web": 3, "code": 1}, mix_seed=3, **common
    )
    try:
        plain = list(itertools.islice(iter(plain_ds), steps))
        prefetcher = shardcache.torch.DevicePrefetcher(fast_ds, device="cpu")
        got = list(itertools.islice(prefetcher._windowed(), steps))
        _assert_equal(got, plain)
        assert prefetcher.stats.device_gathered >= steps
        assert prefetcher.stats.fallback == ""
        # Two windows a source (depth + 1 = 3 would let the readers evict each other's).
        assert prefetcher._gathers is not None and prefetcher._gathers.max_tables == 4
    finally:
        plain_ds.close()
        fast_ds.close()


def test_a_mixture_of_sample_and_block_sources_keeps_step_order(tmp_path: Path) -> None:
    # The sample source's batches are gathered on the device, the block source's go
    # through the window path, interleaved in the mixture's step order.
    def opened() -> shardcache.Mixture:
        sources = {}
        for name, rows, shuffle in (("web", [23, 17, 30], "sample"), ("code", [11, 14], "block")):
            root = tmp_path / name
            if not root.exists():
                datasets.write_dataset(pafs.LocalFileSystem(), str(root), rows)
            sources[name] = shardcache.open(
                str(root),
                cache_dir=str(tmp_path / "cache"),
                block_size=5,
                seed=1,
                shuffle=shuffle,
                window=16,
            )
        return shardcache.mix(sources, weights={"web": 1, "code": 1}, seed=3)

    steps = 40
    plain_ds = shardcache.torch.IterableDataset(opened(), batch_size=4, columns=["uid", "tokens"])
    fast_ds = shardcache.torch.IterableDataset(opened(), batch_size=4, columns=["uid", "tokens"])
    try:
        plain = list(itertools.islice(iter(plain_ds), steps))
        prefetcher = shardcache.torch.DevicePrefetcher(fast_ds, device="cpu")
        got = list(itertools.islice(prefetcher._windowed(), steps))
        _assert_equal(got, plain)
        stats = prefetcher.stats
        assert 0 < stats.device_gathered < stats.batches and stats.windows > 0
        assert stats.fallback == ""
    finally:
        plain_ds.close()
        fast_ds.close()


def test_index_layout_gives_each_rows_values_in_batch_order() -> None:
    # Two windows, one list column: the host index must point every output value at
    # its row's values in its own window.
    window_a = torch.arange(100, 110, dtype=torch.int32)  # rows of lengths 3, 0, 5, 2
    window_b = torch.arange(200, 206, dtype=torch.int32)  # rows of lengths 1, 5
    tables = [
        _device_gather._Table(
            [_device_gather._Column("t", values, np.asarray(offsets, dtype=np.int64))], []
        )
        for values, offsets in ((window_a, [0, 3, 3, 8, 10]), (window_b, [0, 1, 6]))
    ]
    owner = selections.WindowRows("r", 0, 0, [], 4)
    parts = [
        selections.Part(owner, np.asarray([2, 1, 0], dtype=np.int64)),
        selections.Part(owner, np.asarray([1, 0], dtype=np.int64)),
    ]
    index = _device_gather._Index(parts, tables)
    moved = torch.empty(index.size, dtype=torch.int64)
    index.fill(moved.numpy())
    lists = index.lists[0]
    got = torch.cat(
        [
            table.columns[0].values[_device_gather._value_index(moved, seg, torch.device("cpu"))]
            for table, seg in zip(tables, lists.parts, strict=True)
        ]
    )
    assert got.tolist() == [103, 104, 105, 106, 107, 100, 101, 102, 201, 202, 203, 204, 205, 200]
    a, b = lists.offsets
    assert moved[a:b].tolist() == [0, 5, 5, 8, 13, 14]
    assert lists.longest == 5


def _selection(window: selections.WindowRows, rows: list[int]) -> selections.Selection:
    # One window of one one-piece shard: manifest indices are its rows.
    index = np.asarray(rows, dtype=np.int64)
    return selections.Selection(
        gather.Gatherer(window.pieces),
        index,
        np.asarray([0, window.rows], dtype=np.int64),
        window.rows,
        np.zeros(1, dtype=np.int64),
        [selections.Part(window, index)],
    )


def test_a_readers_windows_leave_the_device_once_its_batches_leave_them() -> None:
    def window(owner: str, k: int) -> selections.WindowRows:
        piece = pa.record_batch({"x": pa.array(range(k * 10, k * 10 + 10), pa.int64())})
        return selections.WindowRows(owner, 0, k, [piece], 10)

    gathers = _device_gather.DeviceGather(
        device=torch.device("cpu"), lists="offsets", pad_value=0, pad_to=None
    )
    copying = _device_gather.Copying(mappings=None, locate=None, copy_async=None, stream=0)
    a0, a1, b0 = window("a", 0), window("a", 1), window("b", 0)
    first = _selection(a0, [3, 1])
    assert first.gather().column("x").to_pylist() == [3, 1]  # the CPU gather agrees
    got = gathers.gather([first], copying)
    assert got.tensors["x"].tolist() == [3, 1] and got.windows == 1
    gathers.gather([_selection(b0, [0])], copying)
    # A batch over a0's end and a1's start: both resident, each copied once.
    both = gathers.gather([_selection(a0, [9]), _selection(a1, [0])], copying)
    assert both.tensors["x"].tolist() == [9, 10] and both.windows == 1
    assert gathers.resident == 3
    # Reader a moves on to a1 alone: a0 goes, b's window stays.
    gathers.gather([_selection(a1, [5])], copying)
    assert gathers.resident == 2
    # At most MAX_TABLES over all readers, oldest first.
    for n in range(_device_gather.MAX_TABLES + 2):
        gathers.gather([_selection(window(f"r{n}", 0), [0])], copying)
    assert gathers.resident == _device_gather.MAX_TABLES


def test_the_tables_kept_are_bounded_as_asked_and_a_dropped_one_is_copied_again() -> None:
    def window(owner: str) -> selections.WindowRows:
        piece = pa.record_batch({"x": pa.array(range(10), pa.int64())})
        return selections.WindowRows(owner, 0, 0, [piece], 10)

    gathers = _device_gather.DeviceGather(
        device=torch.device("cpu"), lists="offsets", pad_value=0, pad_to=None, max_tables=3
    )
    copying = _device_gather.Copying(mappings=None, locate=None, copy_async=None, stream=0)
    readers = [window(f"r{n}") for n in range(4)]
    for w in readers:
        assert gathers.gather([_selection(w, [1])], copying).windows == 1
    assert gathers.resident == 3  # r0's window, the oldest, went
    again = gathers.gather([_selection(readers[0], [7, 2])], copying)
    assert again.windows == 1 and again.tensors["x"].tolist() == [7, 2]
    with pytest.raises(ValueError, match="max_tables"):
        _device_gather.DeviceGather(
            device=torch.device("cpu"), lists="offsets", pad_value=0, pad_to=None, max_tables=1
        )


def test_the_prefetcher_keeps_depth_plus_one_windows_or_two_a_source(make: Any) -> None:
    plain = list(make())
    prefetcher = shardcache.torch.DevicePrefetcher(make(), device="cpu", depth=4)
    _assert_equal(list(prefetcher._windowed()), plain)
    assert prefetcher.stats.device_gathered == len(plain)
    assert prefetcher._gathers is not None and prefetcher._gathers.max_tables == 5
