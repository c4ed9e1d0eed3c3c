"""Questions asked of a run's `History`: where samples were read, and what a
checkpoint consumed.

`reads` answers, for dataset-wide sample indices, which (epoch, step, rank) read each
one and which checkpoints come after that read (their weights include its gradient);
a sample a rank skipped is reported as skipped, one planned after a rank's newest
checkpoint as pending. An epoch a rank read again from its start (a second pass,
`history`) gives one answer per pass, each with that pass's skips. `consumed` is the reverse: what each rank read since the
previous checkpoint, as sample-index ranges.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterable
from typing import Any, Literal

from shardcache import errors, placements, plans, states
from shardcache.lineage import history

Status = Literal["read", "skipped", "pending"]


@dataclasses.dataclass(frozen=True)
class Read:
    """Sample `index` in `epoch`: rank `rank` reaches it at `position` of its stream."""

    index: int
    epoch: int
    rank: int
    position: int
    #: read: between checkpoints `after` and `before`; skipped: never read (`skip`);
    #: pending: after the rank's newest checkpoint, so no checkpoint says yet.
    status: Status
    #: The batch of the epoch that holds it, as `Dataset.batches` yields them
    #: (skipped batches are not yielded, so they do not count), and its row in it.
    #: None when the batch size is unknown, or for a skipped sample.
    step: int | None
    slot: int | None
    after: int | None = None
    before: int | None = None
    #: Every published checkpoint whose weights include this read.
    checkpoints: tuple[int, ...] = ()
    skip: states.Skip | None = None
    #: Which world size read it: generations are cut where the world size changes
    #: (an elastic resume); rank numbers are per generation.
    generation: int = 0
    world_size: int = 1
    #: Which pass over the epoch: 0 the first, 1 a second from the epoch's start, ...
    pass_index: int = 0

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["checkpoints"] = list(self.checkpoints)
        data["skip"] = self.skip.to_json() if self.skip is not None else None
        return data


SpanIndex = dict[tuple[int, int, int, int], tuple[list[int], list[history.Span]]]


def _spans_by_key(hist: history.History) -> SpanIndex:
    """Spans by (generation, rank, epoch, pass), sorted by start."""
    grouped: dict[tuple[int, int, int, int], list[history.Span]] = {}
    for span in hist.spans:
        key = (span.generation, span.rank, span.epoch, span.pass_index)
        grouped.setdefault(key, []).append(span)
    out = {}
    for key, spans in grouped.items():
        spans.sort(key=lambda s: s.start)
        out[key] = ([s.start for s in spans], spans)
    return out


@dataclasses.dataclass(frozen=True)
class _Piece:
    """Global-sequence positions [lo, hi) of an epoch, read by `rank` of `generation`
    from position `position` of its stream on."""

    lo: int
    hi: int
    generation: history.Generation
    rank: int
    position: int
    #: The skips that rank made in the pass the piece is of.
    skips: tuple[states.Skip, ...] = ()


def _passes(hist: history.History, epoch: int) -> int:
    """How many passes over `epoch` any rank of any generation made (1 at least)."""
    return 1 + max(max(gen.passes(rank, epoch)) for gen in hist.generations for rank in gen.chains)


def _coverage(hist: history.History, epoch: int, pass_index: int) -> list[_Piece]:
    """Who reads each position of `epoch`'s global sequence in pass `pass_index` over
    it: one generation's ranks, or, in the pass of a resize, the old ranks up to where
    they stopped and the new ranks' segments after (the old ranks read the earlier
    passes to the epoch's end). A position nobody reads in that pass has no piece."""
    total = sum(hist.shard_rows)
    out: list[_Piece] = []
    for gen in hist.generations:
        if epoch < gen.start_epoch:
            continue
        for rank in gen.chains:
            skips = gen.passes(rank, epoch).get(pass_index)
            if skips is None:
                continue
            limit: int | None = None
            if gen.ended is not None and gen.ended_pass is not None:
                end_epoch, end_pos = gen.ended[rank]
                if epoch > end_epoch:
                    continue
                if epoch == end_epoch and pass_index == gen.ended_pass[rank]:
                    limit = end_pos
            ranges = plans.stream_ranges(total, gen.plan(rank, epoch))
            pos = 0
            for lo, hi in ranges:
                if limit is not None:
                    hi = min(hi, lo + max(0, limit - pos))
                if hi > lo:
                    out.append(_Piece(lo, hi, gen, rank, pos, skips))
                pos += hi - lo
    out.sort(key=lambda p: p.lo)
    return out


