"""Where two runs' data first differ, and why.

A run's batches are a pure function of its plan (manifest, seed, world size, shuffle
mode, block size, window), its batch size and the ranges its ranks skipped; two runs are compared
batch by batch in (epoch, step, rank) order without reading any data. Samples are
compared by identity (shard path and version, row), so two manifests that list the
same shard agree on its rows. A step counts the batches a rank was handed in the
epoch, from 0: skipped batches are not handed out.

A rank that read an epoch again from its start (a second pass, `history`) was handed
the epoch once per pass, each pass with its own skips; the passes are compared in turn
(pass 1 of A with pass 1 of B, ...), and a pass one run made and the other did not is a
difference at its step 0.

A run that resized (an elastic resume: `RunPlan.generations`, one per world size) is
read as its generations were: in an epoch, pass by pass, each generation's ranks handed
their plan's rows (the segments `elastic.resize` gave them in the epoch of the resize)
from position 0, less that pass's skips (`Generation.passes`), the old generation's up
to each rank's `ended` position in the pass it ended in. Both runs are walked in that
order (epoch, pass, generation; a run that never resized is one generation), and each
generation of A is set against the one of B at the same place in the walk:
- per rank, where both read (up to the earlier of their `ended`), as above; a step
  counts the batches that generation's rank was handed in the epoch, from 0 (so the
  steps of a generation that started at a resize count from the resize);
- the generations part where one hands over to its next generation at a rank's
  position and the other does not (it reads on, or hands over at another position), or
  both hand over at the same positions to generations of another world size or other
  segments. That is the difference unless a per-rank one came earlier in (step, rank)
  order: the rank and step (its batches handed before the position it ended at) that
  come first, with the reason `an elastic resize: A went from world size 4 to 3 after
  step S, B went on at 4` (S the checkpoint step the resize resumed from; or `B resized
  to 2 after step S`, or `both resized to 3, from other positions: segments differ`),
  and as samples, for a run that resized there, its new generation's rank's first batch
  (none when the new world size lacks that rank), else what it read at that step.
A difference between runs either of which resized names each run's generation and its
world size there (`generation_a`, `world_size_a`, ...); two runs that resized alike
(the same world sizes from the same positions) are compared generation by generation.

Each generation's rank counts its steps at its own batch size (`_batch`): the one its
checkpoints record (`Generation.batch_size`, the newest state's), else the run's
(`RunPlan.batch_size`). An elastic resume that keeps the global batch reads another
batch size a rank after the resize (4 ranks of 8, then 2 of 16), and `shardcache
lineage` counts a read's step at its generation's batch size too, so both name the
same step. Where the runs' generations do not all share one batch size (either run
resized), a difference also says the batch size of each run's generation there
(`batch_size_a`, `batch_size_b`): the one its step is counted at.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from shardcache import manifests, placements, plans, states

#: A run of rows [start, stop) of one shard, named by its identity (path, content sha256).
Segment = tuple[tuple[str, str], int, int]


class Generation(Protocol):
    """The ranks of one world size of an elastic run, as `shardcache.lineage.history`'s
    `Generation` has them."""

    @property
    def index(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def start_epoch(self) -> int: ...
    @property
    def resumed_from(self) -> int | None: ...
    @property
    def ended(self) -> Mapping[int, tuple[int, int]] | None: ...
    @property
    def ended_pass(self) -> Mapping[int, int] | None: ...
    def passes(self, rank: int, epoch: int) -> Mapping[int, Sequence[states.Skip]]: ...
    def plan(self, rank: int, epoch: int) -> plans.PlanParams: ...
    def batch_size(self, rank: int, before: int | None = None) -> int | None: ...


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """One run's data, as `shardcache diff` compares it."""

    manifest: manifests.Manifest
    #: seed, world size, shuffle and block size (epoch and rank are ignored).
    params: plans.PlanParams
    #: The first generation's batch size (given, or its checkpoints'); a later
    #: generation whose checkpoints record none reads at it too (`_batch`).
    batch_size: int
    #: Per rank, the ranges it skipped (from its checkpoints' data states); an epoch in
    #: `read_again` takes each pass's from there instead.
    skips: Mapping[int, Sequence[states.Skip]] = dataclasses.field(default_factory=dict)
    #: Per rank, the epochs it read more than once: the skips of each pass over the
    #: epoch, oldest first, the last included (`History.read_again`).
    read_again: Mapping[int, Mapping[int, Sequence[Sequence[states.Skip]]]] = dataclasses.field(
        default_factory=dict
    )
    #: An elastic run's generations, oldest first (more than one: `skips` and
    #: `read_again` are then unused, each generation has its own).
    generations: tuple[Generation, ...] = ()

    def pass_skips(self, rank: int, epoch: int) -> list[list[states.Skip]]:
        """The skips of each pass `rank` made over `epoch`, oldest first (one pass for
        an epoch read once)."""
        again = self.read_again.get(rank, {}).get(epoch)
        if again:
            return [sorted(p) for p in again]
        return [sorted(s for s in self.skips.get(rank, ()) if s.epoch == epoch)]


