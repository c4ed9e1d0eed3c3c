from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from shardcache import plans, streams
from shardcache.node import epoch_plans

pytestmark = pytest.mark.unit

ROWS = [100, 0, 37, 250, 8, 64, 1]
DIGEST = "sha256:d"


def every_rank(
    world_size: int, shuffle: bool, *, epochs: Sequence[int], block_sizes: Sequence[int]
) -> Iterator[plans.PlanParams]:
    """The plan of every rank of `world_size`, for each epoch and block size (seed 3)."""
    for epoch in epochs:
        for block_size in block_sizes:
            for rank in range(world_size):
                yield plans.PlanParams(
                    seed=3,
                    epoch=epoch,
                    rank=rank,
                    world_size=world_size,
                    shuffle=shuffle,
                    block_size=block_size,
                )


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("world_size", [1, 2, 3, 7])
def test_every_rank_gets_exactly_the_plan_it_would_make_alone(
    shuffle: bool, world_size: int
) -> None:
    orders = epoch_plans.EpochPlans(ROWS, DIGEST)
    # Epoch 0 again: back to an epoch already made.
    for params in every_rank(world_size, shuffle, epochs=(0, 1, 0), block_sizes=(16, 5)):
        assert orders.rank_runs(params) == plans.rank_runs(ROWS, DIGEST, params)


def test_seeds_do_not_share_an_order() -> None:
    orders = epoch_plans.EpochPlans(ROWS, DIGEST)
    first = plans.PlanParams(seed=1, block_size=8)
    second = plans.PlanParams(seed=2, block_size=8)
    assert orders.rank_runs(first) == plans.rank_runs(ROWS, DIGEST, first)
    assert orders.rank_runs(second) == plans.rank_runs(ROWS, DIGEST, second)
    assert orders.rank_runs(first) != orders.rank_runs(second)


def test_elastic_segments_slice_the_shared_order() -> None:
    orders = epoch_plans.EpochPlans(ROWS, DIGEST)
    segments = streams.Segments(epoch=0, ranges=((10, 40), (200, 300)))
    params = plans.PlanParams(seed=4, world_size=2, rank=1, block_size=8, segments=segments)
    assert orders.rank_runs(params) == plans.rank_runs(ROWS, DIGEST, params)


def test_orders_beyond_the_kept_ones_are_made_again_exactly() -> None:
    orders = epoch_plans.EpochPlans(ROWS, DIGEST)
    for epoch in range(epoch_plans.KEPT + 3):
        params = plans.PlanParams(seed=9, epoch=epoch, block_size=8)
        assert orders.rank_runs(params) == plans.rank_runs(ROWS, DIGEST, params)
    params = plans.PlanParams(seed=9, epoch=0, block_size=8)
    assert orders.rank_runs(params) == plans.rank_runs(ROWS, DIGEST, params)


def test_ranks_of_one_epoch_make_its_shard_order_and_each_shards_runs_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    orders_made: list[object] = []
    shards_made: list[int] = []
    real_order, real_runs = plans._shard_order, plans._shard_runs

    def counting_order(*args: Any) -> list[int]:
        orders_made.append(args)
        return real_order(*args)

    def counting_runs(rows: int, shard: int, *args: Any) -> list[plans.Run]:
        shards_made.append(shard)
        return real_runs(rows, shard, *args)

    monkeypatch.setattr(plans, "_shard_order", counting_order)
    monkeypatch.setattr(plans, "_shard_runs", counting_runs)
    orders = epoch_plans.EpochPlans(ROWS, DIGEST)
    for rank in range(16):
        orders.rank_runs(plans.PlanParams(seed=1, rank=rank, world_size=16, block_size=8))
    orders.rank_runs(plans.PlanParams(seed=1, block_size=8))  # world size 1: every shard
    assert len(orders_made) == 1
    assert sorted(shards_made) == [i for i, rows in enumerate(ROWS) if rows]


