"""The cold fill takes every rank's plan round robin: each rank's first shard before
any rank's second, every shard of the epoch once (issue 14's cold fill)."""

from __future__ import annotations

import dataclasses

import pytest

from shardcache import plans
from shardcache.node import epoch_plans, fill_orders

SHARD_ROWS = [4096 * n for n in (3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8)]
DIGEST = "d" * 64


def test_interleaving_takes_each_ranks_next_shard_in_turn_and_each_shard_once() -> None:
    assert fill_orders.interleaved([[5, 1, 2], [7, 5], [3]]) == [
        (5, 0),
        (7, 0),
        (3, 0),
        (1, 1),
        (2, 2),
    ]
    assert fill_orders.interleaved([]) == []


@pytest.mark.parametrize("world_size", [1, 2, 5, 16])
@pytest.mark.parametrize("position", [0, 4096])
def test_the_fill_holds_every_shard_every_rank_reads_from_its_position_once(
    world_size: int, position: int
) -> None:
    orders = epoch_plans.EpochPlans(SHARD_ROWS, DIGEST)
    params = plans.PlanParams(seed=3, epoch=2, world_size=world_size, block_size=4096)
    fill = fill_orders.epoch_fill(params, position, orders.rank_runs, len(SHARD_ROWS))
    shards = [shard for shard, _ in fill]
    per_rank = []
    for rank in range(world_size):
        runs = plans.rank_runs(SHARD_ROWS, DIGEST, dataclasses.replace(params, rank=rank))
        per_rank.append(plans.next_shards(runs, plans.run_ends(runs), position, len(SHARD_ROWS)))
    assert len(shards) == len(set(shards))
    assert set(shards) == {s for upcoming in per_rank for s in upcoming}
    # Every rank's next shard is among the first ones filled, before any rank's second.
    firsts = {upcoming[0] for upcoming in per_rank if upcoming}
    assert set(shards[: len(firsts)]) == firsts
    assert all(index == 0 for _, index in fill[: len(firsts)])