@dataclasses.dataclass(frozen=True)
class Difference:
    epoch: int
    step: int
    rank: int
    reasons: tuple[str, ...]
    #: The samples of that step in each run, as (shard path, row).
    a: tuple[tuple[str, int], ...]
    b: tuple[tuple[str, int], ...]
    #: Which pass over the epoch (0 the first), and how many either run's ranks made.
    pass_index: int = 0
    passes: int = 1
    #: When either run resized (more than one generation): each run's generation (0 the
    #: first) and its world size there; None otherwise.
    generation_a: int | None = None
    generation_b: int | None = None
    world_size_a: int | None = None
    world_size_b: int | None = None
    #: When either run resized and the runs' generations do not all share one batch
    #: size: the batch size each run's generation there counts `step` at; None otherwise.
    batch_size_a: int | None = None
    batch_size_b: int | None = None

    def to_json(self) -> dict[str, Any]:
        extra = {
            k: getattr(self, k)
            for k in (
                "generation_a",
                "generation_b",
                "world_size_a",
                "world_size_b",
                "batch_size_a",
                "batch_size_b",
            )
            if getattr(self, k) is not None
        }
        return {
            "epoch": self.epoch,
            "pass_index": self.pass_index,
            "passes": self.passes,
            "step": self.step,
            "rank": self.rank,
            "reasons": list(self.reasons),
            "a": [list(x) for x in self.a],
            "b": [list(x) for x in self.b],
            **extra,
        }


def handed(
    m: manifests.Manifest,
    params: plans.PlanParams,
    skips: Sequence[states.Skip],
    end: int | None = None,
) -> list[Segment]:
    """The rows the rank of `params` (its segments included, after an elastic resize)
    is handed in `params.epoch`, in order: positions [0, `end`) (the whole epoch
    without one) less `skips`."""
    skips = sorted(skips)
    out: list[Segment] = []
    pos = 0
    for r in placements.rank_runs(m.shard_rows, m.digest, params):
        if end is not None and pos >= end:
            break
        # The content hash, not the store's identity: a shard whose bytes changed is
        # other samples, and one re-uploaded unchanged (a new ETag) is the same.
        key = (m.shards[r.shard].path, m.shards[r.shard].sha256)
        lo = pos
        hi = pos + len(r) if end is None else min(pos + len(r), end)
        cursor = lo
        for s in skips:
            if s.stop <= cursor or s.start >= hi:
                continue
            if s.start > cursor:
                out.append((key, r.start + cursor - lo, r.start + s.start - lo))
            cursor = max(cursor, s.stop)
        if cursor < hi:
            out.append((key, r.start + cursor - lo, r.start + hi - lo))
        pos = pos + len(r)
    return out


def first_mismatch(a: Sequence[Segment], b: Sequence[Segment]) -> int | None:
    """The offset of the first sample where two handed-out streams differ (one
    ending before the other counts), or None when they are equal."""
    i = j = oa = ob = pos = 0
    while i < len(a) and j < len(b):
        (ka, sa, ea), (kb, sb, eb) = a[i], b[j]
        ra, rb = sa + oa, sb + ob
        if ka != kb or ra != rb:
            return pos
        n = min(ea - ra, eb - rb)
        pos, oa, ob = pos + n, oa + n, ob + n
        if sa + oa == ea:
            i, oa = i + 1, 0
        if sb + ob == eb:
            j, ob = j + 1, 0
    return pos if i < len(a) or j < len(b) else None


