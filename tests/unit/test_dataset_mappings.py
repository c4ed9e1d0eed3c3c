"""The shard mappings a reader keeps across epochs, and when it lets them go."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

import shardcache
from shardcache import datasets, embedded, errors, manifests, plans
from tests.support import datasets as test_datasets
from tests.support import waiting

pytestmark = pytest.mark.unit


def _shard(path: Path, first: int) -> Path:
    batch = pa.record_batch({"uid": pa.array(range(first, first + 10), type=pa.int64())})
    with ipc.new_file(str(path), batch.schema) as writer:
        writer.write_batch(batch)
    return path


def _settle(directory: Path) -> None:
    """Backdate the directory's mtime past the settle age, as if it had been quiet that
    long: deterministic where sleeping for it would be a race with the clock."""
    past = time.time_ns() - 10 * datasets._Mappings.SETTLED_NS
    os.utime(directory, ns=(past, past))


def test_mappings_survive_prunes_while_their_directory_is_quiet(tmp_path: Path) -> None:
    maps = datasets._Mappings()
    paths = [_shard(tmp_path / f"s{i}", i * 10) for i in range(3)]
    first = [maps.batch(p) for p in paths]
    _settle(tmp_path)
    maps.prune()  # a full look, now settled
    maps.prune()  # the directory did not change: nothing to drop
    assert [maps.batch(p) for p in paths] == first
    for p, b in zip(paths, first, strict=True):
        assert maps.batch(p).column(0).buffers()[1].address == b.column(0).buffers()[1].address


def test_a_file_removed_after_a_settled_look_is_let_go_at_the_next_prune(tmp_path: Path) -> None:
    maps = datasets._Mappings()
    paths = [_shard(tmp_path / f"s{i}", i * 10) for i in range(3)]
    for p in paths:
        maps.batch(p)
    _settle(tmp_path)
    maps.prune()
    os.unlink(paths[1])  # evicted: the directory's mtime moves
    maps.prune()
    assert sorted(maps._maps) == sorted(str(p) for p in (paths[0], paths[2]))


def test_a_file_replaced_within_the_same_clock_tick_is_still_noticed(tmp_path: Path) -> None:
    # No settling: the directory's mtime is too recent to be trusted, so every prune
    # checks each file, even if the change landed in the same timestamp tick.
    maps = datasets._Mappings()
    path = _shard(tmp_path / "s", 0)
    old = maps.batch(path)
    maps.prune()
    replacement = _shard(tmp_path / "s.new", 100)
    os.replace(replacement, path)
    maps.prune()
    assert str(path) not in maps._maps
    assert maps.batch(path).column(0)[0].as_py() == 100
    assert old.column(0)[0].as_py() == 0  # the old mapping stayed valid while referenced


def _mapped_rss_kib(path: Path) -> int:
    """Resident KiB of this process's mappings of `path` (from /proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            inside = fields[-1] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


def test_a_new_mapping_has_its_pages_mapped_before_the_first_read(tmp_path: Path) -> None:
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    if (major, minor) < (5, 14):
        pytest.skip("MADV_POPULATE_READ needs Linux 5.14")
    batch = pa.record_batch({"uid": pa.array(range(1 << 18), type=pa.int64())})  # 2 MiB
    path = tmp_path / "shard"
    with ipc.new_file(str(path), batch.schema) as writer:
        writer.write_batch(batch)
    mapped = datasets.read_shard(path)
    # Nothing has read the data yet, and still the whole file is in the page table.
    assert _mapped_rss_kib(path) * 1024 >= path.stat().st_size - 4096
    assert mapped.num_rows == 1 << 18


def test_a_shard_file_written_over_with_other_bytes_is_a_cache_error_naming_it(
    tmp_path: Path,
) -> None:
    """A memory-tier file changed after the sidecar wrote it (same size: the lookup's
    check passes) failed with a bare pyarrow 'Not an Arrow file'."""
    path = _shard(tmp_path / "s0", 0)
    path.write_bytes(os.urandom(path.stat().st_size))
    with pytest.raises(errors.CacheError, match="expected a decoded shard") as info:
        datasets.map_shard(path)
    assert str(path) in str(info.value) and "Remove the file" in str(info.value)


class _EvictingOnAcquire:
    """An embedded provider whose acquire of `last` first evicts `evict` from the memory
    tier, as a cold acquire does to make room, then waits, as the tier waits for room,
    until no mapping of their files is left in this process: the reader's own."""

    def __init__(self, inner: embedded.EmbeddedProvider, *, last: int, evict: list[int]) -> None:
        self.inner = inner
        self.last = last
        self.evict = evict
        self.waited = False

    @property
    def manifest(self) -> manifests.Manifest:
        return self.inner.manifest

    def open_reader(self, params: plans.PlanParams, *, position: int) -> str:
        return self.inner.open_reader(params, position=position)

    def acquire(self, reader_id: str, shard: int, *, epoch: int, position: int) -> object:
        if shard == self.last:
            node = self.inner.node
            paths = []
            for victim in self.evict:
                key = node.manifest.decoded_key(victim)
                paths.append(str(node.memory.root / key))
                assert node.memory.evict(key)

            def still_mapped() -> list[str]:
                maps = Path("/proc/self/maps").read_text()
                return [p for p in paths if p in maps]

            waiting.wait_until(
                "the reader to unmap the shards evicted while its acquire waits",
                lambda: not still_mapped(),
                timeout=10.0,
                describe=lambda: f"still mapped: {still_mapped()}",
            )
            self.waited = True
        return self.inner.acquire(reader_id, shard, epoch=epoch, position=position)

    def close_reader(self, reader_id: str) -> None:
        self.inner.close_reader(reader_id)

    def close(self) -> None:
        self.inner.close()


def test_a_reader_unmaps_the_shards_evicted_while_its_acquire_waits(tmp_path: Path) -> None:
    """The acquire of a cold shard evicts the shards this reader read and still maps;
    their pages stay in the memory volume while mapped, so the insert waited for room
    the waiting reader itself held (300 s, then CacheError). The reader now lets go of
    those mappings while it waits, not only after its acquire returns."""
    uri, table = test_datasets.write_local(tmp_path / "ds", [100] * 4)
    opened = shardcache.open(uri, cache_dir=tmp_path / "cache", shuffle=False)
    inner = opened.provider
    assert isinstance(inner, embedded.EmbeddedProvider)
    # Shards 0 and 1 evicted at shard 3; shard 2's slices are the caller's last batch.
    shards = _EvictingOnAcquire(inner, last=3, evict=[0, 1])
    ds = datasets.Dataset(shards, opened.params)
    try:
        uids = [u for b in ds.batches(100) for u in b.column("uid").to_pylist()]
    finally:
        ds.close()
    assert shards.waited
    assert uids == table.column("uid").to_pylist()
