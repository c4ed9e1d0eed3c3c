"""What the tools' reverse look-up (`locate.sightings`: which rank, step and slot read a
sample) must agree with: the forward one, the rows of each rank's every step."""

from __future__ import annotations

from collections.abc import Sequence

from shardcache.inspect import locate


def assert_sighted_where_their_steps_hold_them(
    rows: Sequence[int], digest: str, q: locate.Query, run: locate.States | None = None
) -> list[locate.Sighting]:
    """Every sample of epoch `q.epoch` is sighted once, at the rank, step and slot whose
    `locate.step_rows` hold it, for every rank of `q.world_size` along the streams the
    run's states (`run`) recorded; the others (skipped, or consumed before an elastic
    resume) are marked so. Returns those others."""
    run = run or {}
    found = locate.sightings(rows, digest, q, range(sum(rows)), run)
    seen = {s.index: s for s in found}
    assert len(seen) == len(found) == sum(rows)
    held: set[int] = set()
    for rank in range(q.world_size):
        rq = q.replace(rank=rank)
        for step in range(locate.step_count(rows, rq, run)):
            for slot, p in enumerate(locate.step_rows(rows, digest, rq.replace(step=step), run)):
                assert seen[p.index] == locate.Sighting(p.index, q.epoch, rank, step, slot)
                held.add(p.index)
    others = [s for i, s in seen.items() if i not in held]
    assert all(s.skipped != s.before_resize for s in others), "read, skipped or consumed"
    return others
