"""What the tools' reverse look-up (`locate.sightings`: which rank, step and slot read a
sample) must agree with: the forward one, the rows of each rank's every step."""

from __future__ import annotations

from collections.abc import Sequence

from shardcache.inspect import locate


def assert_sighted_where_their_steps_hold_them(
    rows: Sequence[int], digest: str, q: locate.Query
) -> None:
    """Every sample of epoch `q.epoch` is sighted once, at the rank, step and slot whose
    `locate.step_rows` hold it, for every rank of `q.world_size`."""
    seen = {s.index: s for s in locate.sightings(rows, digest, q, range(sum(rows)))}
    assert len(seen) == sum(rows)
    for rank in range(q.world_size):
        rq = q.replace(rank=rank)
        for step in range(locate.step_count(rows, rq)):
            for slot, p in enumerate(locate.step_rows(rows, digest, rq.replace(step=step))):
                assert seen[p.index] == locate.Sighting(p.index, q.epoch, rank, step, slot)
