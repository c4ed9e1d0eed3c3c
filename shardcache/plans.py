"""The reading plan: which rows a rank reads, in which order, in one epoch.

A pure, deterministic function of (manifest digest, shard row counts, seed, epoch,
rank, world size, shuffle, block size). The client and the sidecar run this same code,
so the sidecar prefetches exactly the shards the trainer will ask for next. The rules
are written down in docs/reading-plan.md; changing them changes every resumed run, so
`PLAN_VERSION` is part of the state dict.

1. Shard order: the manifest order, or with `shuffle` a Fisher-Yates permutation drawn
   from SplitMix64 seeded by sha256(digest, seed, epoch).
2. Within each shard, rows are cut into blocks of `block_size` rows; with `shuffle` the
   blocks of a shard are permuted (seeded by sha256(digest, seed, epoch, shard)). Rows
   inside a block keep their order, so a batch inside a block is a zero-copy slice.
3. The epoch's global sequence of rows is cut into `world_size` contiguous ranges:
   rank r gets rows [floor(N*r/W), floor(N*(r+1)/W)). Every row is read exactly once
   per epoch across the ranks; rank sizes differ by at most one row.

Plan version 2 adds sample-level shuffle (`granularity="sample"`): rules 1-2 give the
epoch's *block-level* sequence, which is cut into windows of `window` rows whose rows
are permuted (shardcache.windows, shardcache.sequences); rule 3 then applies to that
sequence. Block mode and manifest order are unchanged from version 1.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import itertools
from collections.abc import Iterable, Iterator, Sequence

from shardcache import _integers, errors, streams

#: Version 2 added sample-level shuffle; version-1 plans are version 2's block mode.
PLAN_VERSION = 2
#: Plan versions whose states still resume (a version-1 state resumes in block mode).
SUPPORTED_PLAN_VERSIONS = (1, 2)
DEFAULT_BLOCK_SIZE = 4096
#: `shuffle` permutes shards and blocks of rows: a batch is zero-copy slices.
BLOCK = "block"
#: `shuffle` also permutes rows within windows of the block-level sequence (version 2).
SAMPLE = "sample"
GRANULARITIES = (BLOCK, SAMPLE)
#: Rows per sample-shuffle window. 65,536 rows is 16 blocks of the default size, so a
#: window mixes rows of at least 16 blocks (more where shards are small); a reader
#: holds every shard of its current window and the sidecar keeps the next one resident
#: as well, so a larger window costs memory-tier space (docs/reading-plan.md).
DEFAULT_WINDOW = 65536
_MASK64 = (1 << 64) - 1


@dataclasses.dataclass(frozen=True)
class PlanParams:
    """What a reader's plan depends on, besides the manifest."""

    seed: int = 0
    epoch: int = 0
    rank: int = 0
    world_size: int = 1
    shuffle: bool = True
    #: Rows per shuffle block. Larger blocks mean longer zero-copy runs and a coarser
    #: shuffle; 4096 rows keeps a run well above common batch sizes.
    block_size: int = DEFAULT_BLOCK_SIZE
    #: What `shuffle` permutes: BLOCK (blocks of rows) or SAMPLE (rows, within windows
    #: of `window` rows). Without `shuffle` it is always BLOCK: manifest order has none.
    granularity: str = BLOCK
    #: Rows per sample-shuffle window (SAMPLE only).
    window: int = DEFAULT_WINDOW
    #: After an elastic resume: the ranges of the epoch's global sequence this rank
    #: reads in `segments.epoch`, instead of its rule-5 range (`shardcache.elastic`).
    #: Other epochs follow rule 5.
    segments: streams.Segments | None = None

    def __post_init__(self) -> None:
        # Plain ints whatever the caller computed them with: a state dict carries them.
        # (Made at every epoch change, mostly of ints: those are passed over cheaply.)
        for name in ("seed", "epoch", "rank", "world_size", "block_size", "window"):
            value = getattr(self, name)
            if type(value) is not int:
                object.__setattr__(self, name, _integers.integer(value, name))
        if self.granularity not in GRANULARITIES:
            raise errors.InputError(
                f"shuffle granularity must be one of {list(GRANULARITIES)}, "
                f"got {self.granularity!r}"
            )
        if self.window < 1:
            raise errors.InputError(f"window must be >= 1, got {self.window}")
        if not self.shuffle and self.granularity != BLOCK:
            # Manifest order is the same plan whatever the granularity: one spelling.
            object.__setattr__(self, "granularity", BLOCK)
        if self.world_size < 1:
            raise errors.InputError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise errors.InputError(
                f"rank must be in [0, world_size={self.world_size}), got {self.rank}"
            )
        if self.block_size < 1:
            raise errors.InputError(f"block_size must be >= 1, got {self.block_size}")
        if self.epoch < 0:
            raise errors.InputError(f"epoch must be >= 0, got {self.epoch}")

    def with_epoch(self, epoch: int) -> PlanParams:
        return dataclasses.replace(self, epoch=epoch)

    @property
    def sampled(self) -> bool:
        """True when rows are permuted within windows (plan version 2's sample mode)."""
        return self.shuffle and self.granularity == SAMPLE

    @property
    def mode(self) -> str | bool:
        """The `shuffle=` value that gives this plan: "sample", "block" or False."""
        return self.granularity if self.shuffle else False


