"""A reader's registration (`PUT /v1/readers/{id}`, `control.put_reader`) against a real
cache node on local files: which readers' locks it tries (feature `reader_locks`), and
the shards its plan grants (`open_ahead`) for each seed and epoch."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest
from shardcache_sidecar import configuration
from shardcache_sidecar.server import control, lifecycle

from shardcache import manifests, plans
from shardcache.contract import protocol
from shardcache.node import caches, reader_locks
from tests.support import datasets

pytestmark = pytest.mark.unit

SHARDS = [40] * 8


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[lifecycle.Sidecar]:
    datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / "ds"), SHARDS)
    settings = configuration.from_env(
        {},
        overrides={"source_uri": f"file://{tmp_path / 'ds'}", "run_dir": str(tmp_path / "run")},
    )
    made = lifecycle.Sidecar(settings)
    manifest = manifests.resolve(settings.source_uri)
    made.manifest, made.node = manifest, caches.CacheNode(manifest, settings.node_settings())
    made.problem = None
    settings.memory_dir.mkdir(parents=True, exist_ok=True)
    yield made
    made.node.close()
    made.executor.shutdown(wait=True)


def body(params: plans.PlanParams, **extra: Any) -> bytes:
    return json.dumps({**protocol.params_to_json(params), "position": 0, **extra}).encode()


async def register(sidecar: lifecycle.Sidecar, reader_id: str, params: plans.PlanParams) -> Any:
    """Register `reader_id` as a client does: its lock held first, `reader_lock` sent."""
    lock = reader_locks.hold(sidecar.settings.memory_dir, reader_id)
    answer = await control.put_reader(
        sidecar, reader_id, body(params, **{protocol.READER_LOCK_FIELD: True})
    )
    return lock, json.loads(answer.body)


def rank(r: int, world_size: int = 4, **kwargs: Any) -> plans.PlanParams:
    return plans.PlanParams(seed=1, rank=r, world_size=world_size, block_size=8, **kwargs)


def probed(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The reader ids of each lock probe from now on."""
    calls: list[list[str]] = []
    real = reader_locks.probe

    def counting(memory_dir: Path, ids: Any) -> Any:
        ids = list(ids)
        calls.append(ids)
        return real(memory_dir, ids)

    monkeypatch.setattr(reader_locks, "probe", counting)
    return calls


async def test_ranks_registering_together_try_only_their_own_lock(
    sidecar: lifecycle.Sidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = probed(monkeypatch)
    locks = [(await register(sidecar, f"r{r}", rank(r)))[0] for r in range(4)]
    # Each registration looks at its own new lock only: no other rank's reader could be
    # the one it replaces, and every second's check looks at them all.
    assert calls == [["r0"], ["r1"], ["r2"], ["r3"]]
    assert sorted(r.reader_id for r in sidecar.registry.readers()) == ["r0", "r1", "r2", "r3"]
    for lock in locks:
        lock.release()


async def test_a_restarted_ranks_registration_drops_the_dead_readers_at_once(
    sidecar: lifecycle.Sidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = [(await register(sidecar, f"old{r}", rank(r)))[0] for r in range(3)]
    for lock in old[1:]:
        lock.forget()  # as its process's death does: the lock let go, the file left
        lock.path.unlink()
    calls = probed(monkeypatch)
    new, _ = await register(sidecar, "new1", rank(1))
    # Rank 1's dead reader may be the one it replaces: every lock is tried, and both
    # dead readers (ranks 1 and 2) go before the new one counts its share.
    assert sorted(calls[0]) == ["old0", "old1", "old2"]
    assert calls[1:] == [["new1"]]
    assert sorted(r.reader_id for r in sidecar.registry.readers()) == ["new1", "old0"]
    assert sidecar.readers_dropped_dead == 2
    new.release()
    old[0].release()


async def test_registrations_of_other_seeds_and_epochs_are_granted_their_own_first_shards(
    sidecar: lifecycle.Sidecar,
) -> None:
    node = sidecar.node
    assert node is not None
    for shard in range(len(SHARDS)):  # every shard resident: a grant is the plan's order
        entry = node.lookup(shard)
        if entry is None:
            entry = await sidecar.acquire(node, shard, 30.0)
        entry.release()
    for seed in (1, 2, 3):
        for epoch in (0, 1, 5):
            params = plans.PlanParams(seed=seed, epoch=epoch, rank=1, world_size=2, block_size=8)
            reader_id = f"s{seed}e{epoch}"
            answer = await control.put_reader(sidecar, reader_id, body(params, ahead=3))
            granted = [g["shard"] for g in json.loads(answer.body)["ahead"]]
            runs = plans.rank_runs(node.manifest.shard_rows, node.manifest.digest, params)
            assert granted == plans.next_shards(runs, plans.run_ends(runs), 0, len(granted))
            assert len(granted) == min(3, node.settings.prefetch_depth) + 1
            for hold in sidecar.forget_reader(reader_id)[1]:
                assert hold.reader_id == reader_id