def take(segs: Sequence[Segment], start: int, count: int) -> tuple[tuple[str, int], ...]:
    out: list[tuple[str, int]] = []
    pos = 0
    for (path, _), lo, hi in segs:
        n = hi - lo
        if pos + n > start and len(out) < count:
            first = lo + max(0, start - pos)
            for row in range(first, min(hi, first + count - len(out))):
                out.append((path, row))
        pos += n
        if len(out) >= count:
            break
    return tuple(out)


def first_difference(a: RunPlan, b: RunPlan, epochs: Sequence[int]) -> Difference | None:
    """The first (epoch, step, rank) whose batch differs, or None: both runs'
    generations walked in reading order (`_slots`; a run that never resized is one
    generation), compared per rank where both read, and the first point where their
    generations part is a difference of its own (`_resize`). Only a comparison where
    either run resized names each run's generation (`_named`), and its batch size only
    where the generations of both runs do not all share one."""
    ga, gb = _generations(a), _generations(b)
    named = len(ga) > 1 or len(gb) > 1
    sized = named and len(_sizes(a, ga) | _sizes(b, gb)) > 1
    for epoch in epochs:
        sa, sb = _slots(ga, epoch), _slots(gb, epoch)
        count = max((s.pass_index + 1 for s in (*sa, *sb)), default=1)
        last_a, last_b = (sa[-1] if sa else None), (sb[-1] if sb else None)
        for k in range(max(len(sa), len(sb))):
            x = sa[k] if k < len(sa) else None
            y = sb[k] if k < len(sb) else None
            found = _compare(a, b, epoch, (x, y), (last_a, last_b), named=named, sized=sized)
            if found is not None:
                return dataclasses.replace(found, passes=count)
    return None


def shard_changes(a: manifests.Manifest, b: manifests.Manifest) -> dict[str, list[str]]:
    """Shards only in A, only in B, and in both with other content (version, size, rows)."""
    sa = {s.path: s for s in a.shards}
    sb = {s.path: s for s in b.shards}
    return {
        "only_in_a": sorted(set(sa) - set(sb)),
        "only_in_b": sorted(set(sb) - set(sa)),
        "changed": sorted(p for p in set(sa) & set(sb) if sa[p] != sb[p]),
    }


def _plan_reasons(
    a: RunPlan, b: RunPlan, worlds: tuple[int, int], batches: tuple[int, int]
) -> list[str]:
    """What differs in the runs' plans, with the world sizes and batch sizes of the
    generations compared (`worlds`, `batches`: A's, B's)."""
    out: list[str] = []
    if a.manifest.digest != b.manifest.digest:
        changes = shard_changes(a.manifest, b.manifest)
        detail = "; ".join(
            f"{label} {_few(paths)}"
            for label, paths in (
                ("shards only in A:", changes["only_in_a"]),
                ("shards only in B:", changes["only_in_b"]),
                ("shards changed:", changes["changed"]),
            )
            if paths
        )
        out.append(
            f"another dataset: digest {a.manifest.digest} vs {b.manifest.digest}"
            + (f" ({detail})" if detail else " (same shards, another format or order)")
        )
    pa_, pb = a.params, b.params
    for name, x, y in (
        ("seed", pa_.seed, pb.seed),
        ("world size", *worlds),
        ("batch size", *batches),
        ("shuffle", pa_.mode, pb.mode),
        ("block size", pa_.block_size, pb.block_size),
        ("window", _window(pa_), _window(pb)),
    ):
        if x != y:
            out.append(f"another {name}: {x} vs {y}")
    return out


