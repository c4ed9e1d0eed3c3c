"""A run's reading history, rebuilt from the data states its checkpoints carry.

Every checkpoint holds each rank's data state: (epoch, position) plus the ranges it
skipped. Between two consecutive checkpoints of a rank, that rank read exactly the
positions from the earlier state's (epoch, position) up to the later one's, minus the
skips; the reading plan (`shardcache.plans`) turns positions into sample indices. So
the history is exact without replaying the run or reading any data. A run starts at
epoch 0, position 0 (how `shardcache.open` starts without `resume_from`).

A chain that goes backwards (a checkpoint behind its predecessor) or whose later
state lacks an earlier skip is not one run: a rewind that kept the abandoned
checkpoints. It is refused, as is a change of world size between checkpoints:
shardcache has no elastic resume, so such a chain cannot come from one run.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence

from shardcache import errors, plans, states


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """One rank's data state as published with checkpoint `step`."""

    step: int
    state: states.DataState


@dataclasses.dataclass(frozen=True)
class Span:
    """Positions [start, stop) of `epoch` that `rank` read after checkpoint `after`
    (None: the start of the run) and up to checkpoint `before`."""

    rank: int
    epoch: int
    start: int
    stop: int
    after: int | None
    before: int


@dataclasses.dataclass(frozen=True)
class History:
    """Every rank's checkpoints, validated as one run, and what each rank read."""

    digest: str
    #: The plan of epoch 0 of rank 0 (seed, world size, shuffle, block size).
    params: plans.PlanParams
    shard_rows: tuple[int, ...]
    chains: Mapping[int, tuple[Checkpoint, ...]]
    spans: tuple[Span, ...]

    @property
    def world_size(self) -> int:
        return self.params.world_size

    def rank_samples(self, rank: int) -> int:
        lo, hi = plans.rank_bounds(sum(self.shard_rows), self._rank(rank, 0))
        return hi - lo

    def steps(self) -> list[int]:
        """Checkpoint steps published by any rank, in order."""
        return sorted({c.step for chain in self.chains.values() for c in chain})

    def complete(self, step: int) -> bool:
        """Whether every rank published checkpoint `step`."""
        return all(any(c.step == step for c in chain) for chain in self.chains.values())

    def last(self, rank: int) -> states.DataState | None:
        chain = self.chains.get(rank, ())
        return chain[-1].state if chain else None

    def skips(self, rank: int) -> tuple[states.Skip, ...]:
        """The skips the rank's newest checkpoint carries (all earlier ones included)."""
        last = self.last(rank)
        return last.skips if last is not None else ()

    def batch_size(self, rank: int, before: int | None = None) -> int | None:
        for c in reversed(self.chains.get(rank, ())):
            if (before is None or c.step <= before) and c.state.batch_size is not None:
                return c.state.batch_size
        return None

    def _rank(self, rank: int, epoch: int) -> plans.PlanParams:
        return dataclasses.replace(self.params, rank=rank, epoch=epoch)

    def index_ranges(self, rank: int, epoch: int, start: int, stop: int) -> list[tuple[int, int]]:
        """Dataset-wide sample indices [lo, hi) read at positions [start, stop) of
        `epoch` by `rank`, in reading order, adjacent ranges merged."""
        offsets = plans.shard_offsets(self.shard_rows)
        runs = plans.rank_runs(self.shard_rows, self.digest, self._rank(rank, epoch))
        out: list[tuple[int, int]] = []
        pos = 0
        for run in runs:
            lo, hi = max(start, pos), min(stop, pos + len(run))
            if lo < hi:
                first = offsets[run.shard] + run.start + lo - pos
                last = first + hi - lo
                if out and out[-1][1] == first:
                    out[-1] = (out[-1][0], last)
                else:
                    out.append((first, last))
            pos += len(run)
            if pos >= stop:
                break
        return out


def _interval(
    start: tuple[int, int], stop: tuple[int, int], rank_samples: int
) -> list[tuple[int, int, int]]:
    """(epoch, start, stop) position ranges from one (epoch, position) to another."""
    (e0, p0), (e1, p1) = start, stop
    if e0 == e1:
        return [(e0, p0, p1)] if p1 > p0 else []
    out = [(e0, p0, rank_samples)] if rank_samples > p0 else []
    out += [(e, 0, rank_samples) for e in range(e0 + 1, e1) if rank_samples]
    if p1:
        out.append((e1, 0, p1))
    return out


