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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from shardcache import manifests, placements, plans, states

#: A run of rows [start, stop) of one shard, named by its identity (path, content sha256).
Segment = tuple[tuple[str, str], int, int]


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """One run's data, as `shardcache diff` compares it."""

    manifest: manifests.Manifest
    #: seed, world size, shuffle and block size (epoch and rank are ignored).
    params: plans.PlanParams
    batch_size: int
    #: Per rank, the ranges it skipped (from its checkpoints' data states); an epoch in
    #: `read_again` takes each pass's from there instead.
    skips: Mapping[int, Sequence[states.Skip]] = dataclasses.field(default_factory=dict)
    #: Per rank, the epochs it read more than once: the skips of each pass over the
    #: epoch, oldest first, the last included (`History.read_again`).
    read_again: Mapping[int, Mapping[int, Sequence[Sequence[states.Skip]]]] = dataclasses.field(
        default_factory=dict
    )

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

    def to_json(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "pass_index": self.pass_index,
            "passes": self.passes,
            "step": self.step,
            "rank": self.rank,
            "reasons": list(self.reasons),
            "a": [list(x) for x in self.a],
            "b": [list(x) for x in self.b],
        }


def passes(run: RunPlan, epoch: int) -> int:
    """How many passes over `epoch` any rank of the run made."""
    return max(len(run.pass_skips(r, epoch)) for r in range(run.params.world_size))


def segments(run: RunPlan, rank: int, epoch: int, pass_index: int = 0) -> list[Segment]:
    """The rows `rank` is handed in pass `pass_index` over `epoch`, in order, skips
    removed; none in a pass it did not make."""
    every = run.pass_skips(rank, epoch)
    if rank >= run.params.world_size or pass_index >= len(every):
        return []
    m = run.manifest
    params = dataclasses.replace(run.params, rank=rank, epoch=epoch)
    skips = every[pass_index]
    out: list[Segment] = []
    pos = 0
    for r in placements.rank_runs(m.shard_rows, m.digest, params):
        # The content hash, not the store's identity: a shard whose bytes changed is
        # other samples, and one re-uploaded unchanged (a new ETag) is the same.
        key = (m.shards[r.shard].path, m.shards[r.shard].sha256)
        lo, hi = pos, pos + len(r)
        cursor = lo
        for s in skips:
            if s.stop <= cursor or s.start >= hi:
                continue
            if s.start > cursor:
                out.append((key, r.start + cursor - lo, r.start + s.start - lo))
            cursor = max(cursor, s.stop)
        if cursor < hi:
            out.append((key, r.start + cursor - lo, r.start + hi - lo))
        pos = hi
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
    """The first (epoch, step, rank) whose batch differs between the runs, or None."""
    for epoch in epochs:
        count = max(passes(a, epoch), passes(b, epoch))
        for n in range(count):
            found = _first_in_pass(a, b, epoch, n)
            if found is not None:
                return dataclasses.replace(found, passes=count)
    return None


def _first_in_pass(a: RunPlan, b: RunPlan, epoch: int, n: int) -> Difference | None:
    """The first (step, rank) of pass `n` over `epoch` whose batch differs, or None."""
    best: tuple[int, int, list[Segment], list[Segment]] | None = None
    for rank in range(max(a.params.world_size, b.params.world_size)):
        sa, sb = segments(a, rank, epoch, n), segments(b, rank, epoch, n)
        at = first_mismatch(sa, sb)
        if at is None and a.batch_size == b.batch_size:
            continue
        if a.batch_size != b.batch_size:
            if not sa and not sb:
                continue
            step = 0
        else:
            assert at is not None
            step = at // a.batch_size
        if best is None or step < best[0]:
            best = (step, rank, sa, sb)
    if best is None:
        return None
    step, rank, sa, sb = best
    return Difference(
        epoch=epoch,
        step=step,
        rank=rank,
        reasons=tuple(reasons(a, b, rank, epoch, n)),
        a=take(sa, step * a.batch_size, a.batch_size),
        b=take(sb, step * b.batch_size, b.batch_size),
        pass_index=n,
    )


def shard_changes(a: manifests.Manifest, b: manifests.Manifest) -> dict[str, list[str]]:
    """Shards only in A, only in B, and in both with other content (version, size, rows)."""
    sa = {s.path: s for s in a.shards}
    sb = {s.path: s for s in b.shards}
    return {
        "only_in_a": sorted(set(sa) - set(sb)),
        "only_in_b": sorted(set(sb) - set(sa)),
        "changed": sorted(p for p in set(sa) & set(sb) if sa[p] != sb[p]),
    }


def reasons(a: RunPlan, b: RunPlan, rank: int, epoch: int, pass_index: int = 0) -> list[str]:
    """Why the runs' batches differ: every plan input that differs, a pass over `epoch`
    one run's `rank` made and the other's did not, and the skips of `rank` in that pass
    that differ."""
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
        ("world size", pa_.world_size, pb.world_size),
        ("batch size", a.batch_size, b.batch_size),
        ("shuffle", pa_.mode, pb.mode),
        ("block size", pa_.block_size, pb.block_size),
        ("window", _window(pa_), _window(pb)),
    ):
        if x != y:
            out.append(f"another {name}: {x} vs {y}")
    in_a, in_b = a.pass_skips(rank, epoch), b.pass_skips(rank, epoch)
    made = [len(p) > pass_index for p in (in_a, in_b)]
    if made[0] != made[1]:
        out.append(
            f"a pass: rank {rank} read epoch {epoch} {_times(len(in_a))} in A, "
            f"{_times(len(in_b))} in B (again from its start); pass {pass_index + 1} is "
            f"only in {'A' if made[0] else 'B'}"
        )
    elif made[0] and in_a[pass_index] != in_b[pass_index]:
        where = f" pass {pass_index + 1}" if max(len(in_a), len(in_b)) > 1 else ""
        out.append(
            f"a skip: rank {rank} in epoch {epoch}{where} skipped positions "
            f"{_ranges(in_a[pass_index])} in A, {_ranges(in_b[pass_index])} in B"
        )
    return out or ["the batches differ"]


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