def shuffle_mode(shuffle: bool | str) -> tuple[bool, str]:
    """(shuffle, granularity) for `shardcache.open(shuffle=…)`: "sample", "block", False
    (manifest order) or True, the default mode: "block" (docs/reading-plan.md says why)."""
    if shuffle is True:
        return True, BLOCK
    if shuffle is False:
        return False, BLOCK
    if shuffle in GRANULARITIES:
        return True, shuffle
    raise errors.InputError(
        f'shuffle: expected "sample", "block", True or False, found {shuffle!r}'
    )


@dataclasses.dataclass(frozen=True)
class Run:
    """Rows [start, stop) of manifest shard `shard`, read in order."""

    shard: int
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


class _SplitMix64:
    """A tiny, specified PRNG, so the plan does not depend on Python's `random` internals."""

    def __init__(self, seed: int) -> None:
        self._state = seed & _MASK64

    def next(self) -> int:
        self._state = (self._state + 0x9E3779B97F4A7C15) & _MASK64
        z = self._state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        # Lemire's multiply-shift: the bias is below 2**-40 for any n we shuffle.
        return (self.next() * n) >> 64


def _derive_seed(*parts: object) -> int:
    text = ":".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little")


def window_seed(digest: str, params: PlanParams, window: int) -> int:
    """The seed of sample-shuffle window `window`'s permutation (plan version 2)."""
    return _derive_seed("window", digest, params.seed, params.epoch, window)


def _permutation(n: int, seed: int) -> list[int]:
    order = list(range(n))
    rng = _SplitMix64(seed)
    for i in range(n - 1, 0, -1):
        j = rng.below(i + 1)
        order[i], order[j] = order[j], order[i]
    return order


def global_runs(shard_rows: Sequence[int], digest: str, params: PlanParams) -> list[Run]:
    """Every row of the epoch, across all ranks, as runs in reading order."""
    runs: list[Run] = []
    for shard in _shard_order(len(shard_rows), digest, params):
        runs.extend(_shard_runs(shard_rows[shard], shard, digest, params))
    return runs


def _shard_order(n: int, digest: str, params: PlanParams) -> list[int]:
    """The order the epoch reads the manifest's `n` shards in."""
    if params.shuffle:
        return _permutation(n, _derive_seed("shards", digest, params.seed, params.epoch))
    return list(range(n))


