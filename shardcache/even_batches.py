"""Where `drop_last=True` ends a rank's batches, so every rank of an epoch yields the
same number of them.

Rule 5 gives ranks sizes that differ by one row (an elastic resize, rule 8, too), so
cutting each rank's own rows into whole batches gave some ranks one batch more: in a
data-parallel job those ranks wait at the epoch's end in a collective (an all-reduce)
the others never join. With `drop_last` every rank cuts its batches only from the
first `least` positions of its stream, `least` being the fewest rows any rank of the
epoch reads (as torch's `DistributedSampler(drop_last=True)` trims every rank to
floor(N/W)); the rows after the last whole batch are passed over as consumed, so a
state taken after it says the epoch is done (docs/reading-plan.md, "What it means for
batches"). Ranks at one step stand at one position (same batches, same skips), so
they stop together. Pure functions: `Dataset`'s walks call them.
"""

from __future__ import annotations

from shardcache import plans


def least_samples(total_rows: int, params: plans.PlanParams) -> int:
    """The fewest samples any rank reads in `params.epoch`: floor(N/W) under rule 5, or
    after an elastic resize the smallest new rank's part, which the segments record
    (a state resized before they did: this rank's own, the best it knows)."""
    seg = params.segments
    if seg is not None and seg.epoch == params.epoch:
        return len(seg) if seg.least is None else seg.least
    return total_rows // params.world_size


def stop(position: int, batch_size: int, least: int) -> int:
    """The position where batches cut from `position` end with `drop_last`: after the
    last whole batch that fits in the first `least` positions (`position` itself when
    none does)."""
    return position + max(0, least - position) // batch_size * batch_size