def _global_positions(
    hist: history.History, epoch: int, wanted: list[int]
) -> list[tuple[int, int]]:
    """(index, position in `epoch`'s global sequence) of each wanted sample."""
    params = hist.params.with_epoch(epoch)
    return placements.global_positions(hist.shard_rows, hist.digest, params, wanted)


def reads(
    hist: history.History, indices: Iterable[int], *, batch_size: int | None = None
) -> list[Read]:
    """Where each sample index is reached in every epoch up to the newest checkpoint's,
    sorted by index then epoch. `batch_size` counts the steps of a generation whose
    states record none; a recorded one is what the rank read at, and wins (a run
    resized from 8 to 16 a rank counts each generation's steps at its own)."""
    wanted = sorted(set(indices))
    if not wanted:
        return []
    total = sum(hist.shard_rows)
    bad = [i for i in wanted if not 0 <= i < total]
    if bad:
        raise errors.InputError(
            f"sample index {bad[0]} is out of range: the dataset has {total} samples"
        )
    last_epoch = max(
        c[-1].state.epoch for gen in hist.generations for c in gen.chains.values() if c
    )
    by_key = _spans_by_key(hist)
    steps = hist.steps()
    out: list[Read] = []
    for epoch in range(last_epoch + 1):
        positions = _global_positions(hist, epoch, wanted)
        for n in range(_passes(hist, epoch)):
            pieces = _coverage(hist, epoch, n)
            starts = [p.lo for p in pieces]
            for index, gpos in positions:
                at = bisect.bisect_right(starts, gpos) - 1
                if at < 0 or gpos >= pieces[at].hi:
                    continue
                piece = pieces[at]
                where = _Where(epoch, piece.position + gpos - piece.lo, n, piece.skips)
                out.append(_read(by_key, steps, piece, index, where, batch_size))
    out.sort(key=lambda r: (r.index, r.epoch, r.generation, r.pass_index))
    return out


@dataclasses.dataclass(frozen=True)
class _Where:
    """Position `position` of `epoch` in pass `pass_index` over it, which made `skips`."""

    epoch: int
    position: int
    pass_index: int
    skips: tuple[states.Skip, ...]


def _read(
    by_key: SpanIndex,
    steps: list[int],
    piece: _Piece,
    index: int,
    where: _Where,
    batch_size: int | None,
) -> Read:
    gen, rank = piece.generation, piece.rank
    epoch, pos, skips = where.epoch, where.position, where.skips
    starts, spans = by_key.get((gen.index, rank, epoch, where.pass_index), ([], []))
    i = bisect.bisect_right(starts, pos) - 1
    span = spans[i] if i >= 0 and spans[i].start <= pos < spans[i].stop else None
    size = gen.batch_size(rank, span.before if span is not None else None)
    if size is None:
        size = batch_size
    step = slot = None
    if size is not None:
        n = pos - states.skipped_before(skips, pos)
        step, slot = n // size, n % size
    base = Read(
        index, epoch, rank, pos, "pending", step, slot,
        generation=gen.index, world_size=gen.world_size, pass_index=where.pass_index,
    )  # fmt: skip
    if span is not None:
        after = tuple(s for s in steps if s >= span.before)
        return dataclasses.replace(
            base, status="read", after=span.after, before=span.before, checkpoints=after
        )
    skip = next((s for s in skips if s.start <= pos < s.stop), None)
    if skip is not None:
        return dataclasses.replace(base, status="skipped", step=None, slot=None, skip=skip)
    return base


