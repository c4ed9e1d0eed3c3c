"""The data state dict: where one rank is in its stream, and what it skipped on purpose.

`Dataset.state_dict()` writes it, `load_state_dict()`, the checkpoint agent (which
applies a requested skip at restore) and the lineage tools read it; this module is the
one parser, so they agree. The format is versioned (docs/reading-plan.md, "State
dict"); version 1 states (no skips, no batch size) still load.

A skip is a range of positions `[start, stop)` of one epoch of this rank's stream that
was passed over without being read: `Dataset.skip_batches(k)` or a skip applied by the
agent at restore. Skips are kept for every epoch, so a state tells the whole history
of what the rank did not read; a run carries a handful, not one per step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from shardcache import _integers, errors, plans, streams

#: Version 2 added `batch_size` and `skips`; version 3 `segments` (elastic resume);
#: version 4 the segments' `least`. A state is written as the lowest version that holds
#: it (`version_of`), so a state without `least` still loads in a shardcache that
#: reads 3 only.
STATE_VERSION = 4
SUPPORTED_VERSIONS = (1, 2, 3, 4)
#: The version of a state whose segments carry no `least` (or that has none).
_WITHOUT_LEAST = 3
#: The first version with `batch_size` and `skips`.
_WITH_SKIPS = 2
#: The keys that say which stream a state belongs to; a resume needs all of them equal.
IDENTITY_KEYS = ("plan_version", "digest", "seed", "shuffle", "block_size", "world_size", "rank")
#: Plan version 2's keys: the shuffle granularity ("block" or "sample") and the
#: sample-shuffle window. A state without them (plan version 1) is in block mode.
PLAN_KEYS = ("granularity", "window")
#: The `kind` of a mixture's state (`shardcache.mixtures`), which holds one state per
#: source: the one thing a tool is most likely to be handed instead of a rank's state.
MIXTURE_KIND = "mixture"


@dataclasses.dataclass(frozen=True, order=True)
class Skip:
    """Positions [start, stop) of `epoch` that this rank passed over without reading."""

    epoch: int
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start

    def to_json(self) -> dict[str, int]:
        return {"epoch": self.epoch, "start": self.start, "stop": self.stop}


@dataclasses.dataclass(frozen=True)
class DataState:
    """A parsed, validated state dict."""

    digest: str
    params: plans.PlanParams
    position: int
    #: The batch size of the last `batches()` call; None before any (or in version 1).
    batch_size: int | None = None
    skips: tuple[Skip, ...] = ()
    plan_version: int = plans.PLAN_VERSION

    @property
    def epoch(self) -> int:
        return self.params.epoch

    @property
    def rank(self) -> int:
        return self.params.rank

    @property
    def world_size(self) -> int:
        return self.params.world_size

    def skips_in(self, epoch: int) -> list[Skip]:
        return [s for s in self.skips if s.epoch == epoch]

    def to_json(self) -> dict[str, Any]:
        p = self.params
        return {
            "version": version_of(p.segments),
            "plan_version": self.plan_version,
            "digest": self.digest,
            "seed": p.seed,
            "shuffle": p.shuffle,
            "granularity": p.granularity,
            "window": p.window,
            "block_size": p.block_size,
            "world_size": p.world_size,
            "rank": p.rank,
            "epoch": p.epoch,
            "position": self.position,
            "batch_size": self.batch_size,
            "skips": [s.to_json() for s in self.skips],
            "segments": p.segments.to_json() if p.segments is not None else None,
        }


def version_of(segments: streams.Segments | None) -> int:
    """The version a state with these segments is written as: 4 only when they carry
    `least`. A reader of version 3 would ignore `least` and end its `drop_last`
    batches at its own rows, so after a resize whose ranks got unequal shares it yields
    one batch more than the ranks that read 4, and a collective waits for it forever;
    by the number it refuses the state instead."""
    if segments is not None and segments.least is not None:
        return STATE_VERSION
    return _WITHOUT_LEAST


def rewritten(state: DataState, *, saved: Mapping[str, Any]) -> dict[str, Any]:
    """`state`, a state read from `saved` whose position and skips a tool then moved
    (the checkpoint agent's skip at restore), as JSON of the version `saved` has (at
    least 2, which holds skips). The trainer that wrote `saved` reads the state next, and
    it may be of an older release than the tool (the sidecar's image upgraded first): a
    version-3 state whose segments carry `least` (written before version 4 existed) was
    written back as 4 by `to_json`, which the very trainer that saved it refused ("state
    version 4 is not supported"). Kept at its version, it loads wherever `saved` did;
    such a state resumed by a trainer that ignores `least` is no worse than `saved`."""
    version = _supported(saved.get("version"), where="")
    return {**state.to_json(), "version": max(version, _WITH_SKIPS)}


def _supported(version: object, *, where: str) -> int:
    """`version` if this release reads states of it; StateMismatchError otherwise."""
    if version not in SUPPORTED_VERSIONS:
        raise errors.StateMismatchError(
            f"{where}state version {version!r} is not supported: expected one of "
            f"{list(SUPPORTED_VERSIONS)} (saved by another shardcache version)"
        )
    return int(version)


def _int(data: Mapping[str, Any], key: str, *, where: str, minimum: int = 0) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise errors.StateMismatchError(
            f"{where}: {key} must be an integer >= {minimum}, found {value!r}"
        )
    return value


def parse(state: object, *, where: str = "state dict") -> DataState:
    """A state dict of any supported version; StateMismatchError says what is wrong."""
    if not isinstance(state, Mapping):
        raise errors.StateMismatchError(
            f"{where}: expected a state dict from Dataset.state_dict(), got {type(state).__name__}"
        )
    if state.get("kind") == MIXTURE_KIND:
        raise errors.StateMismatchError(f"{where}: {_mixture_note(state)}")
    if "dataset" in state and "split" in state:
        raise errors.StateMismatchError(f"{where}: {_adapter_note(state)}")
    # dict.fromkeys: IDENTITY_KEYS repeats "digest", and a key is missing once.
    required = dict.fromkeys(("version", "digest", "epoch", "position", *IDENTITY_KEYS))
    missing = [k for k in required if k not in state]
    if missing:
        raise errors.StateMismatchError(f"{where}: lacks {missing}: not a shardcache state")
    version = _supported(state["version"], where=f"{where}: ")
    raw_segments = state.get("segments") if version >= 3 else None
    plan_version = _int(state, "plan_version", where=where)
    if plan_version not in plans.SUPPORTED_PLAN_VERSIONS:
        raise errors.StateMismatchError(
            f"{where}: plan version {plan_version} is not supported: expected one of "
            f"{list(plans.SUPPORTED_PLAN_VERSIONS)} (saved by another shardcache version)"
        )
    # Version 1 had block mode only; its states carry no granularity or window.
    granularity = state.get("granularity", plans.BLOCK) if plan_version >= 2 else plans.BLOCK
    window = state.get("window", plans.DEFAULT_WINDOW) if plan_version >= 2 else None
    if window is not None:
        window = _int(state, "window", where=where, minimum=1)
    try:
        # Named "segments" only: the InputError it raises gets `where` below, once.
        segments = (
            streams.Segments.from_json(raw_segments, where="segments")
            if raw_segments is not None
            else None
        )
        params = plans.PlanParams(
            seed=_int(state, "seed", where=where, minimum=-(2**63)),
            epoch=_int(state, "epoch", where=where),
            rank=_int(state, "rank", where=where),
            world_size=_int(state, "world_size", where=where, minimum=1),
            shuffle=bool(state["shuffle"]),
            block_size=_int(state, "block_size", where=where, minimum=1),
            segments=segments,
            granularity=str(granularity),
            window=plans.DEFAULT_WINDOW if window is None else window,
        )
    except errors.StateMismatchError:
        raise
    except errors.InputError as exc:
        raise errors.StateMismatchError(f"{where}: {exc}") from exc
    batch_size = state.get("batch_size") if version >= 2 else None
    if batch_size is not None:
        batch_size = _int(state, "batch_size", where=where, minimum=1)
    raw_skips = state.get("skips", []) if version >= 2 else []
    if not isinstance(raw_skips, list):
        raise errors.StateMismatchError(f"{where}: skips must be a list, found {raw_skips!r}")
    skips: list[Skip] = []
    for raw in raw_skips:
        if not isinstance(raw, Mapping):
            raise errors.StateMismatchError(
                f'{where}: a skip must be {{"epoch", "start", "stop"}}, found {raw!r}'
            )
        skip = Skip(
            _int(raw, "epoch", where=f"{where} skip"),
            _int(raw, "start", where=f"{where} skip"),
            _int(raw, "stop", where=f"{where} skip"),
        )
        if skip.stop <= skip.start:
            raise errors.StateMismatchError(
                f"{where}: a skip must end after it starts, found {skip.to_json()}"
            )
        skips.append(skip)
    position = _int(state, "position", where=where)
    _check_skips_behind(skips, epoch=params.epoch, position=position, where=where)
    return DataState(
        digest=str(state["digest"]),
        params=params,
        position=position,
        batch_size=batch_size,
        skips=normalise(skips),
        plan_version=plan_version,
    )


def _check_skips_behind(skips: Sequence[Skip], *, epoch: int, position: int, where: str) -> None:
    """Refuse a skip of the state's own epoch that ends after its position.

    A skip moves the position to its end (`skip_batches`), so the rank can only be at
    or past it; one ahead of the position is hand-edited, and reading on would hand out
    the rows it calls skipped (the reader does not pass over a skip ahead of it),
    while the state and `shardcache lineage` go on saying they were never read. A skip
    that ends exactly at the position is the agent's, which may run past the epoch's
    end (`clamp` cuts both)."""
    ahead = [s for s in skips if s.epoch == epoch and s.stop > position]
    if ahead:
        raise errors.StateMismatchError(
            f"{where}: expected every skip of epoch {epoch} to end at or before the "
            f"position {position} (a skip moves the position past it), found "
            f"{[s.to_json() for s in ahead]}: the state contradicts itself; was it edited "
            "by hand? Skip with Dataset.skip_batches() or shardcache skip instead"
        )


def _mixture_note(state: Mapping[str, Any]) -> str:
    sources = state.get("sources")
    names = sorted(sources) if isinstance(sources, Mapping) else []
    first = repr(names[0]) if names else "NAME"
    return (
        f"this is a mixture's state (shardcache.mix, sources {names}), not one dataset's: "
        f"a mixture keeps each source's own state under sources.<name>; use the state "
        f"of the source that read this dataset (e.g. state['sources'][{first}])"
    )


def _adapter_note(state: Mapping[str, Any]) -> str:
    # A checkpoint committed with data_state=torch_ds.state_dict() and opened with
    # shardcache.open(resume_from=...): the Dataset state is one key down.
    return (
        f"this is a framework adapter's state (shardcache.torch / shardcache.numpy, "
        f"split {state.get('split')!r}), not one dataset's: it wraps the dataset's state "
        "under 'dataset': pass it to the adapter's load_state_dict "
        "(shardcache.torch.IterableDataset also takes it through resume_from=), or pass "
        "state['dataset'] here"
    )


def normalise(skips: Iterable[Skip]) -> tuple[Skip, ...]:
    """Sorted, with overlapping or adjacent ranges of one epoch merged."""
    out: list[Skip] = []
    for s in sorted(skips):
        prev = out[-1] if out else None
        if prev is not None and prev.epoch == s.epoch and s.start <= prev.stop:
            out[-1] = Skip(s.epoch, prev.start, max(prev.stop, s.stop))
        else:
            out.append(s)
    return tuple(out)


def mismatches(
    saved: DataState, ours: DataState, *, ours_name: str = "this dataset", same_rank: bool = True
) -> list[str]:
    """What differs between the stream a state was saved from and ours, in words.

    A tool checks the states of several ranks against the one plan it was asked to
    show: it names itself (`ours_name`) and, with `same_rank=False`, takes a state of
    any rank of that plan."""
    a, b = saved.to_json(), ours.to_json()
    skip = {"plan_version"} if same_rank else {"plan_version", "rank"}
    keys = [k for k in IDENTITY_KEYS if k not in skip] + ["granularity"]
    if saved.params.sampled and ours.params.sampled:
        # The window shapes a sample-mode plan only: beside a block-mode plan the
        # granularity differs, and a window would be the default filled in, never saved.
        keys.append("window")
    out = [
        f"{key}: state has {a[key]!r}, {ours_name} has {b[key]!r}"
        for key in keys
        if a[key] != b[key]
    ]
    # Plan version 2's block mode and manifest order are version 1's rules, so a state
    # of either version resumes there; sample mode exists from version 2 on.
    if saved.plan_version > ours.plan_version:
        out.insert(
            0, f"plan_version: state has {saved.plan_version}, {ours_name} has {ours.plan_version}"
        )
    return out


def skip_batches(
    state: DataState, batches: int, *, batch_size: int | None, rank_samples: int | None
) -> tuple[DataState, Skip | None]:
    """`state` with its next `batches` batches skipped: the position moves past them and
    the range is recorded. A skip never crosses the end of the epoch (`rank_samples`
    samples); it is cut there. The checkpoint agent, which does not know the dataset,
    passes None: `clamp` cuts the skip when the dataset loads the state. Returns the new
    state and the recorded skip (None when nothing was left to skip)."""
    batches = _integers.integer(batches, "skip: batches", minimum=1)
    if batch_size is not None:
        batch_size = _integers.integer(batch_size, "skip: batch_size", minimum=1)
    size = batch_size if batch_size is not None else state.batch_size
    if size is None:
        raise errors.InputError(
            "skip: the batch size is not known (no batches() call yet, and the state "
            "records none): give it (batch_size=, or shardcache skip --batch-size)"
        )
    start = state.position
    stop = start + batches * size
    if rank_samples is not None:
        stop = min(stop, rank_samples)
    if stop <= start:
        return dataclasses.replace(state, batch_size=size), None
    skip = Skip(state.epoch, start, stop)
    new = dataclasses.replace(
        state, position=stop, batch_size=size, skips=normalise([*state.skips, skip])
    )
    return new, skip


def clamp(state: DataState, rank_samples: int) -> DataState:
    """`state` with a skip that runs past the end of its epoch (`rank_samples` samples)
    cut at the end: what a skip applied without knowing the dataset becomes. A position
    past the end that no skip explains is left for the caller to refuse."""
    if state.position <= rank_samples:
        return state
    last = state.skips_in(state.epoch)[-1:] or None
    if last is None or last[0].stop != state.position or last[0].start > rank_samples:
        return state
    skip = last[0]
    kept = [s for s in state.skips if s != skip]
    if skip.start < rank_samples:
        kept.append(Skip(skip.epoch, skip.start, rank_samples))
    return dataclasses.replace(state, position=rank_samples, skips=normalise(kept))


def skips_until(skips: Sequence[Skip], epoch: int, position: int) -> tuple[Skip, ...]:
    """`skips` as they stand at `position` of `epoch`: that epoch's skips cut there (one
    starting at or after it dropped), other epochs' kept."""
    out = []
    for s in skips:
        if s.epoch != epoch or s.stop <= position:
            out.append(s)
        elif s.start < position:
            out.append(Skip(s.epoch, s.start, position))
    return tuple(out)


def moved(state: Mapping[str, Any], *, position: int, epoch: int | None = None) -> dict[str, Any]:
    """A state dict of `Dataset.state_dict()` moved to `position` of `epoch` (its own
    epoch when None), to load: what a reader does to start a pass or a loader process
    at a place of its own. The skips of that epoch are cut there (`skips_until`): a
    skip after the place has not happened there (the rows `drop_last` trimmed, recorded
    at the epoch's end, are trimmed again when the walk gets there), and a state with a
    skip ahead of its position contradicts itself (`parse` refuses it)."""
    out = dict(state)
    out["epoch"] = state["epoch"] if epoch is None else epoch
    out["position"] = position
    raw = state.get("skips") or []
    skips = [Skip(s["epoch"], s["start"], s["stop"]) for s in raw]
    out["skips"] = [s.to_json() for s in skips_until(skips, out["epoch"], position)]
    return out


def skipped_before(skips: Sequence[Skip], position: int) -> int:
    """Samples of `skips` (one epoch's) that lie before `position`."""
    return sum(max(0, min(s.stop, position) - s.start) for s in skips)


def is_skipped(skips: Sequence[Skip], position: int) -> bool:
    return any(s.start <= position < s.stop for s in skips)


def step_of(skips: Sequence[Skip], position: int, batch_size: int) -> int:
    """The batch (counting from 0, as `Dataset.batches` yields them in the epoch) that
    holds the sample at `position`: skipped samples are never yielded, so they do not
    count. Exact because a skip starts where a yielded batch ended."""
    return (position - skipped_before(skips, position)) // batch_size


def kept(skips: Sequence[Skip], start: int, stop: int) -> list[tuple[int, int]]:
    """Positions [start, stop) of one epoch less `skips` (that epoch's): what is read."""
    out: list[tuple[int, int]] = []
    pos = start
    for s in sorted(skips):
        if s.stop <= pos or s.start >= stop:
            continue
        if s.start > pos:
            out.append((pos, s.start))
        pos = max(pos, s.stop)
    if pos < stop:
        out.append((pos, stop))
    return out


def positions_of(
    skips: Sequence[Skip], samples: int, first: int, count: int
) -> list[tuple[int, int]]:
    """Position ranges of the `count` samples handed out from the `first`-th on, in an
    epoch of `samples` positions with `skips` (that epoch's) passed over."""
    out: list[tuple[int, int]] = []
    seen = 0
    for lo, hi in kept(skips, 0, samples):
        n = hi - lo
        if seen + n > first and count > 0:
            a = lo + max(0, first - seen)
            b = min(hi, a + count)
            out.append((a, b))
            count -= b - a
            first = seen + n
        seen += n
        if count <= 0:
            break
    return out


def refuse_epoch_before_loaded(
    epoch: int,
    loaded_epoch: int,
    loaded_position: int | None,
    *,
    state_last: bool = False,
    advice: str | None = None,
) -> None:
    """The one epoch rule of a resume: refuse reading `epoch` when it is before
    `loaded_epoch`, that of a state loaded and not read from yet. A training loop
    written `for epoch in range(epochs): ds.set_epoch(epoch)` after a resume would
    otherwise start epoch 0 again and hand out every sample read before the checkpoint
    a second time, silently.

    By default `set_epoch(epoch)` came right after the load; `state_last`: the state
    reached the dataset after `set_epoch` chose `epoch` (a StatefulDataLoader loads it
    at iter(loader)). `advice` replaces the default way out (a loop from the loaded
    epoch) where the caller knows a better one."""
    if epoch >= loaded_epoch:
        return
    loaded = f"a state of epoch {loaded_epoch} (position {loaded_position})"
    what = (
        f"{loaded} reached the dataset after set_epoch({epoch}) chose an earlier epoch"
        if state_last
        else f"set_epoch({epoch}) right after loading {loaded}"
    )
    raise errors.StateMismatchError(
        f"{what}: expected epoch {loaded_epoch} or later, found {epoch}; reading epoch "
        f"{epoch} again would repeat every sample read before the checkpoint. "
        + (
            advice
            or "Start the training loop at the loaded epoch: `for epoch in range(ds.epoch, "
            "epochs)`. To read an earlier epoch again on purpose, open the dataset without "
            "loading the state"
        )
    )