def _covered(skip: states.Skip, skips: Sequence[states.Skip]) -> bool:
    return any(
        s.epoch == skip.epoch and s.start <= skip.start and skip.stop <= s.stop for s in skips
    )


def build(
    digest: str,
    shard_rows: Sequence[int],
    chains: Mapping[int, Sequence[Checkpoint]],
    *,
    where: str = "the checkpoints",
) -> History:
    """Validate every rank's chain of checkpoints as one run over the dataset
    (`digest`, `shard_rows`) and compute what each rank read between checkpoints."""
    nonempty = {r: sorted(c, key=lambda c: c.step) for r, c in chains.items() if c}
    if not nonempty:
        raise errors.InputError(f"{where}: no published checkpoint with a data state")
    first = next(iter(nonempty.values()))[0]
    base = dataclasses.replace(first.state.params, rank=0, epoch=0)
    worlds = sorted({c.state.world_size for chain in nonempty.values() for c in chain})
    if len(worlds) > 1:
        changes = []
        for rank, chain in sorted(nonempty.items()):
            for older, newer in itertools.pairwise(chain):
                if older.state.world_size != newer.state.world_size:
                    changes.append(
                        f"rank {rank}: {older.state.world_size} at step {older.step}, "
                        f"{newer.state.world_size} at step {newer.step}"
                    )
        raise errors.InputError(
            f"{where}: the world size changes between checkpoints ({'; '.join(changes) or worlds}); "
            "shardcache has no elastic resume, so these data states cannot come from one run: "
            "point --checkpoint-uri at one run's checkpoints"
        )
    world = worlds[0]
    missing = [r for r in range(world) if r not in nonempty]
    if missing:
        raise errors.InputError(
            f"{where}: the data states are of world size {world}, but ranks {missing} have no "
            "checkpoint: every rank publishes under <uri>/rank-<r> (what the webhook sets up "
            "for ranked pods); point --checkpoint-uri at the URI above those prefixes"
        )
    total = sum(shard_rows)
    spans: list[Span] = []
    for rank, chain in sorted(nonempty.items()):
        lo, hi = plans.rank_bounds(total, dataclasses.replace(base, rank=rank))
        samples = hi - lo
        prev: Checkpoint | None = None
        clamped: list[Checkpoint] = []
        for ckpt in chain:
            s = states.clamp(ckpt.state, samples)
            label = f"{where}: rank {rank} step {ckpt.step}"
            if s.digest != digest:
                raise errors.InputError(
                    f"{label}: the data state is of dataset {s.digest}, expected {digest}: "
                    "open the dataset the run read"
                )
            if s.rank != rank:
                raise errors.InputError(f"{label}: the data state is of rank {s.rank}")
            if dataclasses.replace(s.params, rank=0, epoch=0) != base or (
                s.plan_version != first.state.plan_version
            ):
                raise errors.InputError(
                    f"{label}: the reading plan differs from step {first.step}'s "
                    f"({s.params} vs {base}): not one run"
                )
            if s.position > samples:
                raise errors.InputError(
                    f"{label}: position {s.position} is past the end of the epoch ({samples})"
                )
            begin = (prev.state.epoch, prev.state.position) if prev is not None else (0, 0)
            if (s.epoch, s.position) < begin:
                raise errors.InputError(
                    f"{label}: the data state (epoch {s.epoch}, position {s.position}) is "
                    f"behind step {prev.step if prev else '?'}'s (epoch {begin[0]}, position "
                    f"{begin[1]}): the run was rewound and the abandoned checkpoints kept; "
                    "`shardcache skip` sets them aside"
                )
            if prev is not None:
                lost = [k for k in prev.state.skips if not _covered(k, s.skips)]
                if lost:
                    raise errors.InputError(
                        f"{label}: the data state lacks skips that step {prev.step} carries "
                        f"({[k.to_json() for k in lost]}): not one run"
                    )
            for epoch, a, b in _interval(begin, (s.epoch, s.position), samples):
                for x, y in states.kept(s.skips_in(epoch), a, b):
                    spans.append(Span(rank, epoch, x, y, prev.step if prev else None, ckpt.step))
            prev = Checkpoint(ckpt.step, s)
            clamped.append(prev)
        nonempty[rank] = clamped
    return History(
        digest=digest,
        params=dataclasses.replace(base, world_size=world),
        shard_rows=tuple(shard_rows),
        chains={r: tuple(c) for r, c in sorted(nonempty.items())},
        spans=tuple(spans),
    )
