"""The epoch's global sequence as dataset-wide sample indices (manifest order).

Every plan mode defines one sequence of all N rows of an epoch, and rank r reads its
range [floor(N*r/W), floor(N*(r+1)/W)) (plans rule 5), or after an elastic resume its
segments, ranges of the same sequence (`plans.stream_ranges`, `stream_indices`). `Sequence.indices(lo, hi)`
turns any range of that sequence into the manifest indices to read, in order: in
block mode they expand the plan's runs; in sample mode (plan version 2) each window of
`window` rows of the block-level sequence is permuted by sorting its rows on keys drawn
from SplitMix64 (docs/reading-plan.md, "Plan version 2"). Vectorised with numpy: the
permutation of a 65,536-row window costs about a millisecond, and it is computed once
per window.

numpy is needed only here and in `shardcache.gather` (sample mode and
`Dataset.take`); `import shardcache` does not import it.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence as Seq

import numpy as np
import numpy.typing as npt

from shardcache import errors, plans, streams, windows

Indices = npt.NDArray[np.int64]

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def splitmix_keys(seed: int, n: int) -> npt.NDArray[np.uint64]:
    """The first `n` outputs of SplitMix64 seeded with `seed` (`plans._SplitMix64`):
    output i (from 1) is mix(seed + i * gamma), so they are computed all at once."""
    state = np.uint64(seed & ((1 << 64) - 1)) + np.arange(1, n + 1, dtype=np.uint64) * _GAMMA
    z = (state ^ (state >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def window_order(n: int, seed: int) -> Indices:
    """A permutation of range(n): the rows sorted by their SplitMix64 keys (ties, at
    odds of about n**2 / 2**65, keep row order)."""
    return np.argsort(splitmix_keys(seed, n), kind="stable").astype(np.int64)


def runs_indices(runs: Seq[plans.Run], offsets: Indices) -> Indices:
    """Manifest indices of the rows of `runs`, in order."""
    if not runs:
        return np.zeros(0, dtype=np.int64)
    lengths = np.fromiter((len(r) for r in runs), dtype=np.int64, count=len(runs))
    firsts = np.fromiter(
        (int(offsets[r.shard]) + r.start for r in runs), dtype=np.int64, count=len(runs)
    )
    before = np.cumsum(lengths) - lengths
    return np.repeat(firsts - before, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)


class Sequence:
    """One epoch's global sequence (all ranks) of a plan."""

    #: Permuted windows kept: a reader works in one window, and crosses into the next.
    CACHED_WINDOWS = 4

    def __init__(self, shard_rows: Seq[int], digest: str, params: plans.PlanParams) -> None:
        self.params = params
        self._digest = digest
        self.runs = plans.global_runs(shard_rows, digest, params)
        self.ends = plans.run_ends(self.runs)
        self.total = self.ends[-1] if self.ends else 0
        self.offsets: Indices = np.asarray(plans.shard_offsets(shard_rows), dtype=np.int64)
        self._windows: collections.OrderedDict[int, tuple[Indices, Indices]] = (
            collections.OrderedDict()
        )
        self._window_shards: dict[tuple[int, int], list[int]] = {}

    def __len__(self) -> int:
        return self.total

    def window(self, k: int) -> Indices:
        """Manifest indices of sample-mode window `k`, in reading order."""
        return self._window(k)[0]

    def window_order(self, k: int) -> Indices:
        """Window `k`'s permutation: its reading order's row j is row `order[j]` of the
        window's block-level rows (`window_runs(k)`, concatenated). A consumer that
        holds those rows (the device prefetcher's copy of a window) gathers with it."""
        return self._window(k)[1]

    def window_runs(self, k: int) -> list[plans.Run]:
        """Window `k`'s rows in block-level order, as runs of one shard each; runs that
        continue each other in one shard are merged."""
        lo, hi = windows.window_span(self.total, self.params.window, k)
        out: list[plans.Run] = []
        for run in windows.block_runs(self.runs, self.ends, lo, hi):
            last = out[-1] if out else None
            if last is not None and last.shard == run.shard and last.stop == run.start:
                out[-1] = plans.Run(run.shard, last.start, run.stop)
            else:
                out.append(run)
        return out

    def _window(self, k: int) -> tuple[Indices, Indices]:
        cached = self._windows.get(k)
        if cached is not None:
            self._windows.move_to_end(k)
            return cached
        lo, hi = windows.window_span(self.total, self.params.window, k)
        rows = runs_indices(windows.block_runs(self.runs, self.ends, lo, hi), self.offsets)
        order = window_order(hi - lo, plans.window_seed(self._digest, self.params, k))
        out: Indices = rows[order]
        self._windows[k] = (out, order)
        while len(self._windows) > self.CACHED_WINDOWS:
            self._windows.popitem(last=False)
        return out, order

    def indices(self, lo: int, hi: int) -> Indices:
        """Manifest indices at positions [lo, hi) of the sequence, in order."""
        if not 0 <= lo <= hi <= self.total:
            raise errors.InputError(
                f"sequence range [{lo}, {hi}) is outside the epoch's [0, {self.total})"
            )
        if not self.params.sampled:
            return runs_indices(windows.block_runs(self.runs, self.ends, lo, hi), self.offsets)
        w = self.params.window
        parts: list[Indices] = []
        pos = lo
        while pos < hi:
            k = windows.window_of(pos, w)
            start, stop = windows.window_span(self.total, w, k)
            cut = min(hi, stop)
            parts.append(self.window(k)[pos - start : cut - start])
            pos = cut
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def window_shards(self, lo: int, hi: int) -> list[int]:
        """Every shard of the sample-mode windows that positions [lo, hi) touch (the
        whole block-level span of a block-mode range): what a reader holds leases on."""
        if hi <= lo:
            return []
        if not self.params.sampled:
            return plans.shard_order(windows.block_runs(self.runs, self.ends, lo, hi))
        # Asked at every batch: answered once per window (pair).
        w = self.params.window
        key = (windows.window_of(lo, w), windows.window_of(hi - 1, w))
        cached = self._window_shards.get(key)
        if cached is None:
            a = windows.window_span(self.total, w, key[0])[0]
            b = windows.window_span(self.total, w, key[1])[1]
            cached = plans.shard_order(windows.block_runs(self.runs, self.ends, a, b))
            if len(self._window_shards) >= 2 * self.CACHED_WINDOWS:
                self._window_shards.clear()
            self._window_shards[key] = cached
        return list(cached)

    def stream_indices(self, ranges: Seq[streams.Range], start: int, stop: int) -> Indices:
        """Manifest indices at positions [start, stop) of a rank's stream, the stream
        being `ranges` of this sequence (`plans.stream_ranges`: one rule-5 range, or an
        elastic resume's segments)."""
        parts = [self.indices(a, b) for a, b in streams.cut(ranges, start, stop)]
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def stream_window_shards(self, ranges: Seq[streams.Range], start: int, stop: int) -> list[int]:
        """`window_shards` of every range of the sequence that stream positions
        [start, stop) map to, in first-needed order without repeats."""
        out: list[int] = []
        for a, b in streams.cut(ranges, start, stop):
            for shard in self.window_shards(a, b):
                if shard not in out:
                    out.append(shard)
        return out


