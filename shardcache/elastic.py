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
    if first.params.sampled or other.params.sampled:
        # The window shapes a sample-mode plan only (as `states.mismatches` compares).
        keys.append("window")
    return [f"{k}: {a[k]!r} vs {b[k]!r}" for k in keys if a[k] != b[k]]


def gather(saved: Iterable[states.DataState], *, where: str = "states") -> list[states.DataState]:
    """Every old rank's state, sorted by rank, checked to be one run at one point:
    each rank 0..W-1 exactly once, and one epoch, digest, seed and plan (shuffle mode,
    block size, sample window) between them. StateMismatchError says what was expected
    and what was found."""
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
    return sorted(found, key=lambda s: s.rank)


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
