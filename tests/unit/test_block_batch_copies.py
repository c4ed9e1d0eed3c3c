"""Block mode hands out the batch that ends a shard before the next acquire as a copy.

A plain `for b in ds.batches(n)` loop holds `b` while it asks for the next batch; a
zero-copy slice keeps its whole shard mapped, and once the tier evicted that shard its
pages stay in the memory volume beyond the tier's limit: eight ranks on a volume sized
from the tier waited for each other's room (explorer report D1,
`shardcache.node.volume_cycles`). Every other batch stays a zero-copy slice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

import shardcache
from shardcache import datasets, embedded, manifests, plans, windows
from tests.support import datasets as test_datasets
from tests.support import waiting

pytestmark = pytest.mark.unit


def _mapped_file(address: int) -> str | None:
    """The file this process maps at `address`, if any (from /proc/self/maps)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= address < hi:
            return fields[5].strip() if len(fields) == 6 else None
    return None


def _in_cache(piece: pa.RecordBatch, cache: Path) -> bool:
    """Whether `piece`'s values lie inside a mapping of a shard file of `cache`."""
    found = _mapped_file(piece.column("uid").buffers()[1].address)
    return found is not None and found.startswith(str(cache.resolve()))


def _stream_shards(ds: shardcache.Dataset) -> list[int]:
    return [run.shard for run in ds.runs() for _ in range(len(run))]


