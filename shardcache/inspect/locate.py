"""Where samples are seen: the exact rows of (epoch, rank, step), and the reverse.

Pure functions of the manifest's row counts and the reading plan (`shardcache.plans`,
in every shuffle mode through `shardcache.placements`), so the answer is the one every
trainer computes, without reading any data. Step N of
an epoch is batch N of `Dataset.batches(batch_size)`: positions [N*B, (N+1)*B) of the
rank's stream, the last step possibly short. Given the ranges a rank skipped
(`shardcache.states.Skip`, from a run's data states), steps count only the batches
handed out, as the dataset does, and a skipped sample is reported as skipped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from shardcache import errors, placements, plans, states


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
    where it would have been without the skips)."""

    index: int
    epoch: int
    rank: int
    step: int
    slot: int
    skipped: bool = False


def rank_samples(shard_rows: Sequence[int], query: Query) -> int:
    lo, hi = plans.rank_bounds(sum(shard_rows), query.params())
    return hi - lo


def _epoch_skips(query: Query, skips: Sequence[states.Skip]) -> list[states.Skip]:
    return [s for s in skips if s.epoch == query.epoch]


def handed_out(shard_rows: Sequence[int], query: Query, skips: Sequence[states.Skip] = ()) -> int:
    """Samples the rank is handed in the epoch: its share less what it skipped."""
    samples = rank_samples(shard_rows, query)
    return sum(hi - lo for lo, hi in states.kept(_epoch_skips(query, skips), 0, samples))


def step_count(shard_rows: Sequence[int], query: Query, skips: Sequence[states.Skip] = ()) -> int:
    """Steps (batches, the last maybe short) the rank takes in the epoch."""
    return -(-handed_out(shard_rows, query, skips) // query.batch_size)


def step_rows(
    shard_rows: Sequence[int], digest: str, query: Query, skips: Sequence[states.Skip] = ()
) -> list[Provenance]:
    """The samples of `query.step`, in the order the batch holds them; `skips` are the
    rank's (any epoch), passed over as the dataset does."""
    samples = rank_samples(shard_rows, query)
    handed = handed_out(shard_rows, query, skips)
    steps = -(-handed // query.batch_size)
    if query.step >= steps:
        raise errors.InputError(
            f"step {query.step} is past the end of epoch {query.epoch} for rank {query.rank}: "
            f"expected 0 <= step < {steps} ({samples} samples at batch size {query.batch_size}"
            f", world size {query.world_size})"
        )
    offsets = plans.shard_offsets(shard_rows)
    params = query.params()
    out: list[Provenance] = []
    first = query.step * query.batch_size
    count = min(query.batch_size, handed - first)
    for start, stop in states.positions_of(_epoch_skips(query, skips), samples, first, count):
        position = start
        for lo, hi in placements.index_ranges(shard_rows, digest, params, start, stop):
            for index in range(lo, hi):
                shard, row = plans.locate(offsets, index)
                out.append(Provenance(shard, row, index, position))
                position += 1
    return out


def sightings(
    shard_rows: Sequence[int],
    digest: str,
    query: Query,
    indices: Iterable[int],
    skips: Mapping[int, Sequence[states.Skip]] | None = None,
) -> list[Sighting]:
    """Where each dataset-wide sample index is seen in `query.epoch`, for every rank of
    `query.world_size` at `query.batch_size` (`query.rank` and `query.step` are ignored).
    Every sample is seen exactly once per epoch, or skipped by its rank (`skips`, per
    rank)."""
    total = sum(shard_rows)
    wanted = sorted(set(indices))
    for index in wanted:
        if not 0 <= index < total:
            raise errors.InputError(
                f"sample index {index} is out of range: the dataset has {total} samples"
            )
    w = query.world_size
    found: list[Sighting] = []
    for index, pos in placements.global_positions(shard_rows, digest, query.params(), wanted):
        # Rank r reads [floor(N*r/W), floor(N*(r+1)/W)): start from the estimate and
        # correct for the flooring.
        rank = min(pos * w // total, w - 1)
        while total * rank // w > pos:
            rank -= 1
        while total * (rank + 1) // w <= pos:
            rank += 1
        in_rank = pos - total * rank // w
        mine = [s for s in (skips or {}).get(rank, ()) if s.epoch == query.epoch]
        skipped = states.is_skipped(mine, in_rank)
        handed = in_rank if skipped else in_rank - states.skipped_before(mine, in_rank)
        found.append(
            Sighting(
                index=index,
                epoch=query.epoch,
                rank=rank,
                step=handed // query.batch_size,
                slot=handed % query.batch_size,
                skipped=skipped,
            )
        )
    found.sort(key=lambda s: (s.index, s.epoch))
    return found
