"""Where each sample sits in a plan, for every shuffle mode: the tools' view.

`shardcache inspect`, `shardcache lineage`/`diff` and the web inspector answer "which
rows did rank r read at positions [p, q) of epoch e" and the reverse, "where in the
epoch's global sequence is sample i", without reading any data. In block mode (plan
version 1's rules) both are walks over `plans.rank_runs` / `plans.global_runs`; in
sample mode (plan version 2) rows are permuted within windows, so the rows a rank
reads are `sequences.Sequence.stream_indices` and a sample's place is found through
the inverse of its window's permutation. Both modes follow a rank's elastic-resume
segments (`plans.stream_ranges`).

numpy is imported only for sample-mode plans, as in the dataset: block-mode tools
stay on pyarrow alone.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from shardcache import plans, streams

if TYPE_CHECKING:
    from shardcache import sequences


@functools.lru_cache(maxsize=8)
def _sequence(
    shard_rows: tuple[int, ...], digest: str, params: plans.PlanParams
) -> sequences.Sequence:
    # Tools ask about one plan many times (every step of a rank, every rank of an
    # epoch); a Sequence keeps its permuted windows. Keyed without rank: it is every
    # rank's sequence.
    from shardcache import sequences  # numpy: sample mode only

    return sequences.Sequence(shard_rows, digest, params)


def _epoch_sequence(
    shard_rows: Sequence[int], digest: str, params: plans.PlanParams
) -> sequences.Sequence:
    every_rank = plans.PlanParams(
        seed=params.seed,
        epoch=params.epoch,
        shuffle=params.shuffle,
        block_size=params.block_size,
        granularity=params.granularity,
        window=params.window,
    )
    return _sequence(tuple(shard_rows), digest, every_rank)


def rank_runs(shard_rows: Sequence[int], digest: str, params: plans.PlanParams) -> list[plans.Run]:
    """The rows `params.rank` reads in `params.epoch`, in order, as runs of
    consecutive rows of one shard: `plans.rank_runs` in block mode; in sample mode
    mostly single rows, as the permutation leaves them."""
    if not params.sampled:
        return plans.rank_runs(shard_rows, digest, params)
    import numpy as np  # sample mode only

    seq = _epoch_sequence(shard_rows, digest, params)
    ranges = plans.stream_ranges(seq.total, params)
    total = sum(b - a for a, b in ranges)
    if total == 0:
        return []
    idx = seq.stream_indices(ranges, 0, total)
    shard = np.searchsorted(seq.offsets, idx, side="right") - 1
    row = idx - seq.offsets[shard]
    # A run breaks where the next row is not the next row of the same shard.
    breaks = np.flatnonzero((np.diff(idx) != 1) | (np.diff(shard) != 0)) + 1
    starts = np.concatenate(([0], breaks))
    stops = np.concatenate((breaks, [len(idx)]))
    return [
        plans.Run(int(shard[a]), int(row[a]), int(row[a]) + int(b - a))
        for a, b in zip(starts.tolist(), stops.tolist(), strict=True)
    ]


def global_positions(
    shard_rows: Sequence[int], digest: str, params: plans.PlanParams, wanted: Sequence[int]
) -> list[tuple[int, int]]:
    """(index, position in the epoch's global sequence) of each dataset-wide sample
    index in `wanted` (each in range), in the order of the block-level sequence."""
    offsets = plans.shard_offsets(shard_rows)
    by_shard: dict[int, list[int]] = {}
    for index in sorted(set(wanted)):
        shard, row = plans.locate(offsets, index)
        by_shard.setdefault(shard, []).append(row)
    out: list[tuple[int, int]] = []
    offset = 0
    for run in plans.global_runs(shard_rows, digest, params):
        rows = by_shard.get(run.shard)
        if rows:
            i = bisect.bisect_left(rows, run.start)
            while i < len(rows) and rows[i] < run.stop:
                out.append((offsets[run.shard] + rows[i], offset + rows[i] - run.start))
                i += 1
        offset += len(run)
    if not params.sampled:
        return out
    return _permuted(offset, digest, params, out)


def _permuted(
    total: int, digest: str, params: plans.PlanParams, found: list[tuple[int, int]]
) -> list[tuple[int, int]]:
    """Block-level positions moved to where window permutation (rule 8) puts them:
    window k's row j sits at k*window + inverse(order)[j]."""
    import numpy as np  # sample mode only

    from shardcache import sequences, windows

    w = params.window
    inverses: dict[int, list[int]] = {}
    out: list[tuple[int, int]] = []
    for index, pos in found:
        k = windows.window_of(pos, w)
        inverse = inverses.get(k)
        if inverse is None:
            lo, hi = windows.window_span(total, w, k)
            order = sequences.window_order(hi - lo, plans.window_seed(digest, params, k))
            inv = np.empty_like(order)
            inv[order] = np.arange(len(order), dtype=order.dtype)
            inverse = inverses[k] = inv.tolist()
        out.append((index, k * w + inverse[pos - k * w]))
    return out


def index_ranges(
    shard_rows: Sequence[int], digest: str, params: plans.PlanParams, start: int, stop: int
) -> list[tuple[int, int]]:
    """Dataset-wide sample indices `[lo, hi)` read at positions [start, stop) of
    `params.rank`'s stream in `params.epoch`, in reading order, adjacent ranges merged.
    Costs the asked positions (and the windows they touch), not the rank's epoch."""
    total = sum(shard_rows)
    ranges = streams.cut(plans.stream_ranges(total, params), start, stop)
    if not params.sampled:
        offsets = plans.shard_offsets(shard_rows)
        runs = plans.runs_of(plans.global_runs(shard_rows, digest, params), ranges)
        return streams.merge((offsets[r.shard] + r.start, offsets[r.shard] + r.stop) for r in runs)
    import numpy as np  # sample mode only

    seq = _epoch_sequence(shard_rows, digest, params)
    parts = [seq.indices(a, b) for a, b in ranges]
    if not parts:
        return []
    flat = np.concatenate(parts)
    breaks = np.flatnonzero(np.diff(flat) != 1) + 1
    starts = np.concatenate(([0], breaks)).tolist()
    stops = np.concatenate((breaks, [len(flat)])).tolist()
    values = flat.tolist()
    return [(values[a], values[b - 1] + 1) for a, b in zip(starts, stops, strict=True)]