@pytest.mark.parametrize(
    ("shuffle", "batch_size", "stride"),
    [(False, 30, 1), ("block", 30, 1), ("block", 7, 1), ("block", 30, 2), (False, 100, 1)],
)
def test_the_batch_ending_a_shard_before_the_next_acquire_owns_its_buffers_and_others_are_zero_copy(
    tmp_path: Path, shuffle: bool | str, batch_size: int, stride: int
) -> None:
    uri, table = test_datasets.write_local(tmp_path / "ds", [100, 64, 100, 37])
    cache = tmp_path / "cache"
    kwargs = {"block_size": 16} if shuffle == "block" else {}
    with shardcache.open(uri, cache_dir=cache, shuffle=shuffle, seed=2, **kwargs) as ds:
        stream = _stream_shards(ds)
        n = len(stream)
        got, said = [], []
        for pieces in ds.batch_pieces(batch_size, stride=stride):
            got.append(pieces)
            said.append(ds.acquires_next)
    ends = [min(n, (b + 1) * batch_size) for b in range(0, -(-n // batch_size), stride)]
    assert len(got) == len(ends)
    copies = 0
    for pieces, end, acquires_next in zip(got, ends, said, strict=True):
        # The walk to the next handed batch reads these rows: another shard among
        # them (or the epoch's end) is an acquire while the caller holds this one.
        ahead = stream[end : end + stride * batch_size]
        leaves = len(ahead) < stride * batch_size or any(s != stream[end - 1] for s in ahead)
        assert acquires_next == leaves, end  # what a prefetcher lets go of its window by
        if leaves:
            copies += 1
            assert len(pieces) == 1 and not _in_cache(pieces[0], cache), end
            continue
        # The last piece is a slice of the shard the batch ends in; a piece of an
        # earlier shard (the batch straddles) was copied before that shard's acquire.
        row = end - sum(p.num_rows for p in pieces)
        for piece in pieces:
            same_to_the_end = all(s == stream[end - 1] for s in stream[row:end])
            assert _in_cache(piece, cache) == same_to_the_end, (end, row)
            row += piece.num_rows
    assert copies >= 1
    uids = [u for pieces in got for p in pieces for u in p.column("uid").to_pylist()]
    assert len(uids) == len(set(uids))
    if stride == 1:
        assert sorted(uids) == table.column("uid").to_pylist()


class _EvictingReadShards:
    """An embedded provider whose acquire of a shard first evicts every shard acquired
    before it that nobody leases any more, as a cold acquire does to make room on a
    full tier, then waits, as the tier waits for room, until this process maps nothing
    of their files."""

    def __init__(self, inner: embedded.EmbeddedProvider) -> None:
        self.inner = inner
        self.read: list[int] = []
        self.evicted: list[int] = []

    @property
    def manifest(self) -> manifests.Manifest:
        return self.inner.manifest

    def open_reader(self, params: plans.PlanParams, *, position: int) -> str:
        return self.inner.open_reader(params, position=position)

    def acquire(self, reader_id: str, shard: int, *, epoch: int, position: int) -> object:
        node = self.inner.node
        paths = []
        for old in self.read:
            key = node.manifest.decoded_key(old)
            if old != shard and node.memory.evict(key):  # False while leased
                self.evicted.append(old)
                paths.append(str(node.memory.root / key))

        def still_mapped() -> list[str]:
            maps = Path("/proc/self/maps").read_text()
            return [p for p in paths if p in maps]

        waiting.wait_until(
            "the reader to let go of the evicted shards it read",
            lambda: not still_mapped(),
            timeout=5.0,
            describe=lambda: f"still mapped: {still_mapped()}",
        )
        self.read = [s for s in self.read if s not in self.evicted] + [shard]
        return self.inner.acquire(reader_id, shard, epoch=epoch, position=position)

    def close_reader(self, reader_id: str) -> None:
        self.inner.close_reader(reader_id)

    def close(self) -> None:
        self.inner.close()


#: Called after each batch of a loop with the batch's index and the dataset: a move.
Between = Callable[[int, datasets.Dataset], None]


def _read_holding_each_batch(
    tmp_path: Path,
    batch_size: int,
    *,
    between: Between | None = None,
    selections: bool = False,
    **kwargs: object,
) -> tuple[list[int], list[int], pa.Table]:
    """The uids a plain loop reads, holding each batch while it asks for the next (as
    in training), on a tier that evicts what it read; and the shards evicted. With
    `selections`, the loop holds `batch_selections()`' selections and gathers each.
    A dataset already written is kept: its files' times are in the plan's digest."""
    root = tmp_path / "ds"
    if root.exists():
        uri, table = f"file://{root}", test_datasets.make_table(0, 301)
    else:
        uri, table = test_datasets.write_local(root, [100, 64, 100, 37])
    opened = shardcache.open(uri, cache_dir=tmp_path / "cache", **kwargs)  # type: ignore[arg-type]
    inner = opened.provider
    assert isinstance(inner, embedded.EmbeddedProvider)
    shards = _EvictingReadShards(inner)
    ds = datasets.Dataset(shards, opened.params)
    ds.gather_threads = opened.gather_threads
    uids: list[int] = []
    loop: Iterator[Any] = ds.batch_selections(batch_size) if selections else ds.batches(batch_size)
    try:
        for k, b in enumerate(loop):
            got = b.gather() if selections else b
            uids.extend(got.column("uid").to_pylist())
            del got
            if between is not None:
                between(k, ds)
    finally:
        ds.close()
    return uids, shards.evicted, table


def _read_plainly(tmp_path: Path, batch_size: int, between: Between, **kwargs: object) -> list[int]:
    """The uids the same loop reads from a tier that evicts nothing."""
    uri = f"file://{tmp_path / 'ds'}"
    uids: list[int] = []
    with shardcache.open(uri, cache_dir=tmp_path / "plain-cache", **kwargs) as ds:  # type: ignore[arg-type]
        for k, b in enumerate(ds.batches(batch_size)):
            uids.extend(b.column("uid").to_pylist())
            between(k, ds)
    return uids


@pytest.mark.parametrize("batch_size", [30, 64])
def test_a_loop_holding_its_batch_maps_nothing_of_the_shard_evicted_by_the_next_acquire(
    tmp_path: Path, batch_size: int
) -> None:
    uids, evicted, table = _read_holding_each_batch(tmp_path, batch_size, shuffle=False)
    assert len(evicted) == 3
    assert uids == table.column("uid").to_pylist()


def test_a_sample_mode_loop_maps_nothing_of_the_window_it_left_while_it_acquires_the_next(
    tmp_path: Path,
) -> None:
    """The inline gather kept the last batch's gatherer, over the whole window's
    mappings, while it acquired the next window's shards."""
    uids, evicted, table = _read_holding_each_batch(
        tmp_path, 30, shuffle="sample", window=150, seed=4, gather_threads=1
    )
    assert evicted
    assert sorted(uids) == table.column("uid").to_pylist()


def _skip_into_the_next_shard(k: int, ds: datasets.Dataset) -> None:
    if k == 1:  # at row 60 of shard 0's 100: the batch held is a slice of shard 0
        ds.skip_batches(2)  # to row 120, in shard 1


def _load_a_state_in_shard_2(k: int, ds: datasets.Dataset) -> None:
    if k == 0:
        state = ds.state_dict()
        ds.load_state_dict({**state, "position": 180})


def _another_epoch(k: int, ds: datasets.Dataset) -> None:
    if k == 0:
        ds.set_epoch(1)


@pytest.mark.parametrize(
    "between", [_skip_into_the_next_shard, _load_a_state_in_shard_2], ids=["skip", "loaded-state"]
)
def test_a_loop_holding_its_batch_through_a_move_maps_no_evicted_shard_while_the_next_is_acquired(
    tmp_path: Path, between: Between
) -> None:
    """A move between two batches can send the walk to another shard right after a
    batch handed as a slice (the walk could not know): the shard it slices stays
    leased, so not evicted, until the next batch is handed."""
    uids, evicted, _ = _read_holding_each_batch(tmp_path, 30, between=between, shuffle=False)
    assert uids == _read_plainly(tmp_path, 30, between, shuffle=False)
    assert evicted


def test_a_loop_holding_its_batch_through_set_epoch_maps_no_evicted_shard_while_the_next_is_acquired(
    tmp_path: Path,
) -> None:
    uri, _ = test_datasets.write_local(tmp_path / "ds", [100, 64, 100, 37])
    # A seed whose epoch 0 starts with a run longer than a batch (the first batch is a
    # slice) and whose epoch 1 starts in another shard (the plan hangs on the digest,
    # which hangs on the path).
    for seed in range(50):
        options: dict[str, object] = {"shuffle": "block", "block_size": 100, "seed": seed}
        with shardcache.open(uri, cache_dir=tmp_path / "plan", **options) as ds:  # type: ignore[arg-type]
            first = ds.runs()[0]
            ds.set_epoch(1)
            if len(first) > 10 and ds.runs()[0].shard != first.shard:
                break
    else:
        pytest.fail("no seed of 50 starts epoch 1 in another shard than epoch 0")
    uids, evicted, _ = _read_holding_each_batch(tmp_path, 10, between=_another_epoch, **options)
    with shardcache.open(uri, cache_dir=tmp_path / "plan", **options) as ds:  # type: ignore[arg-type]
        assert ds.runs()[0] == first  # the plan the seed was chosen by
    assert uids == _read_plainly(tmp_path, 10, _another_epoch, **options)
    assert evicted


def test_a_loop_holding_the_last_selection_maps_no_evicted_window_while_the_next_is_acquired(
    tmp_path: Path,
) -> None:
    """`batch_selections()` released the window it left before acquiring the next,
    while the caller still held the last selection over that window's mappings."""
    uids, evicted, table = _read_holding_each_batch(
        tmp_path, 30, selections=True, shuffle="sample", window=60, seed=4
    )
    assert evicted
    assert sorted(uids) == table.column("uid").to_pylist()


class _CountingLeases:
    """An embedded provider that records, at every acquire, the shards leased then
    (the one asked for included)."""

    def __init__(self, inner: embedded.EmbeddedProvider) -> None:
        self.inner = inner
        self.out: dict[int, int] = {}
        self.at_acquires: list[set[int]] = []

    @property
    def manifest(self) -> manifests.Manifest:
        return self.inner.manifest

    def open_reader(self, params: plans.PlanParams, *, position: int) -> str:
        return self.inner.open_reader(params, position=position)

    def acquire(self, reader_id: str, shard: int, *, epoch: int, position: int) -> object:
        self.at_acquires.append({s for s, n in self.out.items() if n} | {shard})
        lease = self.inner.acquire(reader_id, shard, epoch=epoch, position=position)
        self.out[shard] = self.out.get(shard, 0) + 1
        counts = self.out

        class _Counted:
            path = lease.path

            def release(self) -> None:
                counts[shard] -= 1
                lease.release()

        return _Counted()

    def close_reader(self, reader_id: str) -> None:
        self.inner.close_reader(reader_id)

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("window", [60, 40, 35, 25])
def test_a_loop_over_selections_leases_at_most_two_windows_at_an_acquire(
    tmp_path: Path, window: int
) -> None:
    """The window a held selection reads stays leased through the next window's
    acquire only while the two are all: a third (a batch crossing a window's end
    right after one that did, windows smaller than two batches) is room the sidecar's
    check of the memory limit does not count, so there the left window goes first."""
    uri, table = test_datasets.write_local(tmp_path / "ds", [20] * 16)
    opened = shardcache.open(
        uri, cache_dir=tmp_path / "cache", shuffle="sample", window=window, seed=4, block_size=20
    )
    inner = opened.provider
    assert isinstance(inner, embedded.EmbeddedProvider)
    shards = _CountingLeases(inner)
    ds = datasets.Dataset(shards, opened.params)
    uids: list[int] = []
    try:
        for s in ds.batch_selections(30):
            uids.extend(s.gather().column("uid").to_pylist())
    finally:
        ds.close()
    assert sorted(uids) == table.column("uid").to_pylist()
    m = inner.manifest
    wins = windows.rank_windows(m.shard_rows, m.digest, opened.params)
    pairs = [{s for w in wins[i : i + 2] for s in w.shards} for i in range(len(wins))]
    for leased in shards.at_acquires:
        assert any(leased <= pair for pair in pairs), (leased, [w.shards for w in wins])