def _pass_reasons(
    in_a: Mapping[int, Sequence[states.Skip]],
    in_b: Mapping[int, Sequence[states.Skip]],
    rank: int,
    epoch: int,
    pass_index: int,
) -> list[str]:
    """A pass `pass_index` over `epoch` only one run's `rank` made, or its skips there
    when they differ (`in_a`, `in_b`: each pass's skips by pass index)."""
    made = [pass_index in p for p in (in_a, in_b)]
    count_a, count_b = (max(p, default=-1) + 1 for p in (in_a, in_b))
    if made[0] != made[1]:
        return [
            f"a pass: rank {rank} read epoch {epoch} {_times(count_a)} in A, "
            f"{_times(count_b)} in B (again from its start); pass {pass_index + 1} is "
            f"only in {'A' if made[0] else 'B'}"
        ]
    if made[0] and sorted(in_a[pass_index]) != sorted(in_b[pass_index]):
        where = f" pass {pass_index + 1}" if max(count_a, count_b) > 1 else ""
        return [
            f"a skip: rank {rank} in epoch {epoch}{where} skipped positions "
            f"{_ranges(sorted(in_a[pass_index]))} in A, {_ranges(sorted(in_b[pass_index]))} in B"
        ]
    return []


def _times(n: int) -> str:
    return "once" if n == 1 else "twice" if n == 2 else f"{n} times"


def _window(params: plans.PlanParams) -> int | None:
    # Only sample mode has windows: a block-mode run's window setting changes nothing.
    return params.window if params.sampled else None


def _few(items: Sequence[str], limit: int = 5) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _ranges(skips: Sequence[states.Skip]) -> str:
    return " ".join(f"[{s.start}, {s.stop})" for s in skips) or "none"


# --- runs with several generations (an elastic resize) ---


@dataclasses.dataclass(frozen=True)
class _Whole:
    """A run that never resized, as its one generation."""

    run: RunPlan
    index: int = 0
    start_epoch: int = 0
    resumed_from: int | None = None
    ended: Mapping[int, tuple[int, int]] | None = None
    ended_pass: Mapping[int, int] | None = None

    @property
    def world_size(self) -> int:
        return self.run.params.world_size

    def passes(self, rank: int, epoch: int) -> Mapping[int, Sequence[states.Skip]]:
        return dict(enumerate(self.run.pass_skips(rank, epoch)))

    def plan(self, rank: int, epoch: int) -> plans.PlanParams:
        return dataclasses.replace(self.run.params, rank=rank, epoch=epoch)

    def batch_size(self, rank: int, before: int | None = None) -> int | None:
        return self.run.batch_size


@dataclasses.dataclass(frozen=True)
class _Slot:
    """One generation's reading of one pass over an epoch."""

    pass_index: int
    gen: Generation
    #: Per rank, the position where the next generation took over; None: the epoch's end.
    ends: Mapping[int, int | None]
    #: The generation that took over in this pass, or None.
    next: Generation | None


def _generations(run: RunPlan) -> tuple[Generation, ...]:
    return run.generations if len(run.generations) > 1 else (_Whole(run),)


def _batch(run: RunPlan, gen: Generation | None, rank: int) -> int:
    """The batch size `rank` of `gen` counts its steps at: what its newest checkpoint
    recording one says (as `shardcache lineage` counts a read's step), else the run's."""
    recorded = gen.batch_size(rank) if gen is not None else None
    return recorded if recorded is not None else run.batch_size


def _sizes(run: RunPlan, gens: Sequence[Generation]) -> set[int]:
    """Every batch size a rank of any of the run's generations read at."""
    return {_batch(run, g, r) for g in gens for r in range(g.world_size)}


def _gen(slot: _Slot | None) -> Generation | None:
    return slot.gen if slot is not None else None


def _last_epoch(gen: Generation) -> int | None:
    return None if gen.ended is None else max(e for e, _ in gen.ended.values())


def _slots(gens: Sequence[Generation], epoch: int) -> list[_Slot]:
    """Each generation's passes over `epoch`, in reading order: by pass, then by
    generation (a resize hands the rest of a pass to the next generation)."""
    out: list[_Slot] = []
    for i, gen in enumerate(gens):
        last = _last_epoch(gen)
        if epoch < gen.start_epoch or (last is not None and epoch > last):
            continue
        made = sorted({n for r in range(gen.world_size) for n in gen.passes(r, epoch)})
        for n in made:
            ends: dict[int, int | None] = {}
            for r in range(gen.world_size):
                stop = (gen.ended or {}).get(r)
                took_over = stop is not None and stop[0] == epoch
                in_pass = (gen.ended_pass or {}).get(r, 0) == n
                ends[r] = stop[1] if stop is not None and took_over and in_pass else None
            ended = any(e is not None for e in ends.values()) and i + 1 < len(gens)
            out.append(_Slot(n, gen, ends, gens[i + 1] if ended else None))
    return sorted(out, key=lambda s: (s.pass_index, s.gen.index))