def slots(shards: Seq[int], count: int) -> Indices:
    """Per shard of a `count`-shard manifest, its place in `shards` (-1 if absent): turns
    shard numbers into `gather` source numbers with one indexing."""
    out = np.full(count, -1, dtype=np.int64)
    out[np.asarray(shards, dtype=np.int64)] = np.arange(len(shards), dtype=np.int64)
    return out


def group(shard_of: Indices) -> tuple[list[int], Indices]:
    """The distinct shards of `shard_of` (ascending) and, per row, its shard's place
    among them: the sources and `source_of` of `gather.gather`."""
    used, source_of = np.unique(shard_of, return_inverse=True)
    return [int(s) for s in used], source_of.astype(np.int64).reshape(-1)


def locate(
    offsets: Indices, total: int, indices: Indices, *, checked: bool = True
) -> tuple[Indices, Indices]:
    """(shard, row) of each manifest index; InputError names the first out of range.
    `checked=False` leaves the range check out, for indices the plan made (in range by
    construction, int64): a gather thread runs this under the GIL at every batch.
    Checked indices may be of any integer type (`Dataset.take`'s caller's)."""
    if checked:
        bad = (indices < 0) | (indices >= total)
        if bad.any():
            first = int(indices[np.argmax(bad)])
            raise errors.InputError(
                f"sample index {first} is out of range: the dataset has {total} samples "
                f"(indices 0 to {total - 1}); {int(bad.sum())} of {len(indices)} indices "
                "are outside"
            )
        # Only now: a uint64 index past int64's range would wrap to another index, and
        # the error would name one that was never asked for.
        indices = indices.astype(np.int64, copy=False)
    shard: Indices = np.searchsorted(offsets, indices, side="right")
    shard -= 1
    return shard, indices - offsets[shard]
