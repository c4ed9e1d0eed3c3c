"""Sample-shuffle windows (plan version 2): which shards each window reads.

In sample mode the epoch's block-level sequence (`plans.global_runs`) is cut into
windows of `window` rows, and the rows of each window are permuted
(`shardcache.sequences` computes the permutation). A row never leaves its window, so
the *set* of shards a window reads does not depend on the permutation: this module
answers it with plain Python, for the sidecar's prefetcher (which needs no numpy) and
for the reader's leases. docs/reading-plan.md gives the rules.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from collections.abc import Callable, Mapping, Sequence

from shardcache import plans


def window_span(total: int, window: int, k: int) -> tuple[int, int]:
    """Positions [lo, hi) of the epoch's sequence that window `k` covers."""
    return k * window, min(total, (k + 1) * window)


def window_of(position: int, window: int) -> int:
    return position // window


def block_runs(runs: Sequence[plans.Run], ends: Sequence[int], lo: int, hi: int) -> list[plans.Run]:
    """The rows at positions [lo, hi) of a sequence given as `runs` (with `ends`, their
    `plans.run_ends`), in order."""
    out: list[plans.Run] = []
    i = bisect.bisect_right(ends, lo)
    while i < len(runs) and lo < hi:
        run = runs[i]
        run_lo = ends[i] - len(run)
        a = max(lo, run_lo) - run_lo
        b = min(hi, ends[i]) - run_lo
        if b > a:
            out.append(plans.Run(run.shard, run.start + a, run.start + b))
        lo = ends[i]
        i += 1
    return out


@dataclasses.dataclass(frozen=True)
class Window:
    """One window as a rank meets it: where it ends in the rank's stream, and the
    shards its rows come from (in block-level order)."""

    #: Position in the rank's stream just past the rank's last row of this window.
    end: int
    shards: tuple[int, ...]


def rank_windows(shard_rows: Sequence[int], digest: str, params: plans.PlanParams) -> list[Window]:
    """The windows `params.rank` reads in the epoch, in order, with their shards.

    The rank's stream is `plans.stream_ranges`: its rule-5 range, or after an elastic
    resume its segments, whose windows are met in the segments' order (a window two
    adjacent segments share is listed once). A rank whose range starts or ends inside
    a window reads only part of it, but which of the window's rows fall in that part
    is up to the permutation: the shards listed are the whole window's, a superset of
    what the rank touches there.
    """
    runs = plans.global_runs(shard_rows, digest, params)
    ends = plans.run_ends(runs)
    total = ends[-1] if ends else 0
    out: list[Window] = []
    last_k = -1
    pos = 0
    w = params.window
    for lo, hi in plans.stream_ranges(total, params):
        for k in range(window_of(lo, w), window_of(hi - 1, w) + 1):
            a, b = window_span(total, w, k)
            end = pos + min(b, hi) - lo
            if k == last_k:
                # Segments are in increasing global order, so a shared window is the
                # last one listed: the reader stays in it.
                out[-1] = Window(end, out[-1].shards)
                continue
            shards = plans.shard_order(block_runs(runs, ends, a, b))
            out.append(Window(end, tuple(shards)))
            last_k = k
        pos += hi - lo
    return out


def window_ends(windows: Sequence[Window]) -> list[int]:
    return [w.end for w in windows]


def next_shards(
    windows: Sequence[Window], ends: Sequence[int], position: int, count: int
) -> list[int]:
    """Shards to keep resident for a reader at `position` of its stream: every shard of
    its current window and of the next (the reader holds a whole window while it
    gathers, and crosses into the next mid-batch), then further windows' shards up to
    `count` in all."""
    out: list[int] = []
    seen: set[int] = set()
    first = bisect.bisect_right(ends, position)
    for i, win in enumerate(itertools.islice(windows, first, None)):
        if i >= 2 and len(out) >= count:
            break
        for shard in win.shards:
            if shard not in seen:
                seen.add(shard)
                out.append(shard)
    return out


