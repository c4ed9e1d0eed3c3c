"""The device prefetcher maps nothing of a shard its reader left while the reader
acquires the next one.

The prefetcher holds a window of batches (up to `WINDOW_BATCHES`) and `depth` more in
flight, and their pieces are zero-copy slices of the mapped shards; once the tier
evicted a shard, a slice kept its pages in the memory volume beyond the tier's limit,
which ranks on a volume sized from the tier waited for (explorer report D1,
`shardcache.node.volume_cycles`). The batch after which the reader acquires another
shard is a copy (`Dataset._sliced`): the prefetcher ends its window there and lets go
of the host memory its copies read before it asks for the next batch. On the CPU the
window path copies host to host, the same steps.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import shardcache.torch
from shardcache import embedded
from tests.support import torch_datasets
from tests.unit.test_block_batch_copies import _EvictingReadShards

pytestmark = [pytest.mark.integration]


@pytest.fixture
def make(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    with torch_datasets.over_written(tmp_path, monkeypatch, [100, 64, 100, 37]) as factory:
        yield factory


def _evicting(ds: shardcache.torch.IterableDataset) -> _EvictingReadShards:
    """`ds`'s reader on a tier that evicts what it read at every acquire, then waits
    until this process maps nothing of it."""
    inner = ds.shardcache_dataset()
    provider = inner.provider
    assert isinstance(provider, embedded.EmbeddedProvider)
    shards = _EvictingReadShards(provider)
    inner._provider = shards  # type: ignore[assignment]
    return shards


@pytest.mark.parametrize("window_bytes", [1 << 20, 300])
@pytest.mark.parametrize("shuffle", [False, "block"])
def test_a_prefetcher_maps_nothing_of_the_shard_its_reader_left_while_the_next_is_acquired(
    make: Any, window_bytes: int, shuffle: bool | str
) -> None:
    first = make(batch_size=7, shuffle=shuffle)
    plain = [b["uid"].clone() for b in first]
    first.close()  # its mappings, kept for another epoch, would be counted below
    ds = make(batch_size=7, shuffle=shuffle)
    shards = _evicting(ds)
    prefetcher = shardcache.torch.DevicePrefetcher(
        ds, device="cpu", window_bytes=window_bytes, depth=3
    )
    got = [b["uid"].clone() for b in prefetcher._windowed()]
    assert len(shards.evicted) == 3
    assert len(got) == len(plain)
    assert all(torch.equal(a, b) for a, b in zip(got, plain, strict=True))