def consumed(hist: history.History, step: int) -> dict[str, Any]:
    """What checkpoint `step` consumed since the previous one, per rank: sample-index
    ranges [lo, hi) in reading order, per epoch, and the skips it passed over."""
    if step not in hist.steps():
        raise errors.InputError(
            f"no checkpoint with step {step}: published steps are {hist.steps() or 'none'}"
        )
    gen = hist.generation_of(step)
    ranks: list[dict[str, Any]] = []
    for rank, chain in gen.chains.items():
        at = next((i for i, c in enumerate(chain) if c.step == step), None)
        if at is None:
            ranks.append({"rank": rank, "published": False, "epochs": [], "samples": 0})
            continue
        prev = chain[at - 1] if at > 0 else None
        epochs: dict[int, list[list[int]]] = {}
        total = 0
        for span in hist.spans:
            if span.generation == gen.index and span.rank == rank and span.before == step:
                ranges = hist.index_ranges(rank, span.epoch, span.start, span.stop, plan=span.plan)
                for lo, hi in ranges:
                    epochs.setdefault(span.epoch, []).append([lo, hi])
                    total += hi - lo
        begin = (
            (prev.state.epoch, prev.state.position) if prev is not None else (gen.start_epoch, 0)
        )
        end = (chain[at].state.epoch, chain[at].state.position)
        restart = next((r for r in gen.restarts.get(rank, ()) if r.step == step), None)
        # After a restart the earlier pass's skips after `begin` are in no state (the
        # later pass dropped them); the later pass's lie between the epoch's start and `end`.
        begin_skips = (restart.epoch, 0) if restart is not None else begin
        skipped = [
            s.to_json()
            for s in chain[at].state.skips
            if begin_skips <= (s.epoch, s.start) < end or begin_skips < (s.epoch, s.stop) <= end
        ]
        ranks.append(
            {
                "rank": rank,
                "published": True,
                "previous": prev.step if prev is not None else gen.resumed_from,
                "world_size": gen.world_size,
                "from": {"epoch": begin[0], "position": begin[1]},
                "to": {"epoch": end[0], "position": end[1]},
                # The epoch read on to its end and then again from its start (a later
                # pass, `history`) between the two checkpoints; None when none was.
                "read_again": restart.epoch if restart is not None else None,
                "epochs": [{"epoch": e, "ranges": r} for e, r in sorted(epochs.items())],
                "samples": total,
                "skips": skipped,
            }
        )
    return {
        "step": step,
        "complete": hist.complete(step),
        "ranks": ranks,
        "samples": sum(r["samples"] for r in ranks),
    }


def reads_json(
    hist: history.History,
    expression: str,
    indices: list[int],
    truncated: bool,
    found: list[Read],
) -> dict[str, Any]:
    """What `--json` prints and the web inspector's lineage view serves. `run`'s plan
    and batch size are its first generation's; each of `run.generations` has its own
    world size and batch size (a read names its `generation`: a link to it takes
    that one's). The rest of the plan is one for the whole run (`history.build`
    refuses a change)."""
    p = hist.params
    return {
        "expression": expression,
        "matches": len(indices),
        "truncated": truncated,
        "run": {
            "digest": hist.digest,
            "world_size": p.world_size,
            "seed": p.seed,
            "shuffle": p.shuffle,
            "granularity": p.granularity,
            "window": p.window,
            "block_size": p.block_size,
            "batch_size": _generation_batch_size(hist.generations[0]),
            "checkpoints": [{"step": s, "complete": hist.complete(s)} for s in hist.steps()],
            "generations": [
                {
                    "world_size": g.world_size,
                    "batch_size": _generation_batch_size(g),
                    "start_epoch": g.start_epoch,
                    "resumed_from": g.resumed_from,
                    "steps": g.steps(),
                }
                for g in hist.generations
            ],
            # Per rank number, every generation's skips of every pass: an epoch read
            # again has each pass's own (`pass_index`, 0 the first), and the ranks of
            # one number in two world sizes are two readers (`generation`).
            "skips": _skips_json(hist),
        },
        "reads": [r.to_json() for r in found],
    }


def _generation_batch_size(gen: history.Generation) -> int | None:
    """The batch size a generation's ranks' newest states record (rank 0's, as the
    step view checks a view's against those states), None when none records one."""
    return gen.batch_size(0)


def _skips_json(hist: history.History) -> dict[str, list[dict[str, Any]]]:
    """`run.skips` of `reads_json`: by rank number, each skip with its generation and
    pass; every rank number of any generation has an entry, if empty (a resize to more
    ranks adds numbers the first generation did not have)."""
    ranks = sorted({r for g in hist.generations for r in g.chains})
    out: dict[str, list[dict[str, Any]]] = {str(r): [] for r in ranks}
    for gen, rank, n, skip in hist.every_skip():
        out.setdefault(str(rank), []).append({**skip.to_json(), "pass_index": n, "generation": gen})
    return out
