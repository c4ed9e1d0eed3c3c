"""Block mode hands out the batch that ends a shard before the next acquire as a copy.

A plain `for b in ds.batches(n)` loop holds `b` while it asks for the next batch; a
zero-copy slice keeps its whole shard mapped, and once the tier evicted that shard its
pages stay in the memory volume beyond the tier's limit: eight ranks on a volume sized
from the tier waited for each other's room (explorer report D1,
`shardcache.node.volume_cycles`). Every other batch stays a zero-copy slice.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

import shardcache
from shardcache import datasets, embedded, manifests, plans
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
        got = list(ds.batch_pieces(batch_size, stride=stride))
    ends = [min(n, (b + 1) * batch_size) for b in range(0, -(-n // batch_size), stride)]
    assert len(got) == len(ends)
    copies = 0
    for pieces, end in zip(got, ends, strict=True):
        # The walk to the next handed batch reads these rows: another shard among
        # them (or the epoch's end) is an acquire while the caller holds this one.
        ahead = stream[end : end + stride * batch_size]
        leaves = len(ahead) < stride * batch_size or any(s != stream[end - 1] for s in ahead)
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


def _read_holding_each_batch(
    tmp_path: Path, batch_size: int, **kwargs: object
) -> tuple[list[int], list[int], pa.Table]:
    """The uids a plain loop reads, holding each batch while it asks for the next (as
    in training), on a tier that evicts what it read; and the shards evicted."""
    uri, table = test_datasets.write_local(tmp_path / "ds", [100, 64, 100, 37])
    opened = shardcache.open(uri, cache_dir=tmp_path / "cache", **kwargs)  # type: ignore[arg-type]
    inner = opened.provider
    assert isinstance(inner, embedded.EmbeddedProvider)
    shards = _EvictingReadShards(inner)
    ds = datasets.Dataset(shards, opened.params)
    ds.gather_threads = opened.gather_threads
    uids: list[int] = []
    try:
        for b in ds.batches(batch_size):
            uids.extend(b.column("uid").to_pylist())
    finally:
        ds.close()
    return uids, shards.evicted, table


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
