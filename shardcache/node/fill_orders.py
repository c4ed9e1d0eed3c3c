"""The order a cold epoch is filled in: every rank's plan, round robin.

All ranks of a job share one epoch order, sliced per rank (`plans`), so the first
reader that registers tells the node what every rank of its world will read, before
the others have opened the dataset (in a cold start they register over the first
tenth of a second or more, while the fetch slots could already be busy). Rank r's i-th
shard is needed at about the same time as every other rank's i-th, so the fill takes
the first shard of every rank, then the second of every rank, and so on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from shardcache import plans


def interleaved(per_rank: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """(shard, index) round robin over the ranks' lists: index is the shard's place in
    the list it is taken from; a shard already taken is not taken again."""
    out: list[tuple[int, int]] = []
    seen: set[int] = set()
    for index in range(max((len(shards) for shards in per_rank), default=0)):
        for shards in per_rank:
            if index < len(shards) and shards[index] not in seen:
                seen.add(shards[index])
                out.append((shards[index], index))
    return out


def epoch_fill(
    params: plans.PlanParams,
    position: int,
    rank_runs: Callable[[plans.PlanParams], list[plans.Run]],
    shard_count: int,
) -> list[tuple[int, int]]:
    """Every rank's upcoming shards in `params`' epoch from `position` (each rank of a
    job has read as many samples as the others: a resumed job restarts them all at the
    same step), interleaved. `rank_runs` gives a rank's runs (`EpochPlans.rank_runs`)."""
    per_rank = []
    for rank in range(params.world_size):
        runs = rank_runs(dataclasses.replace(params, rank=rank))
        per_rank.append(plans.next_shards(runs, plans.run_ends(runs), position, shard_count))
    return interleaved(per_rank)
