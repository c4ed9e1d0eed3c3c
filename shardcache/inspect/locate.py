"""Where samples are seen: the exact rows of (epoch, rank, step), and the reverse.

Pure functions of the manifest's row counts and the reading plan (`shardcache.plans`,
in every shuffle mode through `shardcache.placements`), so the answer is the one every
trainer computes, without reading any data. Step N of
an epoch is batch N of `Dataset.batches(batch_size)`: positions [N*B, (N+1)*B) of the
rank's stream, the last step possibly short. Given a run's data states
(`shardcache.states.DataState`, by rank), a rank's stream is the one it read: its
elastic-resume segments in the epoch they cover (`plans.stream_ranges`), and steps
count only the batches handed out, its skips passed over as the dataset does; a
skipped sample is reported as skipped.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import types
from collections.abc import Iterable, Mapping, Sequence

from shardcache import errors, placements, plans, states

#: A run's data states by rank: what each rank skipped and, after an elastic resume,
#: the segments it reads. Empty: every rank follows the plan (rule 5), nothing skipped.
States = Mapping[int, states.DataState]
# Read-only: it is every function's default.
_NONE: States = types.MappingProxyType({})


@dataclasses.dataclass(frozen=True)
class Query:
    """One step of one rank: what the inspector shows."""

    epoch: int = 0
    rank: int = 0
    world_size: int = 1
    step: int = 0
    batch_size: int = 32
    seed: int = 0
    shuffle: bool = True
    block_size: int = plans.DEFAULT_BLOCK_SIZE
    #: What `shuffle` permutes: "block", or "sample" (rows within windows, plan v2).
    granularity: str = plans.BLOCK
    #: Rows per sample-shuffle window ("sample" only).
    window: int = plans.DEFAULT_WINDOW

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise errors.InputError(f"world size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise errors.InputError(
                f"rank {self.rank} is out of range: expected 0 <= rank < world size "
                f"{self.world_size}"
            )
        if self.batch_size < 1:
            raise errors.InputError(f"batch size must be >= 1, got {self.batch_size}")
        if self.step < 0:
            raise errors.InputError(f"step must be >= 0, got {self.step}")
        if self.epoch < 0:
            raise errors.InputError(f"epoch must be >= 0, got {self.epoch}")

    def params(self) -> plans.PlanParams:
        return plans.PlanParams(
            seed=self.seed,
            epoch=self.epoch,
            rank=self.rank,
            world_size=self.world_size,
            shuffle=self.shuffle,
            block_size=self.block_size,
            granularity=self.granularity,
            window=self.window,
        )

    def replace(self, **changes: int | bool | str) -> Query:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True)
class Provenance:
    """Where one sample of a step comes from."""

    #: Index of the shard in the manifest.
    shard: int
    #: Row inside that shard.
    row: int
    #: Dataset-wide sample index (position in manifest order).
    index: int
    #: Position in the rank's stream for the epoch (samples handed out before it).
    position: int


@dataclasses.dataclass(frozen=True)
class Sighting:
    """Sample `index` is seen by `rank` at `step` of `epoch`, as row `slot` of the batch;
    or, `skipped`, would have been but the rank skipped it (`step` and `slot` are then
    where it would have been without the skips); or, `before_resize`, no rank of this
    world size reads it in `epoch`: the run's states resumed the epoch elastically, and
    a rank of the earlier world size had consumed it (rank, step and slot are None;
    `shardcache lineage` follows the earlier ranks)."""

    index: int
    epoch: int
    rank: int | None
    step: int | None
    slot: int | None
    skipped: bool = False
    before_resize: bool = False


def state_mismatches(digest: str, query: Query, state: states.DataState) -> list[str]:
    """How the plan `state` was saved under differs from `query`'s (dataset, world
    size, seed, shuffle, block size, granularity, window, and the batch size it
    records), in words: its skips and segments are positions of its own plan,
    meaningless in another, and its step N is a batch of its own batch size."""
    ours = states.DataState(digest=digest, params=query.params(), position=0)
    out = states.mismatches(state, ours, ours_name="the inspector", same_rank=False)
    if state.batch_size is not None and state.batch_size != query.batch_size:
        out.append(
            f"batch_size: state has {state.batch_size}, the inspector has {query.batch_size}"
        )
    return out


def _resized(run: States, epoch: int) -> list[int]:
    """Ranks whose state reads `epoch` as segments (the epoch of an elastic resume)."""
    return sorted(
        r
        for r, s in run.items()
        if s.params.segments is not None and s.params.segments.epoch == epoch
    )


def rank_plan(query: Query, run: States = _NONE) -> plans.PlanParams:
    """`query.rank`'s plan in `query.epoch`, with the segments its state carries."""
    params = query.params()
    state = run.get(query.rank)
    if state is not None:
        return dataclasses.replace(params, segments=state.params.segments)
    resized = _resized(run, query.epoch)
    if resized:
        # Every rank of a resumed world size reads segments in that epoch; without the
        # rank's own state its rule-5 range would be rows it never reads.
        raise errors.InputError(
            f"rank {query.rank}'s stream in epoch {query.epoch} is not known: the data "
            f"states of ranks {resized} read that epoch as segments (an elastic resume "
            f"to world size {query.world_size}), so rank {query.rank} does too: give "
            f"rank {query.rank}'s data state as well"
        )
    return params


