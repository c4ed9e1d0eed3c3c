"""Streams: a rank's reading in one epoch as ranges ("segments") of the epoch's global sequence.

The reading plan orders every row of an epoch into one global sequence (rules 1-4 of
docs/reading-plan.md). By default rank r reads one contiguous range of it
(`plans.rank_bounds`). After an elastic resume (`shardcache.elastic`) a rank reads,
in the epoch of the resize, an ordered list of ranges instead: its share of what the
old ranks had left. This module is the arithmetic over such lists; it knows nothing
of shards or shuffle modes, so any plan that can say "rows [a, b) of the epoch's
global sequence" can read a segmented stream.

Positions are counted along the stream: position p is the p-th row of the
concatenated ranges.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from shardcache import errors

Range = tuple[int, int]


@dataclasses.dataclass(frozen=True)
class Segments:
    """The ranges `[a, b)` of `epoch`'s global sequence a rank reads, in order."""

    epoch: int
    ranges: tuple[Range, ...]
    #: The fewest rows any rank of the resize that made these segments reads in `epoch`
    #: (floor(R/W') of the R rows it dealt out): where `drop_last` ends every new rank's
    #: batches, so they all yield the same count (`shardcache.even_batches`). None in a
    #: state resized before it was recorded: the rank's own rows stand in.
    least: int | None = None

    def __post_init__(self) -> None:
        if self.epoch < 0:
            raise errors.InputError(f"segments: epoch must be >= 0, got {self.epoch}")
        if self.least is not None and not 0 <= self.least <= len(self):
            raise errors.InputError(
                f"segments: least must be an int in [0, {len(self)}] (the rows of the "
                f"ranges), found {self.least}"
            )
        for a, b in self.ranges:
            if not 0 <= a < b:
                raise errors.InputError(
                    f"segments: a range must be [a, b) with 0 <= a < b, found [{a}, {b})"
                )
        for (_, b), (c, _) in itertools.pairwise(self.ranges):
            # Increasing global order keeps each shard's rows contiguous in the stream,
            # as they are in the plan (rule 4): a reader holds one shard at a time.
            if c < b:
                raise errors.InputError(
                    f"segments: ranges must be disjoint and in increasing order, found one "
                    f"ending at {b} followed by one starting at {c}"
                )

    def __len__(self) -> int:
        return length(self.ranges)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"epoch": self.epoch, "ranges": [[a, b] for a, b in self.ranges]}
        # Left out when unknown: the segments of a state resized before it read as saved.
        if self.least is not None:
            out["least"] = self.least
        return out

    @classmethod
    def from_json(cls, data: object, *, where: str = "segments") -> Segments:
        """Parse what `to_json` wrote; InputError says what is wrong."""
        if not isinstance(data, Mapping):
            raise errors.InputError(f'{where}: expected {{"epoch", "ranges"}}, found {data!r}')
        epoch, raw = data.get("epoch"), data.get("ranges")
        if isinstance(epoch, bool) or not isinstance(epoch, int):
            raise errors.InputError(f"{where}: epoch must be an integer, found {epoch!r}")
        if not isinstance(raw, list):
            raise errors.InputError(f"{where}: ranges must be a list, found {raw!r}")
        ranges: list[Range] = []
        for item in raw:
            if (
                not isinstance(item, list | tuple)
                or len(item) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in item)
            ):
                raise errors.InputError(f"{where}: a range must be [a, b], found {item!r}")
            ranges.append((item[0], item[1]))
        least = data.get("least")
        if least is not None and (isinstance(least, bool) or not isinstance(least, int)):
            raise errors.InputError(f"{where}: least must be an integer, found {least!r}")
        try:
            return cls(epoch, tuple(ranges), least)
        except errors.InputError as exc:
            raise errors.InputError(f"{where}: {str(exc).removeprefix('segments: ')}") from exc


def length(ranges: Iterable[Range]) -> int:
    return sum(b - a for a, b in ranges)


def merge(ranges: Iterable[Range]) -> list[Range]:
    """`ranges` with empty ones dropped and each one that starts where the previous
    ended joined to it (order kept)."""
    out: list[Range] = []
    for a, b in ranges:
        if b <= a:
            continue
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def cut(ranges: Sequence[Range], start: int, stop: int) -> list[Range]:
    """Global ranges at stream positions [start, stop), in stream order."""
    out: list[Range] = []
    pos = 0
    for a, b in ranges:
        n = b - a
        lo, hi = max(start, pos), min(stop, pos + n)
        if lo < hi:
            out.append((a + lo - pos, a + hi - pos))
        pos += n
        if pos >= stop:
            break
    return merge(out)


def split(ranges: Sequence[Range], parts: int) -> list[list[Range]]:
    """`ranges` cut into `parts` contiguous pieces of the stream whose sizes differ by
    at most one: piece i is stream positions [floor(R*i/parts), floor(R*(i+1)/parts)),
    the rule the plan uses to split an epoch among ranks (rule 5)."""
    if parts < 1:
        raise errors.InputError(f"cannot split into {parts} parts")
    total = length(ranges)
    return [cut(ranges, total * i // parts, total * (i + 1) // parts) for i in range(parts)]


def in_global_order(ranges: Iterable[Range]) -> list[Range]:
    """Disjoint ranges sorted by where they lie in the global sequence, merged.
    Overlapping ranges are a caller's bug (two ranks cannot own one row)."""
    out = merge(sorted(r for r in ranges if r[1] > r[0]))
    for (_, b), (c, _) in itertools.pairwise(out):
        if c < b:
            raise errors.InputError(
                f"segments overlap: a range ends at {b}, the next starts at {c}"
            )
    return out