def _rows(
    run: RunPlan, slot: _Slot | None, rank: int, epoch: int, end: int | None
) -> list[Segment]:
    if slot is None or rank >= slot.gen.world_size:
        return []
    skips = slot.gen.passes(rank, epoch).get(slot.pass_index)
    if skips is None:
        return []
    return handed(run.manifest, slot.gen.plan(rank, epoch), skips, end)


def _end(slot: _Slot | None, rank: int) -> int | None:
    return None if slot is None else slot.ends.get(rank)


def _earlier(x: int | None, y: int | None) -> int | None:
    return y if x is None else x if y is None else min(x, y)


def _shape(gen: Generation, epoch: int) -> tuple[object, ...]:
    """What makes two generations hand out the same rows in `epoch`: the world size and
    each rank's segments there."""
    segs = []
    for r in range(gen.world_size):
        seg = gen.plan(r, epoch).segments
        segs.append(seg if seg is not None and seg.epoch == epoch else None)
    return (gen.world_size, tuple(segs))


def _compare(
    a: RunPlan,
    b: RunPlan,
    epoch: int,
    slots: tuple[_Slot | None, _Slot | None],
    lasts: tuple[_Slot | None, _Slot | None],
    *,
    named: bool,
    sized: bool,
) -> Difference | None:
    """The first difference in one slot of each run (`slots`), or None. A run without
    this slot (it made fewer passes over the epoch) is described by its last slot of the
    epoch (`lasts`): its world size, batch size and the passes its ranks made. Steps
    count at each generation's batch size (`_batch`); where the two differ, every batch
    differs, from step 0 of the slot."""
    (x, y), (last_a, last_b) = slots, lasts
    ka, kb = x or last_a, y or last_b
    n = x.pass_index if x is not None else y.pass_index if y is not None else 0
    world = max(s.gen.world_size if s is not None else 0 for s in (x, y))
    best: tuple[int, int, list[Segment], list[Segment], int, int] | None = None
    for rank in range(world):
        end = _earlier(_end(x, rank), _end(y, rank))
        ra, rb = _rows(a, x, rank, epoch, end), _rows(b, y, rank, epoch, end)
        size_a, size_b = _batch(a, _gen(ka), rank), _batch(b, _gen(kb), rank)
        at = first_mismatch(ra, rb)
        if size_a != size_b:
            if not ra and not rb:
                continue
            step = 0
        elif at is None:
            continue
        else:
            step = at // size_a
        if best is None or step < best[0]:
            best = (step, rank, ra, rb, size_a, size_b)
    resize = _resize(a, b, epoch, x, y) if x is not None and y is not None else None
    if best is not None and (resize is None or (best[0], best[1]) < (resize.step, resize.rank)):
        step, rank, ra, rb, size_a, size_b = best
        wa, wb = (k.gen.world_size if k is not None else 0 for k in (ka, kb))
        why = _plan_reasons(a, b, (wa, wb), (size_a, size_b))
        why += _pass_reasons(
            _made(ka, rank, epoch, named=named), _made(kb, rank, epoch, named=named), rank, epoch, n
        )
        found = Difference(
            epoch=epoch,
            step=step,
            rank=rank,
            reasons=tuple(why or ["the batches differ"]),
            a=take(ra, step * size_a, size_a),
            b=take(rb, step * size_b, size_b),
        )
        return _named(found, a, b, n, (x, y), named=named, sized=sized)
    if resize is not None:
        return _named(resize, a, b, n, (x, y), named=named, sized=sized)
    return None


def _made(
    slot: _Slot | None, rank: int, epoch: int, *, named: bool
) -> Mapping[int, Sequence[states.Skip]]:
    """The passes `rank` of the slot's generation made over `epoch`, with their skips.
    Where either run resized, a rank its world size lacks made none (a pass reason
    says so); a comparison of two runs that never resized takes every rank as making
    the one pass its plan gives, so only "another world size" names such a rank
    (`shardcache diff`'s output from before it walked generations)."""
    if slot is None or (named and rank >= slot.gen.world_size):
        return {}
    return slot.gen.passes(rank, epoch)