def held_at(windows: Sequence[Window], ends: Sequence[int], position: int) -> tuple[int, ...]:
    """The shards a reader at `position` of its stream holds at once: those of its
    current window and of the next (it crosses into the next in the middle of a batch,
    and gathering ahead plans into it before the current one is handed over), each
    once; none past its last window. The sidecar keeps the same resident
    (`next_shards`)."""
    i = bisect.bisect_right(ends, position)
    return tuple(dict.fromkeys(s for win in windows[i : i + 2] for s in win.shards))


@dataclasses.dataclass(frozen=True)
class Need:
    """What the sample-mode readers of one cache hold at once: every shard of each
    one's current window and of the next (`held_at`)."""

    #: The shards each reader holds at once (readers past their last window: none).
    readers: dict[str, tuple[int, ...]]
    #: Decoded bytes of each of those shards whose size is known or estimated.
    sizes: dict[int, int]
    #: Those shards' bytes, each shard once (readers share shards, and the cache one
    #: copy of each).
    bytes: int
    #: Shards of them of no known size (counted as 0 bytes above).
    unknown: int

    def reader_bytes(self, reader: str) -> int:
        return sum(self.sizes.get(s, 0) for s in self.readers[reader])

    def describe(self, most: int = 4) -> str:
        """The readers' windows in words, the largest first, at most `most` of them."""
        rows = sorted(self.readers, key=lambda r: -self.reader_bytes(r))
        words = [
            f"{reader}: {len(self.readers[reader])} "
            f"shard{'' if len(self.readers[reader]) == 1 else 's'}, "
            f"{self.reader_bytes(reader)} bytes"
            for reader in rows[:most]
        ]
        if len(rows) > most:
            words.append(f"and {len(rows) - most} more")
        return "; ".join(words)


def need(
    readers: Mapping[str, tuple[Sequence[Window], Sequence[int], int]],
    size_of: Callable[[int], int | None],
) -> Need:
    """The memory every sample-mode reader's current and next windows take at once.

    `readers`: each reader's windows, their ends (`window_ends`) and its position;
    `size_of`: a shard's decoded bytes, known or estimated, or None (then it counts 0:
    the figure is as low as what is known)."""
    held: dict[str, tuple[int, ...]] = {}
    for reader, (wins, ends, position) in readers.items():
        shards = held_at(wins, ends, position)
        if shards:
            held[reader] = shards
    sizes: dict[int, int] = {}
    unknown = 0
    for s in {s for shards in held.values() for s in shards}:
        size = size_of(s)
        if size is None:
            unknown += 1
        else:
            sizes[s] = size
    return Need(readers=held, sizes=sizes, bytes=sum(sizes.values()), unknown=unknown)


def estimated_reader_bytes(*, shards: int, rows: int, nbytes: int, window: int) -> int:
    """About what one sample-mode reader holds at once (`held_at`), from a manifest's
    totals alone: what the operator knows of a dataset before any pod reads it.

    A reader holds every shard of its current window and of the next, and a window is
    `window` consecutive rows of the epoch's block-level sequence, in which a shard's
    rows are consecutive (`plans.global_runs`). So two windows touch at most
    ceil(2 * window / r) + 1 shards of r rows: shards of the manifest's average size
    here, and never more than it has. A reader whose share of the epoch is shorter
    still holds its windows' every shard (`rank_windows`), so the world size does not
    lower it. The bytes are `nbytes` per shard on average, the source's: decoded rows
    take as much or more (a compressed source expands), so this is a lower estimate."""
    if shards <= 0 or rows <= 0 or nbytes <= 0:
        return 0
    per_shard_rows = rows / shards
    span = min(2 * window, rows)
    touched = min(shards, math.ceil(span / per_shard_rows) + 1)
    return math.ceil(touched * nbytes / shards)
