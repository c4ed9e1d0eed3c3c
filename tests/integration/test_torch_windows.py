"""The device prefetcher's window path (`_windowed`), carried out on the CPU.

On the CPU the window path runs the same plan as on a GPU (one slab per window, runs
copied into it, offsets rebased on the host), host to host: every batch must equal the
plain path's, across shard boundaries, shuffle blocks and the epoch's end, and a state
taken mid-window must resume at the exact next batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import shardcache.torch
from shardcache import errors
from shardcache.torch import _copy_plans, _host_memory, _slabs
from tests.support import torch_datasets

pytestmark = [pytest.mark.integration]

SHARDS = torch_datasets.SHARDS


@pytest.fixture
def make(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    with torch_datasets.over_written(tmp_path, monkeypatch, SHARDS) as factory:
        yield factory


def _assert_equal(
    got: list[dict[str, torch.Tensor]], expected: list[dict[str, torch.Tensor]]
) -> None:
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert a.keys() == b.keys(), i
        for key in a:
            assert a[key].dtype == b[key].dtype, (i, key)
            assert torch.equal(a[key], b[key]), (i, key)


def _uids(batches: list[dict[str, torch.Tensor]]) -> list[int]:
    return [int(u) for b in batches for u in b["uid"]]


class _RegisterAll:
    def register(self, address: int, size: int) -> bool:
        return True

    def unregister(self, address: int) -> None:
        pass


EXTRAS = [
    {},
    {"lists": "padded"},
    {"drop_last": True},
    {"pack": 5, "columns": ["tokens"]},
    {"pack": 7, "columns": ["tokens"], "drop_last": True},
]


@pytest.mark.parametrize("window_bytes", [1, 300, 1 << 20])
@pytest.mark.parametrize("extra", EXTRAS)
def test_window_path_yields_the_plain_paths_tensors(
    make: Any, extra: dict[str, Any], window_bytes: int
) -> None:
    plain = list(make(**extra))
    prefetcher = shardcache.torch.DevicePrefetcher(
        make(**extra), device="cpu", window_bytes=window_bytes
    )
    _assert_equal(list(prefetcher._windowed()), plain)
    stats = prefetcher.stats
    assert stats.per_batch == 0 and stats.batches == len(plain)
    if window_bytes > 1:
        assert stats.windows < stats.batches  # several batches per window


def test_registered_runs_are_copied_from_views_of_the_whole_mapping(make: Any) -> None:
    plain = list(make())
    ds = make()
    prefetcher = shardcache.torch.DevicePrefetcher(ds, device="cpu", window_bytes=1 << 20)
    registry = _host_memory.Registry(_RegisterAll(), settle=lambda: None)
    ds.shardcache_dataset().add_mapping_listener(registry)
    prefetcher._registered = registry
    _assert_equal(list(prefetcher._windowed()), plain)
    stats = prefetcher.stats
    # Staged: only the batches that end a shard's reading, copies (`Dataset._sliced`).
    assert stats.direct_bytes > stats.staged_bytes > 0
    # Neighbouring pieces of one block run were merged: fewer copies than pieces.
    pieces = sum(2 * len(batch.pieces) for batch in make().reader())
    assert stats.runs < pieces


@pytest.mark.parametrize("stop", [1, 4, 7])
@pytest.mark.parametrize("extra", [{}, {"pack": 5, "columns": ["tokens"]}])
def test_a_state_taken_mid_window_resumes_at_the_exact_next_batch(
    make: Any, extra: dict[str, Any], stop: int
) -> None:
    plain = list(make(**extra))
    first = shardcache.torch.DevicePrefetcher(make(**extra), device="cpu", window_bytes=1 << 20)
    it = first._windowed()
    head = [next(it) for _ in range(stop)]
    # Batches already copied in the window but not handed over are not in the state.
    assert first.stats.batches == stop
    again = shardcache.torch.DevicePrefetcher(make(**extra), device="cpu", window_bytes=1 << 20)
    again.load_state_dict(first.state_dict())
    _assert_equal(head + list(again._windowed()), plain)


def test_a_window_that_fails_is_copied_batch_by_batch(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(plan: _copy_plans.Plan, **kw: Any) -> _slabs.Launched:
        raise RuntimeError("CUDA error: invalid argument (simulated)")

    monkeypatch.setattr(_slabs, "launch", broken)
    plain = list(make())
    prefetcher = shardcache.torch.DevicePrefetcher(make(), device="cpu")
    _assert_equal(list(prefetcher._windowed()), plain)
    assert "simulated" in prefetcher.stats.fallback
    assert prefetcher.stats.per_batch == len(plain) and prefetcher.stats.windows == 0


def test_a_column_without_a_tensor_form_is_refused_as_on_the_plain_path(make: Any) -> None:
    with pytest.raises(errors.InputError, match="text"):
        list(make(columns=["uid", "text"]))
    prefetcher = shardcache.torch.DevicePrefetcher(make(columns=["uid", "text"]), device="cpu")
    with pytest.raises(errors.InputError, match="text"):
        list(prefetcher._windowed())


def test_a_dropped_mapping_is_let_go_by_the_window_path(make: Any) -> None:
    # The tensors over whole mappings must not keep a mapping the reader dropped (its
    # memory-tier file may be evicted): they go at the next window.
    ds = make()
    registry = _host_memory.Registry(_RegisterAll(), settle=lambda: None)
    ds.shardcache_dataset().add_mapping_listener(registry)
    mappings = _slabs.Mappings(registry.root)
    for batch in ds.reader():
        address = batch.pieces[0].column(0).buffers()[1].address
        start = registry.locate(address, 8)
        assert start is not None
        mappings.slice(start, address, 8)
        break
    assert mappings._tensors
    ds.shardcache_dataset().close()  # drops (and unregisters) every mapping
    mappings.prune()
    assert not mappings._tensors


def test_in_manifest_order_a_window_is_one_copy_a_column_and_shard(make: Any) -> None:
    # The bench's `ordered` path: consecutive pieces are neighbours in their shard, so a
    # column's runs break only where a shard (a mapping), a copy or a window ends.
    def run(**options: Any) -> shardcache.torch.DevicePrefetcher:
        ds = make(**options)
        prefetcher = shardcache.torch.DevicePrefetcher(ds, device="cpu", window_bytes=1 << 20)
        registry = _host_memory.Registry(_RegisterAll(), settle=lambda: None)
        ds.shardcache_dataset().add_mapping_listener(registry)
        prefetcher._registered = registry
        _assert_equal(list(prefetcher._windowed()), list(make(**options)))
        return prefetcher

    ordered = run(shuffle=False).stats
    shuffled = run().stats
    # Staged: only the batches that end a shard's reading, copies (`Dataset._sliced`).
    assert ordered.direct_bytes > ordered.staged_bytes and ordered.windows > 1
    # Two columns; a shard's runs are its slices and up to two copies (`Dataset._sliced`:
    # the batch that ends its reading, and the next batch's head from it).
    assert ordered.runs <= 2 * (3 * len(SHARDS) + ordered.windows)
    assert ordered.runs < shuffled.runs
