"""Elastic resume: the data states of W ranks become the states of W' ranks.

Rules (docs/reading-plan.md, "Elastic resume"): in the epoch e of the checkpoint, each
old rank consumed the first `position` samples of its stream (`plans.stream_ranges`;
skipped samples count as consumed). What every old rank left, put in the order of the
epoch's global sequence, is cut into W' contiguous parts whose sizes differ by at most
one; new rank r' reads part r' as its segments in epoch e, from position 0, and they
record the smallest part's size (where `drop_last` ends every new rank's batches). Epochs
after e follow rule 5 at the new world size. A resized state carries its segments, so
it resumes again at the same or another world size (chains such as 4 -> 3 -> 5).

Pure functions over parsed states: `Dataset.load_state_dict`, the checkpoint agent and
`shardcache lineage` all call them, so they agree on who reads what.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Sequence

from shardcache import errors, plans, states, streams

#: What every old rank's state must agree on to be one run's checkpoint. The shuffle
#: granularity and (in sample mode) the window shape the epoch's global sequence as much
#: as the seed does: ranks that disagree on them read ranges of different sequences, so
#: a cut of what they left deals out other rows than those (some twice, some never).
_SHARED = (
    "plan_version",
    "digest",
    "seed",
    "shuffle",
    "granularity",
    "block_size",
    "world_size",
    "epoch",
)


def _differences(first: states.DataState, other: states.DataState) -> list[str]:
    """What `other` does not share with `first`, as `key: first's vs other's`."""
    a, b = first.to_json(), other.to_json()
    keys = list(_SHARED)
    if first.params.sampled and other.params.sampled:
        # The window shapes a sample-mode plan only (as `states.mismatches` compares);
        # beside a block-mode state the granularity already differs.
        keys.append("window")
    return [f"{k}: {a[k]!r} vs {b[k]!r}" for k in keys if a[k] != b[k]]


def gather(saved: Iterable[states.DataState], *, where: str = "states") -> list[states.DataState]:
    """Every old rank's state, sorted by rank, checked to be one run at one point:
    each rank 0..W-1 exactly once, one epoch, digest, seed and plan (shuffle mode,
    block size, sample window) between them, and streams of that epoch that do not
    overlap. StateMismatchError says what was expected and what was found."""
    found = list(saved)
    if not found:
        raise errors.StateMismatchError(f"{where}: no state given: expected one per old rank")
    for s in found[1:]:
        differ = _differences(found[0], s)
        if differ:
            raise errors.StateMismatchError(
                f"{where}: the states are not of one run at one point (rank {found[0].rank} "
                f"vs rank {s.rank}: {'; '.join(differ)}): give the states of every rank from "
                "one checkpoint step"
            )
    world = found[0].world_size
    ranks = sorted(s.rank for s in found)
    duplicate = sorted({r for r in ranks if ranks.count(r) > 1})
    missing = sorted(set(range(world)) - set(ranks))
    if duplicate or missing:
        raise errors.StateMismatchError(
            f"{where}: expected one state for each of the {world} old ranks 0..{world - 1}, "
            f"found ranks {ranks} (missing {missing}, duplicated {duplicate}): give the state "
            "every rank saved at one checkpoint step"
        )
    ordered = sorted(found, key=lambda s: s.rank)
    _refuse_other_resizes(ordered, where=where)
    return ordered


def _segments_now(state: states.DataState) -> streams.Segments | None:
    """The segments `state` reads its epoch by (None: its rule-5 range)."""
    seg = state.params.segments
    return seg if seg is not None and seg.epoch == state.epoch else None


def _refuse_other_resizes(ordered: Sequence[states.DataState], *, where: str) -> None:
    """Refuse states that agree on the plan and the epoch but were not read by one run
    at one point: some ranks in segments of an elastic resume and others in their rule-5
    ranges, or ranges two ranks share (states of two resizes, or from before and after
    one). Their ranks' streams overlap and leave rows to no one, so any cut of what
    they left reads some rows twice and others never. Ranks not in lockstep stay
    allowed: a position alone cannot tell one step from another."""
    now = {s.rank: _segments_now(s) for s in ordered}
    segmented = [rank for rank, seg in now.items() if seg is not None]
    plain = [rank for rank, seg in now.items() if seg is None]
    epoch = ordered[0].epoch
    if segmented and plain:
        raise errors.StateMismatchError(
            f"{where}: the states are not of one run at one point: ranks {segmented} read "
            f"epoch {epoch} in the segments an elastic resume gave them, ranks {plain} read "
            "the epoch's plain rule-5 ranges (states from before that resume, or of another "
            "run): give the state every rank saved at one checkpoint step"
        )
    # One resize records one smallest part (a state resized before `least` was
    # recorded has none, and is compared by its ranges only).
    leasts = {
        rank: seg.least for rank, seg in now.items() if seg is not None and seg.least is not None
    }
    if len(set(leasts.values())) > 1:
        raise errors.StateMismatchError(
            f"{where}: the states are not of one run at one point: their segments of epoch "
            f"{epoch} come from different elastic resumes (the smallest part, by rank: "
            f"{leasts}; one resume records one): give the state every rank saved at one "
            "checkpoint step"
        )
    owned = sorted(
        (a, b, rank) for rank, seg in now.items() if seg is not None for a, b in seg.ranges
    )
    for (_, b, first), (c, d, second) in itertools.pairwise(owned):
        if c < b:
            raise errors.StateMismatchError(
                f"{where}: the states are not of one run at one point: ranks {first} and "
                f"{second} both read positions [{c}, {min(b, d)}) of epoch {epoch}'s global "
                "sequence in their segments (expected disjoint parts, as one elastic resume "
                "deals them): give the state every rank saved at one checkpoint step"
            )


def remainder(saved: Sequence[states.DataState], total_rows: int) -> list[streams.Range]:
    """The ranges of the epoch's global sequence no old rank consumed, in global order."""
    left: list[streams.Range] = []
    for s in saved:
        ranges = plans.stream_ranges(total_rows, s.params)
        samples = streams.length(ranges)
        s = states.clamp(s, samples)
        if s.position > samples:
            raise errors.StateMismatchError(
                f"rank {s.rank}: position {s.position} is past the end of epoch {s.epoch} "
                f"({samples} samples)"
            )
        left.extend(streams.cut(ranges, s.position, samples))
    return streams.in_global_order(left)


def resize(
    saved: Iterable[states.DataState], *, total_rows: int, world_size: int
) -> list[states.DataState]:
    """The state of each of `world_size` new ranks (index = rank) that resumes the run
    the old ranks' states (`saved`, one per old rank) stopped at."""
    old = gather(saved)
    if world_size < 1:
        raise errors.InputError(f"world_size must be >= 1, got {world_size}")
    first = old[0]
    rest = remainder(old, total_rows)
    parts = streams.split(rest, world_size)
    # The smallest part: where drop_last ends every new rank's batches in this epoch, so
    # they yield the same count (a rank knows only its own part once saved and resumed).
    least = streams.length(rest) // world_size
    sizes = {s.batch_size for s in old}
    # The batch size says what `skip_batches` and lineage count in; keep it only when
    # the old ranks agree on it.
    batch_size = sizes.pop() if len(sizes) == 1 else None
    return [
        states.DataState(
            digest=first.digest,
            params=dataclasses.replace(
                first.params,
                rank=rank,
                world_size=world_size,
                segments=streams.Segments(first.epoch, tuple(part), least),
            ),
            position=0,
            batch_size=batch_size,
            plan_version=first.plan_version,
        )
        for rank, part in enumerate(parts)
    ]