def count_shard_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The shards whose runs (blocks permuted) are made from now on, in order."""
    shards_made: list[int] = []
    real_runs = plans._shard_runs

    def counting_runs(rows: int, shard: int, *args: Any) -> list[plans.Run]:
        shards_made.append(shard)
        return real_runs(rows, shard, *args)

    monkeypatch.setattr(plans, "_shard_runs", counting_runs)
    return shards_made


def test_a_rank_makes_only_the_shards_it_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    shards_made = count_shard_runs(monkeypatch)
    params = plans.PlanParams(seed=1, rank=5, world_size=16, block_size=8)
    runs = epoch_plans.EpochPlans(ROWS, DIGEST).rank_runs(params)
    assert sorted(shards_made) == sorted({run.shard for run in runs})


def test_an_order_is_had_once_any_rank_of_its_epoch_made_it() -> None:
    orders = epoch_plans.EpochPlans(ROWS, DIGEST)
    rank0 = plans.PlanParams(seed=1, epoch=2, rank=0, world_size=4, block_size=8)
    rank3 = plans.PlanParams(seed=1, epoch=2, rank=3, world_size=4, block_size=8)
    assert not orders.has(rank3)
    orders.rank_runs(rank0)
    assert orders.has(rank3)
    assert not orders.has(rank3.with_epoch(3))
    assert not orders.has(plans.PlanParams(seed=2, epoch=2, rank=3, world_size=4, block_size=8))


def test_blocks_counts_each_shards_short_last_block_and_no_block_for_an_empty_shard() -> None:
    orders = epoch_plans.EpochPlans([300, 250, 0, 1], "digest")
    assert orders.blocks(100) == 3 + 3 + 0 + 1
    assert orders.blocks(1000) == 3
    assert orders.blocks(100) == 7  # remembered per block size, not mixed up


def positions(total: int) -> list[int]:
    """Every position of a small plan, and one past its end."""
    return list(range(total + 2))


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("world_size", [1, 2, 3, 7])
def test_a_ranks_shard_spans_give_exactly_the_next_shards_of_its_plans_runs(
    shuffle: bool, world_size: int
) -> None:
    orders = epoch_plans.EpochPlans(ROWS, DIGEST)
    for params in every_rank(world_size, shuffle, epochs=(0, 1), block_sizes=(16, 5, 1000)):
        runs = plans.rank_runs(ROWS, DIGEST, params)
        ends = plans.run_ends(runs)
        spans = orders.rank_spans(params)
        for position in positions(sum(ROWS)):
            for count in (0, 1, 2, 5, len(ROWS), -1):
                assert spans.next(position, count) == plans.next_shards(
                    runs, ends, position, count
                ), (params, position, count)


def test_elastic_segments_spans_join_a_shard_read_on_across_two_ranges() -> None:
    orders = epoch_plans.EpochPlans(ROWS, DIGEST)
    # Adjacent and apart ranges, one inside a single shard: a shard may end one range
    # and start the next (one span), or come back after another shard (two).
    for ranges in (((10, 40), (200, 300)), ((0, 30), (30, 90)), ((5, 6), (7, 8), (300, 460))):
        segments = streams.Segments(epoch=0, ranges=ranges)
        params = plans.PlanParams(seed=4, world_size=2, rank=1, block_size=8, segments=segments)
        runs = plans.rank_runs(ROWS, DIGEST, params)
        spans = orders.rank_spans(params)
        assert spans.shards == [
            s for i, s in enumerate(r.shard for r in runs) if i == 0 or runs[i - 1].shard != s
        ]
        for position in positions(streams.length(list(ranges))):
            for count in (1, 3, len(ROWS)):
                assert spans.next(position, count) == plans.next_shards(
                    runs, plans.run_ends(runs), position, count
                )


def test_shard_spans_permute_no_shards_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    shards_made = count_shard_runs(monkeypatch)
    orders = epoch_plans.EpochPlans(ROWS, DIGEST)
    for rank in range(4):
        orders.rank_spans(plans.PlanParams(seed=1, rank=rank, world_size=4, block_size=8))
    assert shards_made == []


def test_spans_of_two_seeds_or_epochs_are_each_their_own_plans() -> None:
    orders = epoch_plans.EpochPlans(ROWS, DIGEST)
    made = {
        (seed, epoch): orders.rank_spans(plans.PlanParams(seed=seed, epoch=epoch, block_size=8))
        for seed in (1, 2)
        for epoch in (0, 1)
    }
    for (seed, epoch), spans in made.items():
        params = plans.PlanParams(seed=seed, epoch=epoch, block_size=8)
        assert spans.shards == plans.shard_order(plans.rank_runs(ROWS, DIGEST, params))
    assert len({tuple(s.shards) for s in made.values()}) == len(made)