def rank_samples(shard_rows: Sequence[int], query: Query, run: States = _NONE) -> int:
    return plans.rank_samples(sum(shard_rows), rank_plan(query, run))


def _epoch_skips(query: Query, run: States) -> list[states.Skip]:
    state = run.get(query.rank)
    return state.skips_in(query.epoch) if state is not None else []


def handed_out(shard_rows: Sequence[int], query: Query, run: States = _NONE) -> int:
    """Samples the rank is handed in the epoch: its stream less what it skipped."""
    samples = rank_samples(shard_rows, query, run)
    return sum(hi - lo for lo, hi in states.kept(_epoch_skips(query, run), 0, samples))


def step_count(shard_rows: Sequence[int], query: Query, run: States = _NONE) -> int:
    """Steps (batches, the last maybe short) the rank takes in the epoch."""
    return -(-handed_out(shard_rows, query, run) // query.batch_size)


def step_rows(
    shard_rows: Sequence[int], digest: str, query: Query, run: States = _NONE
) -> list[Provenance]:
    """The samples of `query.step`, in the order the batch holds them, along the rank's
    stream as `run` (the run's states, by rank) recorded it."""
    params = rank_plan(query, run)
    samples = plans.rank_samples(sum(shard_rows), params)
    skips = _epoch_skips(query, run)
    handed = sum(hi - lo for lo, hi in states.kept(skips, 0, samples))
    steps = -(-handed // query.batch_size)
    if steps == 0:
        raise errors.InputError(
            f"rank {query.rank} is handed no samples in epoch {query.epoch}, so there is no "
            f"step {query.step} ({sum(shard_rows)} samples in the dataset, world size "
            f"{query.world_size})"
        )
    if query.step >= steps:
        raise errors.InputError(
            f"step {query.step} is past the end of epoch {query.epoch} for rank {query.rank}: "
            f"expected 0 <= step < {steps} ({samples} samples at batch size {query.batch_size}"
            f", world size {query.world_size})"
        )
    offsets = plans.shard_offsets(shard_rows)
    out: list[Provenance] = []
    first = query.step * query.batch_size
    count = min(query.batch_size, handed - first)
    for start, stop in states.positions_of(skips, samples, first, count):
        position = start
        for lo, hi in placements.index_ranges(shard_rows, digest, params, start, stop):
            for index in range(lo, hi):
                shard, row = plans.locate(offsets, index)
                out.append(Provenance(shard, row, index, position))
                position += 1
    return out


@dataclasses.dataclass(frozen=True, order=True)
class _Piece:
    """Global-sequence positions [lo, hi) of the epoch, read by `rank` from stream
    position `position` on."""

    lo: int
    hi: int
    rank: int
    position: int


def _coverage(total: int, query: Query, run: States) -> list[_Piece]:
    """Who reads each position of `query.epoch`'s global sequence, sorted: every
    rank's rule-5 range, or in the epoch of an elastic resume its segments (which
    leave out what the earlier ranks had consumed)."""
    out: list[_Piece] = []
    for rank in range(query.world_size):
        pos = 0
        for lo, hi in plans.stream_ranges(total, rank_plan(query.replace(rank=rank), run)):
            out.append(_Piece(lo, hi, rank, pos))
            pos += hi - lo
    out.sort()
    for a, b in itertools.pairwise(out):
        if b.lo < a.hi:
            raise errors.InputError(
                f"the data states are not of one run: in epoch {query.epoch}, ranks {a.rank} "
                f"and {b.rank} both read position {b.lo} of the global sequence"
            )
    return out


def sightings(
    shard_rows: Sequence[int],
    digest: str,
    query: Query,
    indices: Iterable[int],
    run: States = _NONE,
) -> list[Sighting]:
    """Where each dataset-wide sample index is seen in `query.epoch`, for every rank of
    `query.world_size` at `query.batch_size` (`query.rank` and `query.step` are ignored),
    along the streams `run` (the run's states, by rank) recorded. Every sample is seen
    exactly once per epoch, or skipped by its rank, or, in the epoch of an elastic
    resume, consumed before it."""
    total = sum(shard_rows)
    wanted = sorted(set(indices))
    for index in wanted:
        if not 0 <= index < total:
            raise errors.InputError(
                f"sample index {index} is out of range: the dataset has {total} samples"
            )
    pieces = _coverage(total, query, run)
    starts = [p.lo for p in pieces]
    found: list[Sighting] = []
    for index, pos in placements.global_positions(shard_rows, digest, query.params(), wanted):
        i = bisect.bisect_right(starts, pos) - 1
        if i < 0 or pos >= pieces[i].hi:
            found.append(Sighting(index, query.epoch, None, None, None, before_resize=True))
            continue
        piece = pieces[i]
        in_rank = piece.position + pos - piece.lo
        mine = _epoch_skips(query.replace(rank=piece.rank), run)
        skipped = states.is_skipped(mine, in_rank)
        handed = in_rank if skipped else in_rank - states.skipped_before(mine, in_rank)
        found.append(
            Sighting(
                index=index,
                epoch=query.epoch,
                rank=piece.rank,
                step=handed // query.batch_size,
                slot=handed % query.batch_size,
                skipped=skipped,
            )
        )
    found.sort(key=lambda s: (s.index, s.epoch))
    return found
