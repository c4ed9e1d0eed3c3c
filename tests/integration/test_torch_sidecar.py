"""`shardcache.torch` in sidecar mode: DataLoader worker processes, each reading through
a real `shardcache sidecar` process, yield exactly the rank's stream and resume exactly
with StatefulDataLoader; registration listeners see every mapping dropped again."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch.utils.data
from torchdata.stateful_dataloader import StatefulDataLoader

import shardcache
import shardcache.torch
from tests.support import datasets
from tests.support.sidecar import SidecarProcess

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]

Factory = Callable[..., SidecarProcess]
ROWS = [120, 80, 150, 60, 110]


@pytest.fixture
def served(
    sidecar_factory: Factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[str, Path]:
    uri, _ = datasets.write_local(tmp_path / "ds", ROWS)
    proc = sidecar_factory(uri, args=["--ready-shards", "0"])
    proc.start()
    for name, value in proc.client_env().items():
        monkeypatch.setenv(name, value)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    return uri, tmp_path


def uids(batches: object) -> list[int]:
    return [int(u) for b in batches for u in b["uid"]]  # type: ignore[attr-defined]


def test_workers_through_the_sidecar_yield_the_rank_stream_and_resume(served) -> None:  # type: ignore[no-untyped-def]
    uri, tmp = served
    with shardcache.open(uri, cache_dir=tmp / "ref", rank=1, world_size=2, block_size=16) as ref:
        expected = [u for b in ref.batches(10) for u in b.column("uid").to_pylist()]

    def make() -> shardcache.torch.IterableDataset:
        return shardcache.torch.IterableDataset(
            batch_size=10, columns=["uid", "tokens"], rank=1, world_size=2, block_size=16
        )

    loader = torch.utils.data.DataLoader(
        make(), batch_size=None, num_workers=2, multiprocessing_context="fork"
    )
    assert uids(loader) == expected

    first = StatefulDataLoader(
        make(), batch_size=None, num_workers=2, multiprocessing_context="fork"
    )
    head: list[int] = []
    for i, batch in enumerate(first):
        head += [int(u) for u in batch["uid"]]
        if i == 4:
            break
    resumed = StatefulDataLoader(
        make(), batch_size=None, num_workers=2, multiprocessing_context="fork"
    )
    resumed.load_state_dict(first.state_dict())
    assert head + uids(resumed) == expected


class _Counting:
    def __init__(self) -> None:
        self.live: set[int] = set()
        self.mapped = 0

    def register(self, address: int, size: int) -> bool:
        self.live.add(address)
        self.mapped += 1
        return True

    def unregister(self, address: int) -> None:
        self.live.remove(address)


def test_prefetcher_over_the_sidecar_registers_each_mapping_and_lets_all_go(served) -> None:  # type: ignore[no-untyped-def]
    from shardcache.torch import _host_memory

    ds = shardcache.torch.IterableDataset(batch_size=10, columns=["uid"], block_size=16)
    plain = shardcache.torch.IterableDataset(batch_size=10, columns=["uid"], block_size=16)
    registrar = _Counting()
    registry = _host_memory.Registry(registrar, settle=lambda: None)
    ds.shardcache_dataset().add_mapping_listener(registry)
    prefetcher = shardcache.torch.DevicePrefetcher(ds, device="cpu")
    assert uids(prefetcher) == uids(plain)
    assert registrar.mapped == len(ROWS) and len(registrar.live) == len(ROWS)
    ds.close()
    plain.close()
    assert registrar.live == set()