def _shard_runs(rows: int, shard: int, digest: str, params: PlanParams) -> list[Run]:
    """One shard's runs in the epoch's order: its blocks, permuted with a seed of their
    own, adjacent ones read in order joined. A shard's runs depend on no other shard's,
    so a rank computes only the shards it reads (`rank_runs`)."""
    if rows == 0:
        return []
    bs = params.block_size
    nblocks = -(-rows // bs)
    if params.shuffle and nblocks > 1:
        blocks = _permutation(
            nblocks, _derive_seed("blocks", digest, params.seed, params.epoch, shard)
        )
    else:
        blocks = list(range(nblocks))
    runs: list[Run] = []
    for b in blocks:
        start = b * bs
        stop = min(start + bs, rows)
        if runs and runs[-1].stop == start:
            # Adjacent blocks read in order are one run: a longer zero-copy slice.
            runs[-1] = Run(shard, runs[-1].start, stop)
        else:
            runs.append(Run(shard, start, stop))
    return runs


def rank_bounds(total_rows: int, params: PlanParams) -> tuple[int, int]:
    """The [lo, hi) range of the epoch's global sequence that `params.rank` reads."""
    w = params.world_size
    return total_rows * params.rank // w, total_rows * (params.rank + 1) // w


def stream_ranges(total_rows: int, params: PlanParams) -> list[streams.Range]:
    """The ranges of the epoch's global sequence `params.rank` reads, in order: its
    segments in the epoch of an elastic resume, else its rule-5 range."""
    seg = params.segments
    if seg is not None and seg.epoch == params.epoch:
        return list(seg.ranges)
    lo, hi = rank_bounds(total_rows, params)
    return [(lo, hi)] if hi > lo else []


def rank_samples(total_rows: int, params: PlanParams) -> int:
    """Samples `params.rank` reads in the epoch."""
    return streams.length(stream_ranges(total_rows, params))


def runs_of(
    runs: Sequence[Run], ranges: Sequence[streams.Range], *, ends: Sequence[int] | None = None
) -> list[Run]:
    """The pieces of a global sequence (`runs`, in order) at `ranges` of it, in order.

    `ends`: `run_ends(runs)`, where the caller keeps it (one global order sliced for
    many ranks)."""
    if ends is None:
        ends = run_ends(runs)
    out: list[Run] = []
    for lo, hi in ranges:
        i = bisect.bisect_right(ends, lo)
        while i < len(runs) and lo < hi:
            run_lo = ends[i] - len(runs[i])
            run = runs[i]
            take_hi = min(hi, ends[i])
            out.append(Run(run.shard, run.start + lo - run_lo, run.start + take_hi - run_lo))
            lo = take_hi
            i += 1
    return out


class EpochOrder:
    """The epoch's global order (`global_runs`), made a shard at a time as ranks need
    them: the shard order at once (one permutation of the manifest's shards), each
    shard's runs (its block permutation) the first time a range covers it.

    A shard's blocks are permuted with a seed of their own and its runs never join
    another shard's, so `slice` is exactly `runs_of(global_runs(...), ranges)`. Kept
    by the sidecar for every rank of an epoch (`shardcache.node.epoch_plans`); filling
    it from two threads at once only computes a shard's runs twice, to equal lists."""

    def __init__(self, shard_rows: Sequence[int], digest: str, params: PlanParams) -> None:
        self._rows = shard_rows
        self._digest = digest
        self._params = params
        self._order = _shard_order(len(shard_rows), digest, params)
        # Where each shard's rows start in the epoch's sequence, in reading order.
        self._starts = list(itertools.accumulate((shard_rows[s] for s in self._order), initial=0))
        self._runs: dict[int, list[Run]] = {}

    def slice(self, ranges: Sequence[streams.Range]) -> list[Run]:
        """The pieces of the epoch's order at `ranges` of it, in order."""
        order, starts = self._order, self._starts
        out: list[Run] = []
        for lo, hi in ranges:
            i = bisect.bisect_right(starts, lo) - 1
            while lo < hi and i < len(order):
                base, end = starts[i], starts[i + 1]
                if end > lo:
                    shard = order[i]
                    runs = self._runs.get(shard)
                    if runs is None:
                        runs = _shard_runs(self._rows[shard], shard, self._digest, self._params)
                        self._runs[shard] = runs
                    take = min(hi, end)
                    if lo == base and take == end:
                        out.extend(runs)  # the whole shard
                    else:
                        out.extend(runs_of(runs, [(lo - base, take - base)]))
                    lo = take
                i += 1
        return out

    def spans(self, ranges: Sequence[streams.Range]) -> ShardSpans:
        """`ShardSpans` of `slice(ranges)`: the same walk of the shard order, but only
        where each shard's piece ends (no shard's blocks needed: the order of a
        shard's rows never moves a shard boundary)."""
        order, starts = self._order, self._starts
        shards: list[int] = []
        ends: list[int] = []
        read = 0  # rows of the reader's sequence before `lo`
        for lo, hi in ranges:
            i = bisect.bisect_right(starts, lo) - 1
            while lo < hi and i < len(order):
                end = starts[i + 1]
                if end > lo:
                    take = min(hi, end)
                    read += take - lo
                    shard = order[i]
                    if shards and shards[-1] == shard:
                        ends[-1] = read  # the same shard again at once: one span
                    else:
                        shards.append(shard)
                        ends.append(read)
                    lo = take
                i += 1
        return ShardSpans(shards, ends)


@dataclasses.dataclass(frozen=True)
class ShardSpans:
    """Which shard a reader reads at each position of its plan, without the rows: the
    shards in reading order (a shard read twice in a row once) and where in the
    reader's sequence each one's rows end.

    What the sidecar needs of a block-mode plan (the shards to read ahead and grant):
    `next(position, count)` is exactly `next_shards(runs, run_ends(runs), position,
    count)` of the plan's runs. Made from the epoch's shard order alone
    (`EpochOrder.spans`): no shard's blocks are permuted, and no `Run` is made."""

    shards: list[int]
    #: Position just past each span: strictly increasing, one per shard in `shards`.
    ends: list[int]

    def next(self, position: int, count: int) -> list[int]:
        """The shard at `position` and the `count` - 1 after it (fewer at the end; all
        that are left for a negative `count`, as `next_shards`)."""
        first = bisect.bisect_right(self.ends, position)
        return self.shards[first : first + count] if count >= 0 else self.shards[first:]


def rank_runs(shard_rows: Sequence[int], digest: str, params: PlanParams) -> list[Run]:
    """The runs `params.rank` reads in the epoch, in order: exactly
    `runs_of(global_runs(...), stream_ranges(...))`, but with only the shards the rank's
    ranges cover permuted into blocks (`EpochOrder`). Every rank opening computes its
    plan; of the device benchmark's 48 shards of 42 blocks a rank of 16 reads 3 or 4, and
    the whole order took most of an open's client CPU (docs/benchmarks.md)."""
    ranges = stream_ranges(sum(shard_rows), params)
    if not ranges:
        return []
    return EpochOrder(shard_rows, digest, params).slice(ranges)


def skip(runs: Sequence[Run], position: int) -> Iterator[Run]:
    """The runs left after the first `position` rows have been read."""
    if position < 0:
        raise errors.InputError(f"position must be >= 0, got {position}")
    remaining = position
    for run in runs:
        if remaining >= len(run):
            remaining -= len(run)
            continue
        yield Run(run.shard, run.start + remaining, run.stop)
        remaining = 0


def head(runs: Iterable[Run], rows: int) -> list[Run]:
    """The first `rows` rows of `runs` (all of them when they hold fewer)."""
    out: list[Run] = []
    for run in runs:
        if rows <= 0:
            break
        out.append(run if len(run) <= rows else Run(run.shard, run.start, run.start + rows))
        rows -= len(out[-1])
    return out


def shard_order(runs: Sequence[Run]) -> list[int]:
    """Distinct shards in the order a reader first needs them."""
    seen: set[int] = set()
    order: list[int] = []
    for run in runs:
        if run.shard not in seen:
            seen.add(run.shard)
            order.append(run.shard)
    return order


def upcoming_shards(runs: Sequence[Run], position: int) -> list[int]:
    """Shards still needed from `position` on, in order (the first may be partly read)."""
    return shard_order(list(skip(runs, position)))


def run_ends(runs: Sequence[Run]) -> list[int]:
    """Position just past each run: `next_shards` finds a position's run by bisection."""
    return list(itertools.accumulate(len(r) for r in runs))


def next_shards(runs: Sequence[Run], ends: Sequence[int], position: int, count: int) -> list[int]:
    """The first `count` of `upcoming_shards(runs, position)`, without walking the runs
    before `position`: the prefetcher asks this at every shard a reader acquires."""
    out: list[int] = []
    for i in range(bisect.bisect_right(ends, position), len(runs)):
        if len(out) == count:
            break
        shard = runs[i].shard
        if not out or out[-1] != shard:
            # A shard's runs are contiguous in a plan (rule 4), so a repeat is the last one.
            out.append(shard)
    return out


def shard_offsets(shard_rows: Sequence[int]) -> list[int]:
    """Global sample index of each shard's first row (manifest order)."""
    return [0, *itertools.accumulate(shard_rows)][:-1] if shard_rows else []


def global_index(offsets: Sequence[int], shard: int, row: int) -> int:
    """The dataset-wide index of a row: its position in manifest order."""
    return offsets[shard] + row


def locate(offsets: Sequence[int], index: int) -> tuple[int, int]:
    """Inverse of `global_index`: (shard, row) of a dataset-wide sample index."""
    if index < 0:
        raise errors.InputError(f"sample index must be >= 0, got {index}")
    shard = bisect.bisect_right(offsets, index) - 1
    return shard, index - offsets[shard]
