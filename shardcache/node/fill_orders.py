"""The order a cold epoch is filled in: every registered reader's plan, round robin.

Each rank reads its slice of the epoch at about the same pace as the others, so rank
r's i-th shard is needed at about the same time as every other rank's i-th: the fill
takes every reader's next shard, then every reader's second, and so on. Only readers
that registered: a sidecar that serves one rank of a job never fetches the shards of
ranks served by other pods.
"""

from __future__ import annotations

from collections.abc import Sequence


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
