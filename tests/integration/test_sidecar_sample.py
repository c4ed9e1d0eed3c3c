"""Sample mode and `take` through a real `shardcache sidecar` (file:// source): the
sidecar prefetches whole windows, the reader leases every shard of its window."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

import shardcache
from shardcache import (
    gather_ahead,
    manifests,
    plans,
    provider,
    sequences,
    sidecar_client,
    streams,
    windows,
)
from shardcache.contract import protocol
from tests.support import datasets, waiting
from tests.support.sidecar import SidecarProcess

pytestmark = pytest.mark.integration

SHARDS = [300, 0, 170, 512, 45, 260, 90, 150]
TOTAL = sum(SHARDS)
WINDOW = 200
BLOCK = 64
Factory = Callable[..., SidecarProcess]


@pytest.fixture
def dataset(tmp_path: Path) -> tuple[str, pa.Table]:
    return datasets.write_local(tmp_path / "ds", SHARDS)


@pytest.fixture
def sidecar(sidecar_factory: Factory, dataset: tuple[str, pa.Table]) -> SidecarProcess:
    proc = sidecar_factory(dataset[0], args=["--block-size", str(BLOCK)])
    proc.start(wait="ready")
    return proc


@pytest.fixture
def sidecar_env(sidecar: SidecarProcess) -> Iterator[None]:
    os.environ.update(sidecar.client_env())
    try:
        yield
    finally:
        for key in sidecar.client_env():
            os.environ.pop(key, None)


def sample(**kwargs: Any) -> plans.PlanParams:
    return plans.PlanParams(granularity="sample", window=WINDOW, block_size=BLOCK, **kwargs)


class Recording:
    """A provider that remembers which shards the reader holds leases on."""

    def __init__(self, inner: provider.ShardProvider) -> None:
        self.inner = inner
        self.held: dict[int, int] = {}

    @property
    def manifest(self) -> Any:
        return self.inner.manifest

    def open_reader(self, params: plans.PlanParams, *, position: int) -> str:
        return self.inner.open_reader(params, position=position)

    def acquire(self, reader_id: str, shard: int, *, epoch: int, position: int) -> Any:
        lease = self.inner.acquire(reader_id, shard, epoch=epoch, position=position)
        self.held[shard] = self.held.get(shard, 0) + 1
        outer = self

        class Lease:
            path = lease.path

            def release(self) -> None:
                lease.release()
                outer.held[shard] -= 1

        return Lease()

    def close_reader(self, reader_id: str) -> None:
        self.inner.close_reader(reader_id)

    def close(self) -> None:
        self.inner.close()


def uids(batches: Iterator[pa.RecordBatch]) -> list[int]:
    return [u for b in batches for u in b.column("uid").to_pylist()]


@pytest.mark.usefixtures("sidecar_env")
def test_sample_mode_through_the_sidecar_equals_embedded_mode(
    dataset: tuple[str, pa.Table], tmp_path: Path
) -> None:
    got: list[int] = []
    for rank in range(2):
        options: dict[str, Any] = dict(
            shuffle="sample", window=WINDOW, block_size=BLOCK, seed=3, rank=rank, world_size=2
        )
        # Gathering ahead through the sidecar, inline embedded: the same rows.
        with shardcache.open(**options, gather_threads=3) as via_sidecar:
            ours = uids(via_sidecar.batches(60))
        with shardcache.open(
            dataset[0], cache_dir=tmp_path / "c", gather_threads=0, **options
        ) as local:
            assert ours == uids(local.batches(60))
        got += ours
    assert sorted(got) == list(range(TOTAL))


@pytest.mark.parametrize("threads", [0, 3])
def test_the_reader_holds_every_shard_of_its_window_while_it_gathers(
    sidecar: SidecarProcess, threads: int
) -> None:
    shards = Recording(sidecar_client.SidecarProvider.from_env(environ=sidecar.client_env()))
    params = sample(seed=8)
    ds = shardcache.Dataset(shards, params, gather_threads=threads)
    seq = ds.sequence()
    m = shards.manifest
    wins = windows.rank_windows(m.shard_rows, m.digest, params)
    ends = windows.window_ends(wins)
    position = 0
    # Gathering ahead, the reader also holds the windows of the batches it gathers
    # ahead (at most `most_ahead` more), never those of windows it has handed over,
    # and beside the batch just handed over never more than the window at the reader's
    # position and the next: what the sidecar keeps resident for it and counts against
    # the memory limit (`windows.held_at`).
    ahead = gather_ahead.most_ahead(threads)
    for batch in ds.batches(70):
        held = {s for s, n in shards.held.items() if n}
        window = set(seq.window_shards(position, position + batch.num_rows))
        reach = min(seq.total, position + (1 + ahead) * 70)
        assert window <= held <= set(seq.window_shards(position, reach))
        after = set(windows.held_at(wins, ends, position + batch.num_rows))
        assert held <= window | after, position
        if not ahead:
            assert held == window
        position += batch.num_rows
    assert not any(shards.held.values())
    ds.close()


def readahead_only_sidecar(
    factory: Factory, uri: str
) -> tuple[SidecarProcess, sidecar_client.SidecarProvider]:
    """A ready sidecar that fetches ahead only what its readers' readahead hints name
    (one shard fetched before it is ready), and a provider of it."""
    # Readahead of one shard only: block mode would prefetch a single shard ahead.
    proc = factory(uri, args=["--prefetch-depth", "0", "--ready-shards", "1"])
    proc.start(wait="ready")
    return proc, sidecar_client.SidecarProvider.from_env(environ=proc.client_env())


def wait_resident(proc: SidecarProcess, m: manifests.Manifest, want: set[int], what: str) -> None:
    """Until every shard of `want` (of manifest `m`) is decoded in the memory tier."""

    def resident() -> bool:
        return all((proc.memory_dir / m.decoded_key(s)).exists() for s in want)

    waiting.wait_until(what, resident)


def test_the_sidecar_keeps_the_current_and_next_window_resident(
    sidecar_factory: Factory, dataset: tuple[str, pa.Table]
) -> None:
    proc, shards = readahead_only_sidecar(sidecar_factory, dataset[0])
    params = sample(seed=11)
    reader = shards.open_reader(params, position=0)
    m = shards.manifest
    wins = windows.rank_windows(m.shard_rows, m.digest, params)
    # The shard order follows the manifest digest, which differs per run (mtimes): take
    # the window pair that spans the most shards, so one shard ahead could not cover it.
    i = max(range(len(wins) - 1), key=lambda k: len(set(wins[k].shards + wins[k + 1].shards)))
    position = wins[i].end - 1  # inside window i: windows i and i + 1 needed
    want = set(wins[i].shards) | set(wins[i + 1].shards)
    assert len(want) >= 3
    shards.readahead(reader, epoch=0, position=position)
    wait_resident(proc, m, want, "every shard of the current and next window to be resident")
    shards.close_reader(reader)
    shards.close()


#: A resized rank's stream (elastic resume): parts of windows 0-1 and 4-5 of epoch 0.
SEGMENTS = streams.Segments(0, ((150, 260), (930, 1100)))


def test_a_resized_reader_leases_the_windows_of_its_segments(sidecar: SidecarProcess) -> None:
    shards = Recording(sidecar_client.SidecarProvider.from_env(environ=sidecar.client_env()))
    params = sample(seed=8, segments=SEGMENTS)
    # The exact lease set of the inline gather (gathering ahead: the test above).
    ds = shardcache.Dataset(shards, params, gather_threads=0)
    seq = ds.sequence()
    ranges = list(SEGMENTS.ranges)
    position = 0
    got: list[int] = []
    for batch in ds.batches(70):
        held = {s for s, n in shards.held.items() if n}
        assert held == set(seq.stream_window_shards(ranges, position, position + batch.num_rows))
        position += batch.num_rows
        got += batch.column("uid").to_pylist()
    assert got == [i for a, b in ranges for i in seq.indices(a, b).tolist()]
    ds.close()


def test_the_sidecar_prefetches_the_windows_of_a_resized_readers_segments(
    sidecar_factory: Factory, dataset: tuple[str, pa.Table]
) -> None:
    proc, shards = readahead_only_sidecar(sidecar_factory, dataset[0])
    params = sample(seed=11, segments=SEGMENTS)
    reader = shards.open_reader(params, position=0)
    m = shards.manifest
    wins = windows.rank_windows(m.shard_rows, m.digest, params)
    seq = sequences.Sequence(m.shard_rows, m.digest, params)
    # The stream meets windows 0, 1, then jumps to 4 and 5: the rule-5 range would not.
    assert [w.shards for w in wins] == [
        tuple(seq.window_shards(k * WINDOW, (k + 1) * WINDOW)) for k in (0, 1, 4, 5)
    ]
    position = wins[1].end - 1  # the last row of window 1: windows 1 and 4 needed
    want = set(wins[1].shards) | set(wins[2].shards)
    shards.readahead(reader, epoch=0, position=position)
    wait_resident(proc, m, want, "every shard of the windows of the segments to be resident")
    shards.close_reader(reader)
    shards.close()


def test_take_through_the_sidecar_returns_manifest_rows_in_the_order_asked(
    sidecar: SidecarProcess, dataset: tuple[str, pa.Table]
) -> None:
    index = [TOTAL - 1, 0, 300, 299, 1027, 5, 5]
    ds = shardcache.Dataset(
        sidecar_client.SidecarProvider.from_env(environ=sidecar.client_env()), sample()
    )
    got = ds.take(index)
    assert pa.Table.from_batches([got]).equals(dataset[1].take(pa.array(index)).combine_chunks())
    assert sidecar.holds_drain() == 0
    ds.close()


def test_a_sample_reader_is_granted_at_open_no_shard_past_its_next_window(
    sidecar_factory: Factory, dataset: tuple[str, pa.Table]
) -> None:
    """The pins granted with an open are held until the reader gets to them: for a
    sample-mode reader, beside its first two windows (`windows.held_at`), which is
    all the memory tier's check of the readers' windows counts."""
    proc = sidecar_factory(
        dataset[0], args=["--block-size", str(BLOCK), "--ready-shards", str(len(SHARDS))]
    )
    proc.start(wait="ready")
    m = manifests.resolve(dataset[0])
    for seed in range(4):
        params = sample(seed=seed)
        wins = windows.rank_windows(m.shard_rows, m.digest, params)
        first_two = windows.held_at(wins, windows.window_ends(wins), 0)
        later = set(windows.next_shards(wins, windows.window_ends(wins), 0, len(SHARDS)))
        assert later - set(first_two), "every shard is in the first two windows: moot"
        body = {**protocol.params_to_json(params), "position": 0, "ahead": protocol.MAX_AHEAD}
        code, answer = proc.control("PUT", protocol.reader_path(f"r{seed}"), body)
        assert code == 200, answer
        granted = [g["shard"] for g in answer["ahead"]]
        assert granted == [s for s in first_two if m.shard_rows[s]][: len(granted)]
        assert granted, "nothing granted: the shards were not resident"
        # The gauge of what the readers' windows take: this reader's two, decoded.
        held = sum((proc.memory_dir / m.decoded_key(s)).stat().st_size for s in first_two)
        assert windows_gauge(proc) == held
        assert proc.control("DELETE", protocol.reader_path(f"r{seed}"))[0] == 200
        assert windows_gauge(proc) == 0


def windows_gauge(proc: SidecarProcess) -> float:
    """`shardcache_sample_windows_bytes` as the sidecar's /metrics says it."""
    _, text = proc.http_get("/metrics")
    [line] = [x for x in str(text).splitlines() if x.startswith("shardcache_sample_windows_bytes ")]
    return float(line.split()[1])
