"""Questions asked of a run's `History`: where samples were read, and what a
checkpoint consumed.

`reads` answers, for dataset-wide sample indices, which (epoch, step, rank) read each
one and which checkpoints come after that read (their weights include its gradient);
a sample a rank skipped is reported as skipped, one planned after a rank's newest
checkpoint as pending. `consumed` is the reverse: what each rank read since the
previous checkpoint, as sample-index ranges.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterable
from typing import Any, Literal

from shardcache import errors, states
from shardcache.inspect import locate
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

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["checkpoints"] = list(self.checkpoints)
        data["skip"] = self.skip.to_json() if self.skip is not None else None
        return data


def _spans_by_rank_epoch(
    hist: history.History,
) -> dict[tuple[int, int], tuple[list[int], list[history.Span]]]:
    grouped: dict[tuple[int, int], list[history.Span]] = {}
    for span in hist.spans:
        grouped.setdefault((span.rank, span.epoch), []).append(span)
    out = {}
    for key, spans in grouped.items():
        spans.sort(key=lambda s: s.start)
        out[key] = ([s.start for s in spans], spans)
    return out


def reads(
    hist: history.History, indices: Iterable[int], *, batch_size: int | None = None
) -> list[Read]:
    """Where each sample index is reached in every epoch up to the newest checkpoint's,
    sorted by index then epoch. `batch_size` overrides the one the states record."""
    wanted = sorted(set(indices))
    if not wanted:
        return []
    last_epoch = max(c[-1].state.epoch for c in hist.chains.values() if c)
    by_key = _spans_by_rank_epoch(hist)
    steps = hist.steps()
    p = hist.params
    out: list[Read] = []
    for epoch in range(last_epoch + 1):
        query = locate.Query(
            epoch=epoch,
            world_size=p.world_size,
            batch_size=1,
            seed=p.seed,
            shuffle=p.shuffle,
            block_size=p.block_size,
        )
        for seen in locate.sightings(list(hist.shard_rows), hist.digest, query, wanted):
            out.append(_read(hist, by_key, steps, seen, batch_size))
    out.sort(key=lambda r: (r.index, r.epoch))
    return out


def _read(
    hist: history.History,
    by_key: dict[tuple[int, int], tuple[list[int], list[history.Span]]],
    steps: list[int],
    seen: locate.Sighting,
    batch_size: int | None,
) -> Read:
    rank, epoch, pos = seen.rank, seen.epoch, seen.step  # batch size 1: step is position
    skips = [s for s in hist.skips(rank) if s.epoch == epoch]
    starts, spans = by_key.get((rank, epoch), ([], []))
    i = bisect.bisect_right(starts, pos) - 1
    span = spans[i] if i >= 0 and spans[i].start <= pos < spans[i].stop else None
    size = batch_size or hist.batch_size(rank, span.before if span is not None else None)
    step = slot = None
    if size is not None:
        n = pos - states.skipped_before(skips, pos)
        step, slot = n // size, n % size
    base = Read(seen.index, epoch, rank, pos, "pending", step, slot)
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
    ranks: list[dict[str, Any]] = []
    previous: set[int | None] = set()
    for rank, chain in hist.chains.items():
        at = next((i for i, c in enumerate(chain) if c.step == step), None)
        if at is None:
            ranks.append({"rank": rank, "published": False, "epochs": [], "samples": 0})
            continue
        prev = chain[at - 1] if at > 0 else None
        previous.add(prev.step if prev is not None else None)
        epochs: dict[int, list[list[int]]] = {}
        total = 0
        for span in hist.spans:
            if span.rank == rank and span.before == step:
                for lo, hi in hist.index_ranges(rank, span.epoch, span.start, span.stop):
                    epochs.setdefault(span.epoch, []).append([lo, hi])
                    total += hi - lo
        begin = (prev.state.epoch, prev.state.position) if prev is not None else (0, 0)
        end = (chain[at].state.epoch, chain[at].state.position)
        skipped = [
            s.to_json()
            for s in chain[at].state.skips
            if begin <= (s.epoch, s.start) < end or begin < (s.epoch, s.stop) <= end
        ]
        ranks.append(
            {
                "rank": rank,
                "published": True,
                "previous": prev.step if prev is not None else None,
                "from": {"epoch": begin[0], "position": begin[1]},
                "to": {"epoch": end[0], "position": end[1]},
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
    """What `--json` prints and the web inspector's lineage view serves."""
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
            "block_size": p.block_size,
            "batch_size": hist.batch_size(0),
            "checkpoints": [{"step": s, "complete": hist.complete(s)} for s in hist.steps()],
            "skips": {str(r): [s.to_json() for s in hist.skips(r)] for r in hist.chains},
        },
        "reads": [r.to_json() for r in found],
    }