def _named(
    found: Difference,
    a: RunPlan,
    b: RunPlan,
    n: int,
    slots: tuple[_Slot | None, _Slot | None],
    *,
    named: bool,
    sized: bool,
) -> Difference:
    """`found` with its pass and, when `named` (either run resized), each run's
    generation there; when `sized` too (the generations do not all share one batch
    size), the batch size its `found.rank` counts steps at there."""
    if not named:
        return dataclasses.replace(found, pass_index=n)
    x, y = slots
    return dataclasses.replace(
        found,
        pass_index=n,
        generation_a=x.gen.index if x is not None else None,
        generation_b=y.gen.index if y is not None else None,
        world_size_a=x.gen.world_size if x is not None else None,
        world_size_b=y.gen.world_size if y is not None else None,
        batch_size_a=_batch(a, x.gen, found.rank) if sized and x is not None else None,
        batch_size_b=_batch(b, y.gen, found.rank) if sized and y is not None else None,
    )


def _resize(a: RunPlan, b: RunPlan, epoch: int, x: _Slot, y: _Slot) -> Difference | None:
    """Where the runs' generations part in this slot: one run's generation hands over to
    the next at a rank's position where the other's does not (reads on, or hands over
    elsewhere), or both hand over at the same positions to generations that differ.
    At the earliest (step, rank) of those, the step counted in the generation that
    stopped there, at its batch size (`_batch`)."""
    ranks = sorted(set(x.ends) | set(y.ends))
    parted = [r for r in ranks if _end(x, r) != _end(y, r)]
    if not parted:
        if x.next is None or y.next is None:
            return None
        if _shape(x.next, epoch) == _shape(y.next, epoch):
            return None
        parted = [r for r in ranks if _end(x, r) is not None]
    points: list[tuple[int, int, int]] = []
    for r in parted:
        end = _earlier(_end(x, r), _end(y, r))
        if end is None:
            continue
        run, slot = (a, x) if _end(x, r) == end else (b, y)
        handed_before = sum(hi - lo for _, lo, hi in _rows(run, slot, r, epoch, end))
        points.append((handed_before // _batch(run, slot.gen, r), r, end))
    if not points:
        return None
    step, rank, end = min(points)

    def there(run: RunPlan, slot: _Slot) -> tuple[tuple[str, int], ...]:
        # A run that handed over here: its new generation's first batch of this rank (if
        # it has that rank), at that generation's batch size; else what it went on
        # reading at this step.
        if slot.next is not None and _end(slot, rank) == end:
            new = _Slot(slot.pass_index, slot.next, {}, None)
            return take(_rows(run, new, rank, epoch, None), 0, _batch(run, slot.next, rank))
        rows = _rows(run, slot, rank, epoch, _end(slot, rank))
        size = _batch(run, slot.gen, rank)
        return take(rows, step * size, size)

    return Difference(
        epoch=epoch,
        step=step,
        rank=rank,
        reasons=(_resize_reason(x, y, rank, end),),
        a=there(a, x),
        b=there(b, y),
    )


def _resize_reason(x: _Slot, y: _Slot, rank: int, end: int) -> str:
    def went(label: str, slot: _Slot) -> str:
        assert slot.next is not None
        return (
            f"{label} went from world size {slot.gen.world_size} to {slot.next.world_size} "
            f"after step {slot.next.resumed_from}"
        )

    if x.next is not None and y.next is not None:
        if x.next.world_size == y.next.world_size:
            return (
                f"an elastic resize: both resized to {x.next.world_size}, from other "
                f"positions: segments differ ({went('A', x)}, {went('B', y)})"
            )
        return (
            f"an elastic resize: {went('A', x)}, B resized to {y.next.world_size} after "
            f"step {y.next.resumed_from}"
        )
    if x.next is not None:
        return f"an elastic resize: {went('A', x)}, B went on at {y.gen.world_size}"
    return f"an elastic resize: {went('B', y)}, A went on at {x.gen.world_size}"
