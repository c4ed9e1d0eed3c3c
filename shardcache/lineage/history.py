"""A run's reading history, rebuilt from the data states its checkpoints carry.

Every checkpoint holds each rank's data state: (epoch, position) plus the ranges it
skipped. Between two consecutive checkpoints of a rank, that rank read exactly the
positions from the earlier state's (epoch, position) up to the later one's, minus the
skips; the reading plan (`shardcache.plans`) turns positions into sample indices. So
the history is exact without replaying the run or reading any data. A run starts at
epoch 0, position 0 (how `shardcache.open` starts without `resume_from`).

A reader may read an epoch again from its start (a second pass: iterating the numpy
batches or the torch dataset again after a pass reached the epoch's end, as a
validation loop does); that pass drops the epoch's skips and records its own
(`states.moved`). So a checkpoint of the same epoch as its predecessor that is behind
it, or lacks one of its skips of that epoch, is a later pass over the epoch, not a
rewind: the rank read on from the predecessor's position to the end of the epoch
(less the skips it carries), then from position 0 to the checkpoint's (less the skips
the checkpoint carries). Each span names its pass, and `Generation.restarts` keeps the
skips each earlier pass made. A skip an earlier pass made after its last checkpoint
(a `skip_batches`, the rows `drop_last` trims at the end) is in no state: the pass that
followed dropped it, so lineage counts those rows as read. States cannot tell two
passes between one pair of checkpoints from one; lineage takes the fewest. A view that
follows the run (`newest_states`) takes the pass it shows, so a step of an earlier
pass is rendered with that pass's skips, not the newest state's.

A chain that goes back to an earlier epoch, or whose later state lacks a skip of
another epoch, is not one run: a rewind that kept the abandoned checkpoints. It is
refused.

A change of world size (an elastic resume, `shardcache.elastic`) starts a new
generation: the steps in order, cut where the world size changes. The first states of
generation g carry segments that must be what `elastic.resize` makes of generation
g-1's states at its newest step every rank published (else the run did not resume
from them, and it is refused); each rank of generation g starts at position 0 of its
segments in the epoch of the resize. Ranks of different generations that share a
number are different readers: spans and queries name the generation. A resize during a
later pass over an epoch (`Generation.first_pass`, `ended_pass`) leaves the earlier
passes to the old generation, read to the epoch's end; the new ranks' segments go on
with the pass the old ranks were in (they must all have been in the same one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from shardcache import elastic, errors, placements, plans, states


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
    #: Which generation (world size) read it; its plan for `rank` (segments included).
    generation: int = 0
    plan: plans.PlanParams | None = None
    #: Which pass over `epoch` read it: 0 the first, 1 a second pass from the epoch's
    #: start, and so on.
    pass_index: int = 0


@dataclasses.dataclass(frozen=True)
class Restart:
    """Checkpoint `step` is in a later pass over `epoch` than its predecessor: the
    earlier pass ended there, having made `skips` (the predecessor's of `epoch`)."""

    step: int
    epoch: int
    skips: tuple[states.Skip, ...]


@dataclasses.dataclass(frozen=True)
class Generation:
    """The checkpoints of one world size, from the start or from an elastic resume."""

    index: int
    #: The plan of rank 0 in epoch 0, without segments.
    params: plans.PlanParams
    chains: Mapping[int, tuple[Checkpoint, ...]]
    #: Where its ranks start: (0, 0), or (epoch of the resize, 0) of their segments.
    start_epoch: int
    #: The step of the previous generation it resumed from (None for the first).
    resumed_from: int | None
    #: Each rank's last (epoch, position) before the next generation took over; None
    #: for the newest generation.
    ended: Mapping[int, tuple[int, int]] | None
    #: Per rank, oldest first: the checkpoints that start reading an epoch again.
    restarts: Mapping[int, tuple[Restart, ...]] = dataclasses.field(default_factory=dict)
    #: The pass over `start_epoch` its ranks' reading goes on with: the one the
    #: previous generation's ranks were in at the resize (0 for the first generation).
    first_pass: int = 0
    #: Each rank's pass over `ended`'s epoch when the next generation took over: the
    #: earlier passes read that epoch to its end, this one up to `ended`'s position.
    ended_pass: Mapping[int, int] | None = None

    @property
    def world_size(self) -> int:
        return self.params.world_size

    def pass_skips(self, rank: int, epoch: int) -> list[tuple[states.Skip, ...]]:
        """The skips of `epoch` of each pass `rank` made over it, oldest first: an
        earlier pass's as its last checkpoint carries them, the last pass's as the
        rank's newest checkpoint does. One entry for an epoch read once."""
        chain = self.chains.get(rank, ())
        newest = tuple(chain[-1].state.skips_in(epoch)) if chain else ()
        earlier = [r.skips for r in self.restarts.get(rank, ()) if r.epoch == epoch]
        return [*earlier, newest]

    def passes(self, rank: int, epoch: int) -> dict[int, tuple[states.Skip, ...]]:
        """`pass_skips` keyed by the run's pass index over `epoch`: this generation's
        passes over its start epoch go on from `first_pass`."""
        offset = self.first_pass if epoch == self.start_epoch else 0
        return {offset + n: skips for n, skips in enumerate(self.pass_skips(rank, epoch))}

    def steps(self) -> list[int]:
        return sorted({c.step for chain in self.chains.values() for c in chain})

    def plan(self, rank: int, epoch: int) -> plans.PlanParams:
        """`rank`'s plan in `epoch`: with the segments its states carry."""
        chain = self.chains.get(rank, ())
        seg = chain[0].state.params.segments if chain else None
        return dataclasses.replace(self.params, rank=rank, epoch=epoch, segments=seg)

    def last(self, rank: int) -> states.DataState | None:
        """`rank`'s newest data state in this generation (None: no such rank)."""
        chain = self.chains.get(rank, ())
        return chain[-1].state if chain else None

    def batch_size(self, rank: int, before: int | None = None) -> int | None:
        """The batch size `rank`'s newest state up to step `before` (any: None) of this
        generation records; None when none does."""
        for c in reversed(self.chains.get(rank, ())):
            if (before is None or c.step <= before) and c.state.batch_size is not None:
                return c.state.batch_size
        return None


@dataclasses.dataclass(frozen=True)
class History:
    """Every rank's checkpoints, validated as one run, and what each rank read."""

    digest: str
    #: The plan of epoch 0 of rank 0 (seed, world size, shuffle, block size).
    params: plans.PlanParams
    shard_rows: tuple[int, ...]
    spans: tuple[Span, ...]
    #: One per world size the run had, oldest first; `params` above is the first's (a
    #: run that never resized has one). Each rank's checkpoints are per generation
    #: (`Generation.chains`, `last`, `batch_size`): rank numbers are per world size.
    generations: tuple[Generation, ...] = ()

    def generation_of(self, step: int) -> Generation:
        for gen in self.generations:
            if step in gen.steps():
                return gen
        return self.generations[-1]

    @property
    def world_size(self) -> int:
        return self.params.world_size

    def steps(self) -> list[int]:
        """Checkpoint steps published by any rank (any generation), in order."""
        return sorted({s for g in self.generations for s in g.steps()})

    def complete(self, step: int) -> bool:
        """Whether every rank (of the step's world size) published checkpoint `step`."""
        chains = self.generation_of(step).chains
        return all(any(c.step == step for c in chain) for chain in chains.values())

    def read_again(self, rank: int) -> dict[int, list[tuple[states.Skip, ...]]]:
        """The epochs the rank (of the first generation: what `shardcache diff` reads of
        a run that never resized) read more than once, each with the skips of every
        pass over it, oldest first (`Generation.pass_skips`)."""
        if not self.generations:
            return {}
        gen = self.generations[0]
        epochs = sorted({r.epoch for r in gen.restarts.get(rank, ())})
        return {e: gen.pass_skips(rank, e) for e in epochs}

    def skips(self, rank: int, generation: int = 0) -> tuple[tuple[int, states.Skip], ...]:
        """Every skip the rank (of `generation`, the first by default) made, with the
        run's pass over its epoch it was made in (0 the first; `Generation.passes`), in
        (epoch, pass, position) order. The newest checkpoint carries only the last
        pass's skips of an epoch read again; the earlier passes' come from the
        checkpoints that ended them (`Restart`). Ranks of different generations are
        different readers: ask for each generation's (`every_skip`)."""
        if not 0 <= generation < len(self.generations):
            return ()
        gen = self.generations[generation]
        chain = gen.chains.get(rank, ())
        newest = chain[-1].state.skips if chain else ()
        epochs = {s.epoch for s in newest} | {r.epoch for r in gen.restarts.get(rank, ())}
        out = [(n, s) for e in epochs for n, ks in gen.passes(rank, e).items() for s in ks]
        return tuple(sorted(out, key=lambda p: (p[1].epoch, p[0], p[1].start)))

    def every_skip(self) -> list[tuple[int, int, int, states.Skip]]:
        """(generation, rank, pass, skip) of every rank of every generation (`skips`),
        in generation, then rank order."""
        return [
            (g.index, rank, n, s)
            for g in self.generations
            for rank in sorted(g.chains)
            for n, s in self.skips(rank, g.index)
        ]

    def newest_states(
        self, view: plans.PlanParams, epoch: int, pass_index: int | None = None
    ) -> dict[int, states.DataState]:
        """Each rank's newest data state (its skips, and its segments after an elastic
        resume) in the generation whose plan `view` is (seed, world size, shuffle
        mode, block size, window), so a step viewed in `epoch` is what that rank was
        handed; none when no generation has that plan. What a view that follows the
        run reads (`shardcache inspect --checkpoint-uri`, the web inspector's).

        A run that went back to an earlier world size (4 -> 2 -> 4) has two generations
        of one plan: `epoch` picks the latest that had started by then.

        The newest state carries only the last pass's skips of an epoch read again;
        `pass_index` (the run's, 0 the first; `view_passes`) puts that pass's skips of
        `epoch` in their place, so a step of an earlier pass is what was handed then. A
        rank that has not begun that pass has skipped nothing in it yet. A pass the
        generation did not make is refused, naming those it made. None shows the newest
        pass any rank of the generation made over `epoch` (what `pass_note` says is
        shown), for every rank: a rank whose newest checkpoint is still in an earlier
        pass has skipped nothing in that one yet, so its skips of that earlier pass are
        not the newest pass's."""
        gen = self._viewed(view, epoch)
        if gen is None:
            return {}
        newest = {rank: chain[-1].state for rank, chain in gen.chains.items() if chain}
        made = _passes_of(gen, epoch)
        shown = max(made) if pass_index is None else pass_index
        if shown not in made:
            raise errors.InputError(
                f"pass {shown + 1} over epoch {epoch}: expected one of the passes the "
                f"world size {gen.world_size} ranks made over it (from 1: "
                f"{', '.join(str(n + 1) for n in made)}), found pass {shown + 1}"
            )
        return {
            rank: _with_pass_skips(state, epoch, gen.passes(rank, epoch).get(shown, ()))
            for rank, state in newest.items()
        }

    def view_passes(self, view: plans.PlanParams, epoch: int) -> list[int]:
        """The run's passes over `epoch` (0 the first) that the ranks of the generation
        `view` selects (`newest_states`) made, oldest first; none for no generation."""
        gen = self._viewed(view, epoch)
        return _passes_of(gen, epoch) if gen is not None else []

    def pass_note(self, view: plans.PlanParams, epoch: int, shown: int | None) -> str:
        """What a view of an epoch the generation `view` selects read more than once
        says (nothing for one read): which pass it shows (`shown`, the run's index from
        0; None the newest) of how many, and how to pick another."""
        made = self.view_passes(view, epoch)
        if not made or max(made) == 0:
            return ""
        showing = max(made) if shown is None else shown
        return (
            f"epoch {epoch} was read {max(made) + 1} times by this run; showing pass "
            f"{showing + 1} (--pass / pass= selects another)"
        )

    def _viewed(self, view: plans.PlanParams, epoch: int) -> Generation | None:
        key = _plan_key(view)
        same = [g for g in self.generations if _plan_key(g.params) == key]
        if not same:
            return None
        started = [g for g in same if g.start_epoch <= epoch]
        return started[-1] if started else same[0]

    def _rank(self, rank: int, epoch: int) -> plans.PlanParams:
        return dataclasses.replace(self.params, rank=rank, epoch=epoch)

    def index_ranges(
        self,
        rank: int,
        epoch: int,
        start: int,
        stop: int,
        *,
        plan: plans.PlanParams | None = None,
    ) -> list[tuple[int, int]]:
        """Dataset-wide sample indices [lo, hi) read at positions [start, stop) of
        `epoch` by `rank` (of the generation whose `plan` is given; the first's by
        default), in reading order, adjacent ranges merged."""
        params = plan.with_epoch(epoch) if plan is not None else self._rank(rank, epoch)
        return placements.index_ranges(self.shard_rows, self.digest, params, start, stop)


def _passes_of(gen: Generation, epoch: int) -> list[int]:
    """The run's passes over `epoch` any rank of `gen` made, oldest first."""
    return sorted({n for rank in gen.chains for n in gen.passes(rank, epoch)})


def _with_pass_skips(
    state: states.DataState, epoch: int, skips: Sequence[states.Skip]
) -> states.DataState:
    """`state` with `skips` as its skips of `epoch` (those of other epochs kept); the
    state itself when they are its own."""
    if tuple(skips) == tuple(state.skips_in(epoch)):
        return state
    kept = [s for s in state.skips if s.epoch != epoch]
    return dataclasses.replace(state, skips=states.normalise([*kept, *skips]))


def _plan_key(p: plans.PlanParams) -> tuple[object, ...]:
    """What makes two views the same plan (a block-mode plan has no window)."""
    return (p.seed, p.world_size, p.mode, p.block_size, p.window if p.sampled else None)


def _interval(
    start: tuple[int, int], stop: tuple[int, int], samples: Callable[[int], int]
) -> list[tuple[int, int, int]]:
    """(epoch, start, stop) position ranges from one (epoch, position) to another;
    `samples(epoch)` is the rank's length of that epoch."""
    (e0, p0), (e1, p1) = start, stop
    if e0 == e1:
        return [(e0, p0, p1)] if p1 > p0 else []
    out = [(e0, p0, samples(e0))] if samples(e0) > p0 else []
    out += [(e, 0, samples(e)) for e in range(e0 + 1, e1) if samples(e)]
    if p1:
        out.append((e1, 0, p1))
    return out


def _covered(skip: states.Skip, skips: Sequence[states.Skip]) -> bool:
    return any(
        s.epoch == skip.epoch and s.start <= skip.start and skip.stop <= s.stop for s in skips
    )


def _later_epoch_note(
    lost: Sequence[states.Skip], prev: states.DataState, state: states.DataState
) -> str:
    """Why a run that read `prev`'s epoch again and then went on may be refused: the
    states do not say how far that pass read."""
    if state.epoch <= prev.epoch or not any(k.epoch == prev.epoch for k in lost):
        return ""
    return (
        f", or a pass over epoch {prev.epoch} again from its start followed by epoch "
        f"{state.epoch} with no checkpoint between (the states cannot say how far that "
        "pass read)"
    )


def _spans(
    reads: Sequence[tuple[int, int, int]],
    passes: Mapping[int, int],
    rank: int,
    after: int | None,
    before: int,
    generation: int,
    plan: plans.PlanParams,
) -> list[Span]:
    """Spans of (epoch, start, stop) ranges read between checkpoints `after` and
    `before`, each in the pass its epoch is in (`passes`; 0 when absent)."""
    return [
        Span(rank, e, x, y, after, before, generation, plan.with_epoch(e), passes.get(e, 0))
        for e, x, y in reads
    ]


def _later_pass(prev: states.DataState, state: states.DataState) -> bool:
    """Whether `state` is in a later pass over `prev`'s epoch: of the same epoch, and
    behind `prev` or without one of `prev`'s skips of it (a pass from the epoch's start
    drops them). Only a pass from the start does either; a rewind to an earlier
    checkpoint of the epoch whose abandoned checkpoints were kept looks the same, and
    is taken for one."""
    if state.epoch != prev.epoch:
        return False
    if state.position < prev.position:
        return True
    return any(not _covered(k, state.skips) for k in prev.skips_in(prev.epoch))


def _split_generations(
    nonempty: Mapping[int, Sequence[Checkpoint]], where: str
) -> list[dict[int, list[Checkpoint]]]:
    """Every rank's checkpoints cut into generations: steps in order, a new generation
    where the world size changes. A step published at two world sizes is refused."""
    by_step: dict[int, list[tuple[int, Checkpoint]]] = {}
    for rank, chain in nonempty.items():
        for c in chain:
            by_step.setdefault(c.step, []).append((rank, c))
    gens: list[dict[int, list[Checkpoint]]] = []
    world: int | None = None
    for step in sorted(by_step):
        worlds = sorted({c.state.world_size for _, c in by_step[step]})
        if len(worlds) > 1:
            raise errors.InputError(
                f"{where}: step {step} is published at world sizes {worlds}: not one run "
                "(the ranks of one step share a world size)"
            )
        if worlds[0] != world:
            gens.append({})
            world = worlds[0]
        for rank, c in by_step[step]:
            gens[-1].setdefault(rank, []).append(c)
    return gens


def build(
    digest: str,
    shard_rows: Sequence[int],
    chains: Mapping[int, Sequence[Checkpoint]],
    *,
    where: str = "the checkpoints",
) -> History:
    """Validate every rank's chain of checkpoints as one run over the dataset
    (`digest`, `shard_rows`), across world-size changes, and compute what each rank
    read between checkpoints."""
    nonempty = {r: sorted(c, key=lambda c: c.step) for r, c in chains.items() if c}
    if not nonempty:
        raise errors.InputError(f"{where}: no published checkpoint with a data state")
    first = min((c for chain in nonempty.values() for c in chain), key=lambda c: c.step)
    base = dataclasses.replace(first.state.params, rank=0, epoch=0, segments=None)
    generations: list[Generation] = []
    spans: list[Span] = []
    for index, gchains in enumerate(_split_generations(nonempty, where)):
        prev = generations[-1] if generations else None
        gen, gspans = _generation(
            index, digest, shard_rows, gchains, base, first, prev, where=where
        )
        if prev is not None:
            ended, ended_pass = _ends(prev, gen)
            generations[-1] = dataclasses.replace(prev, ended=ended, ended_pass=ended_pass)
        generations.append(gen)
        spans.extend(gspans)
    g0 = generations[0]
    return History(
        digest=digest,
        params=g0.params,
        shard_rows=tuple(shard_rows),
        spans=tuple(spans),
        generations=tuple(generations),
    )


def _ends(prev: Generation, gen: Generation) -> tuple[dict[int, tuple[int, int]], dict[int, int]]:
    """Each rank of `prev`: its (epoch, position) at the step `gen` resumed from, and
    its pass over that epoch there."""
    ended, passes = {}, {}
    for rank, chain in prev.chains.items():
        at = next(c for c in chain if c.step == gen.resumed_from)
        ended[rank] = (at.state.epoch, at.state.position)
        passes[rank] = max(prev.passes(rank, at.state.epoch))
    return ended, passes


def _pass_at_resize(prev: Generation, step: int, epoch: int, world: int, *, where: str) -> int:
    """The pass over `epoch` the ranks of `prev` were in at `step`, which the next
    generation goes on with. Every later checkpoint of `prev` is refused
    (`_resumed_from`), so each rank's restarts of `epoch` all came before `step`."""
    found = {rank: max(prev.passes(rank, epoch)) for rank in prev.chains}
    if len(set(found.values())) > 1:
        raise errors.InputError(
            f"{where}: at step {step}, which the world size {world} run resumed from, the "
            f"world size {prev.world_size} ranks were in different passes over epoch {epoch} "
            f"(rank: pass from 1, {{{', '.join(f'{r}: {n + 1}' for r, n in sorted(found.items()))}}}): "
            "expected one, as the ranks of one run read an epoch again together"
        )
    return next(iter(found.values()))


def _resumed_from(
    prev: Generation,
    gen_chains: Mapping[int, Sequence[Checkpoint]],
    total: int,
    world: int,
    *,
    where: str,
) -> tuple[int, int]:
    """(step, epoch) of `prev` that the generation's first states were resized from."""
    steps = [
        s for s in prev.steps() if all(any(c.step == s for c in ch) for ch in prev.chains.values())
    ]
    firsts = {r: ch[0] for r, ch in gen_chains.items()}
    if not steps:
        raise errors.InputError(
            f"{where}: the world size changes to {world} at step {min(c.step for c in firsts.values())}, "
            f"but no step of world size {prev.world_size} was published by every rank: an elastic "
            "resume needs every old rank's state from one step"
        )
    step = steps[-1]
    old = [next(c for c in ch if c.step == step).state for _, ch in sorted(prev.chains.items())]
    expected = elastic.resize(old, total_rows=total, world_size=world)
    for rank, c in sorted(firsts.items()):
        if c.state.params.segments != expected[rank].params.segments:
            raise errors.InputError(
                f"{where}: rank {rank} step {c.step} (world size {world}) does not resume the "
                f"world size {prev.world_size} run at its newest complete step {step}: its "
                f"segments are {c.state.params.segments}, resuming step {step} gives "
                f"{expected[rank].params.segments}; point --checkpoint-uri at one run's "
                "checkpoints"
            )
    later = sorted({c.step for ch in prev.chains.values() for c in ch if c.step > step})
    if later:
        raise errors.InputError(
            f"{where}: steps {later} of world size {prev.world_size} come after step {step}, "
            f"which the world size {world} run resumed from: those checkpoints were abandoned"
        )
    return step, old[0].epoch


def _generation(
    index: int,
    digest: str,
    shard_rows: Sequence[int],
    gchains: Mapping[int, Sequence[Checkpoint]],
    base: plans.PlanParams,
    first: Checkpoint,
    prev: Generation | None,
    *,
    where: str,
) -> tuple[Generation, list[Span]]:
    world = next(iter(gchains.values()))[0].state.world_size
    missing = [r for r in range(world) if r not in gchains]
    if missing:
        raise errors.InputError(
            f"{where}: the data states are of world size {world}, but ranks {missing} have no "
            "checkpoint: every rank publishes under <uri>/rank-<r> (what the webhook sets up "
            "for ranked pods); point --checkpoint-uri at the URI above those prefixes"
        )
    total = sum(shard_rows)
    params = dataclasses.replace(base, world_size=world)
    resumed_from: int | None = None
    start_epoch = first_pass = 0
    if prev is not None:
        resumed_from, start_epoch = _resumed_from(prev, gchains, total, world, where=where)
        first_pass = _pass_at_resize(prev, resumed_from, start_epoch, world, where=where)
    spans: list[Span] = []
    out: dict[int, tuple[Checkpoint, ...]] = {}
    all_restarts: dict[int, tuple[Restart, ...]] = {}
    for rank, chain in sorted(gchains.items()):
        seg = chain[0].state.params.segments if prev is not None else None
        plan = dataclasses.replace(params, rank=rank, segments=seg)

        def samples(epoch: int, plan: plans.PlanParams = plan) -> int:
            return plans.rank_samples(total, plan.with_epoch(epoch))

        last: Checkpoint | None = None
        clamped: list[Checkpoint] = []
        #: The pass each epoch is in (0 until the rank reads it again from its start;
        #: after a resize, the start epoch's goes on with the previous generation's).
        passes: dict[int, int] = {start_epoch: first_pass} if first_pass else {}
        restarts: list[Restart] = []
        for ckpt in chain:
            s = states.clamp(ckpt.state, samples(ckpt.state.epoch))
            label = f"{where}: rank {rank} step {ckpt.step}"
            if s.digest != digest:
                raise errors.InputError(
                    f"{label}: the data state is of dataset {s.digest}, expected {digest}: "
                    "open the dataset the run read"
                )
            if s.rank != rank:
                raise errors.InputError(f"{label}: the data state is of rank {s.rank}")
            if dataclasses.replace(s.params, rank=0, epoch=0, segments=None) != params or (
                s.plan_version != first.state.plan_version
            ):
                raise errors.InputError(
                    f"{label}: the reading plan differs from step {first.step}'s "
                    f"({s.params} vs {params}): not one run"
                )
            if s.params.segments != seg:
                raise errors.InputError(
                    f"{label}: its segments ({s.params.segments}) differ from step "
                    f"{chain[0].step}'s ({seg}): not one run"
                )
            if s.position > samples(s.epoch):
                raise errors.InputError(
                    f"{label}: position {s.position} is past the end of the epoch "
                    f"({samples(s.epoch)})"
                )
            begin = (
                (last.state.epoch, last.state.position) if last is not None else (start_epoch, 0)
            )
            again = last is not None and _later_pass(last.state, s)
            if (s.epoch, s.position) < begin and not again:
                raise errors.InputError(
                    f"{label}: the data state (epoch {s.epoch}, position {s.position}) is "
                    f"behind step {last.step if last else '?'}'s (epoch {begin[0]}, position "
                    f"{begin[1]}), in an earlier epoch: the run was rewound and the abandoned "
                    "checkpoints kept; `shardcache skip` sets them aside"
                )
            if last is not None:
                # A later pass over the epoch dropped the earlier pass's skips of it.
                lost = [
                    k
                    for k in last.state.skips
                    if not _covered(k, s.skips) and not (again and k.epoch == s.epoch)
                ]
                if lost:
                    raise errors.InputError(
                        f"{label}: the data state lacks skips that step {last.step} carries "
                        f"({[k.to_json() for k in lost]}): not one run{_later_epoch_note(lost, last.state, s)}"
                    )
            after = last.step if last is not None else resumed_from
            reads: list[tuple[int, int, int]] = []
            if last is not None and again:
                # The earlier pass read on to the end of the epoch, the later one from
                # its start.
                e = s.epoch
                reads += [
                    (e, x, y) for x, y in states.kept(last.state.skips_in(e), begin[1], samples(e))
                ]
                restarts.append(Restart(ckpt.step, e, tuple(last.state.skips_in(e))))
                spans += _spans(reads, passes, rank, after, ckpt.step, index, plan)
                passes[e] = passes.get(e, 0) + 1
                begin, reads = (e, 0), []
            for epoch, a, b in _interval(begin, (s.epoch, s.position), samples):
                reads += [(epoch, x, y) for x, y in states.kept(s.skips_in(epoch), a, b)]
            spans += _spans(reads, passes, rank, after, ckpt.step, index, plan)
            last = Checkpoint(ckpt.step, s)
            clamped.append(last)
        out[rank] = tuple(clamped)
        all_restarts[rank] = tuple(restarts)
    gen = Generation(
        index=index,
        params=params,
        chains=out,
        start_epoch=start_epoch,
        resumed_from=resumed_from,
        ended=None,
        restarts=all_restarts,
        first_pass=first_pass,
    )
    return gen, spans
