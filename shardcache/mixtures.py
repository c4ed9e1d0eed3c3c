"""Weighted mixtures of datasets: `shardcache.mix({"web": a, "code": b}, weights=…)`.

A `Mixture` reads several `Dataset`s through their public API and interleaves their
batches. The rules (docs/reading-plan.md, "Mixtures") in short:

* **Per-batch draws.** Every batch comes whole from one source, drawn at each step with
  probability equal to that source's weight at that step. A batch is a zero-copy slice
  of the source's stream (as `Dataset.batches` makes it); no Python runs per sample.
  The draw of step t is a pure function of (seed, t), so a resumed run draws the same
  sources without storing any RNG state beyond the step.
* **Each source is exact.** A source is read by its own plan, from its own position, so
  within a source every row is read once per epoch, in plan order. When a source's
  epoch ends, it moves on to its next epoch; a batch that meets the end of an epoch is
  filled from the start of the next one (one copy), so every batch has `batch_size` rows.
* **Schedules.** Weights are a fixed mapping, or a piecewise-linear schedule over steps.
* **State.** `state_dict()` holds the mixture's step and every source's own state:
  resume is exact, mid-epoch of any source and mid-schedule.

Mixtures live in their own module, beside `datasets`, because they only compose
datasets: nothing here knows shards, leases or the sidecar.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import math
from collections.abc import Generator, Iterator, Mapping, Sequence
from typing import Any, TypeAlias

import pyarrow as pa

from shardcache import _integers, datasets, errors, states

STATE_VERSION = 1
_KIND = states.MIXTURE_KIND

#: What `weights=` accepts: a fixed mapping, or schedule points `(step, mapping)`.
Weights: TypeAlias = "Mapping[str, float] | Sequence[tuple[int, Mapping[str, float]]] | Schedule"


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Source weights over training steps, piecewise linear between points.

    `points` are `(step, weights)` with strictly increasing steps. Before the first
    point the first weights hold, after the last the last; between two points each
    weight is interpolated linearly in the step, then all are normalised to sum to 1.
    One point is a fixed mixture.
    """

    points: tuple[tuple[int, tuple[tuple[str, float], ...]], ...]

    @classmethod
    def of(cls, weights: object, *, names: Sequence[str]) -> Schedule:
        """A schedule from what `mix(weights=…)` accepts, checked against `names`."""
        if isinstance(weights, Schedule):
            raw: list[tuple[object, object]] = [(s, dict(w)) for s, w in weights.points]
        elif isinstance(weights, Mapping):
            raw = [(0, weights)]
        elif isinstance(weights, Sequence) and not isinstance(weights, str | bytes):
            raw = []
            for point in weights:
                if not isinstance(point, Sequence) or len(point) != 2:
                    raise errors.InputError(
                        f"weights: expected schedule points (step, {{source: weight}}), "
                        f"found {point!r}"
                    )
                raw.append((point[0], point[1]))
        else:
            raise errors.InputError(
                "weights: expected a mapping {source: weight} or a list of "
                f"(step, {{source: weight}}), found {type(weights).__name__}"
            )
        if not raw:
            raise errors.InputError("weights: expected at least one schedule point, found none")
        points = []
        previous: int | None = None
        for step, mapping in raw:
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise errors.InputError(f"weights: a step must be an int >= 0, found {step!r}")
            if previous is not None and step <= previous:
                raise errors.InputError(
                    f"weights: schedule steps must increase, found {step} after {previous}"
                )
            previous = step
            points.append((step, _checked(mapping, names=names, step=step)))
        return cls(tuple(points))

    def at(self, step: int) -> tuple[float, ...]:
        """Normalised weights at `step`, in the order of the sources' names."""
        steps = [s for s, _ in self.points]
        i = bisect.bisect_right(steps, step)
        if i == 0:
            raw = [w for _, w in self.points[0][1]]
        elif i == len(self.points):
            raw = [w for _, w in self.points[-1][1]]
        else:
            (s0, w0), (s1, w1) = self.points[i - 1], self.points[i]
            t = (step - s0) / (s1 - s0)
            raw = [a + (b - a) * t for (_, a), (_, b) in zip(w0, w1, strict=True)]
        total = math.fsum(raw)
        return tuple(w / total for w in raw)

    def to_json(self) -> list[list[Any]]:
        return [[step, dict(weights)] for step, weights in self.points]


def _checked(mapping: object, *, names: Sequence[str], step: int) -> tuple[tuple[str, float], ...]:
    if not isinstance(mapping, Mapping):
        raise errors.InputError(
            f"weights at step {step}: expected a mapping {{source: weight}}, "
            f"found {type(mapping).__name__}"
        )
    if set(mapping) != set(names):
        raise errors.InputError(
            f"weights at step {step}: expected a weight for each source {sorted(names)}, "
            f"found {sorted(map(str, mapping))}"
        )
    out = []
    for name in names:
        weight = mapping[name]
        if (
            isinstance(weight, bool)
            or not isinstance(weight, int | float)
            or not math.isfinite(weight)
            or weight < 0
        ):
            raise errors.InputError(
                f"weights at step {step}: {name}: expected a finite number >= 0, found {weight!r}"
            )
        out.append((name, float(weight)))
    if math.fsum(w for _, w in out) <= 0:
        raise errors.InputError(f"weights at step {step}: expected some weight > 0, found all 0")
    return tuple(out)


def draw(seed: int, step: int, weights: Sequence[float]) -> int:
    """The index of the source that serves batch `step` (a pure function).

    u is the first 8 bytes (little endian) of sha256("mix:<seed>:<step>") over 2**64,
    a uniform number in [0, 1); the source is the first whose cumulative weight
    exceeds u. Keyed by the step instead of a running generator, so the mixer's whole
    RNG state is the step.
    """
    digest = hashlib.sha256(f"mix:{seed}:{step}".encode()).digest()
    u = int.from_bytes(digest[:8], "little") / 2.0**64
    total = 0.0
    last = 0
    for i, w in enumerate(weights):
        if w > 0:
            last = i
            total += w
            if u < total:
                return i
    # Rounding left the cumulative sum a hair below 1: the last source with weight.
    return last


@dataclasses.dataclass
class SourceCounts:
    """What one source has served through the mixture (this process, since open)."""

    batches: int = 0
    rows: int = 0
    #: Times the source reached the end of an epoch and moved to its next one.
    epochs_finished: int = 0


def _refuse_shared(sources: Mapping[str, datasets.Dataset]) -> None:
    """Refuse one `Dataset` object given as two sources.

    The two names would share one stream and one position, which the mixture's state
    would then hold twice; and each source is read by its own iterator, two of which
    over one dataset walked on from their own cursors in block mode while both advanced
    its position (rows handed out twice, a state past the epoch's end). Two sources of
    the same data are two `open()` calls."""
    first: dict[int, str] = {}
    for name, ds in sources.items():
        seen = first.setdefault(id(ds), name)
        if seen != name:
            raise errors.InputError(
                f"mix(): sources {seen!r} and {name!r} are one Dataset object: expected "
                "a Dataset of its own for each source (each source reads its own stream, "
                "from its own open() call); to draw one dataset more often, raise its "
                "weight"
            )


class Mixture:
    """Batches drawn from several datasets by weight. Create it with `shardcache.mix()`."""

    def __init__(
        self,
        sources: Mapping[str, datasets.Dataset],
        *,
        weights: Weights,
        seed: int = 0,
    ) -> None:
        if not isinstance(sources, Mapping) or not sources:
            raise errors.InputError(
                "mix(): expected a mapping {name: Dataset} of at least one source, "
                f"found {sources!r}"
            )
        for name, ds in sources.items():
            if not isinstance(name, str) or not name:
                raise errors.InputError(f"mix(): a source name must be a string, found {name!r}")
            if not isinstance(ds, datasets.Dataset):
                raise errors.InputError(
                    f"mix(): source {name!r}: expected a shardcache.Dataset, "
                    f"found {type(ds).__name__}"
                )
        _refuse_shared(sources)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise errors.InputError(f"mix(): seed: expected an int, found {seed!r}")
        self._names = tuple(sources)
        self._sources = dict(sources)
        self._schedule = Schedule.of(weights, names=self._names)
        self._seed = seed
        self._step = 0
        self._batch_size: int | None = None
        self._streams: dict[str, Generator[list[pa.RecordBatch], None, None]] = {}
        self._stream_key: tuple[int, tuple[str, ...] | None] | None = None
        self.counts = {name: SourceCounts() for name in self._names}

    # --- description --------------------------------------------------------------
    @property
    def sources(self) -> Mapping[str, datasets.Dataset]:
        return dict(self._sources)

    @property
    def schedule(self) -> Schedule:
        return self._schedule

    @property
    def seed(self) -> int:
        """The seed of the draws (the sources keep their own)."""
        return self._seed

    def drawn(self, step: int) -> str:
        """The name of the source that serves batch `step` (rule 3: a pure function of
        the seed, the step and the weights at that step)."""
        return self._names[draw(self._seed, step, self._schedule.at(step))]

    @property
    def step(self) -> int:
        """Batches handed out so far, over the mixture's whole life (resumed runs too)."""
        return self._step

    def weights_at(self, step: int | None = None) -> dict[str, float]:
        """The normalised weights at `step` (default: the next batch's)."""
        at = self._step if step is None else step
        return dict(zip(self._names, self._schedule.at(at), strict=True))

    def snapshot(self) -> dict[str, Any]:
        """Per-source counters and the current weights, as a JSON dict (like
        `StallMeter.snapshot()`): for the trainer's own metrics or logs."""
        return {
            "step": self._step,
            "weights": self.weights_at(),
            "sources": {
                name: {
                    **dataclasses.asdict(c),
                    "epoch": self._sources[name].epoch,
                    "position": self._sources[name].position,
                }
                for name, c in self.counts.items()
            },
        }

    # --- iteration ----------------------------------------------------------------
    def batches(
        self,
        batch_size: int,
        *,
        columns: Sequence[str] | None = None,
        steps: int | None = None,
    ) -> Generator[pa.RecordBatch, None, None]:
        """`steps` more batches of `batch_size` rows (None: without end), each from the
        source drawn for its step. Every source must have the columns asked for.
        `state_dict()` taken after a batch was handed out counts it as read."""
        for pieces in self.batch_pieces(batch_size, columns=columns, steps=steps):
            yield pieces[0] if len(pieces) == 1 else pa.concat_batches(pieces)

    def batch_pieces(
        self,
        batch_size: int,
        *,
        columns: Sequence[str] | None = None,
        steps: int | None = None,
    ) -> Generator[list[pa.RecordBatch], None, None]:
        """Like `batches`, each batch as the zero-copy slices it is made of."""
        batch_size = _integers.integer(batch_size, "batch_size", minimum=1)
        if steps is not None:
            steps = _integers.integer(steps, "steps", minimum=0)
        key = (batch_size, tuple(columns) if columns is not None else None)
        if key != self._stream_key:
            self._close_streams()
            self._stream_key = key
        self._batch_size = batch_size
        done = 0
        while steps is None or done < steps:
            name = self.drawn(self._step)
            pieces = self._next(name, batch_size, columns)
            self._step += 1
            count = self.counts[name]
            count.batches += 1
            count.rows += batch_size
            done += 1
            yield pieces

    def _next(
        self, name: str, batch_size: int, columns: Sequence[str] | None
    ) -> list[pa.RecordBatch]:
        """The next `batch_size` rows of source `name`, across its epoch end if need be."""
        ds = self._sources[name]
        if len(ds) == 0:
            # A source of weight 0 throughout may be empty; one that is drawn may not.
            raise errors.InputError(
                f"mix(): source {name!r} has no rows for rank {ds.params.rank} but was drawn "
                "(its weight is above 0): give it rows or weight 0"
            )
        pieces: list[pa.RecordBatch] = []
        want = batch_size
        while want:
            if ds.position >= len(ds):
                ended = self._streams.pop(name, None)
                if ended is not None:
                    ended.close()
                ds.set_epoch(ds.epoch + 1)
                self.counts[name].epochs_finished += 1
            stream = self._streams.get(name)
            if want < batch_size:
                # The rest of a batch after an epoch ended: a one-off read of `want`
                # rows; the source's next full batch starts right after them.
                stream = ds.batch_pieces(want, columns=columns)
                got = next(stream)
                stream.close()
            else:
                if stream is None:
                    stream = ds.batch_pieces(batch_size, columns=columns)
                    self._streams[name] = stream
                got = next(stream)
            pieces.extend(got)
            want -= sum(len(p) for p in got)
        return pieces

    def _close_streams(self) -> None:
        for stream in self._streams.values():
            stream.close()
        self._streams.clear()

    def __iter__(self) -> Iterator[pa.RecordBatch]:
        return self.batches(1024)

    # --- state --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """A JSON dict: the mixture's step, seed and schedule, and every source's state
        (docs/reading-plan.md, "Mixtures")."""
        return {
            "version": STATE_VERSION,
            "kind": _KIND,
            "seed": self._seed,
            "step": self._step,
            "batch_size": self._batch_size,
            "weights": self._schedule.to_json(),
            "sources": {name: ds.state_dict() for name, ds in self._sources.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at the exact next batch of the run that saved `state`: the same draw
        for every later step, and every source at its saved position.

        Only at the world size the state was saved at, from this rank's own state: a
        mixture offers no elastic resume (what `Dataset.load_state_dict` does with the
        list of every old rank's states), so a state of another world size, or a list,
        is refused saying so before any source checks its own state.

        All or nothing: every source's state is checked before any source moves, so a
        refused state (StateMismatchError) leaves the mixture and all its sources as
        they were."""
        given: object = state  # typed as a mapping; a list is what callers pass by mistake
        if isinstance(given, list | tuple):
            raise errors.StateMismatchError(
                "cannot resume: expected one mixture state from Mixture.state_dict(), found "
                f"a list of {len(given)}: a mixture resumes only at the world size it was "
                "saved at, from this rank's own state; elastic resume (the states of every "
                "old rank, for another world size) is not offered for mixtures"
            )
        if not isinstance(state, Mapping) or state.get("kind") != _KIND:
            raise errors.StateMismatchError(
                "cannot resume: expected a mixture state from Mixture.state_dict(), found "
                + (f"kind {state.get('kind')!r}" if isinstance(state, Mapping) else "no dict")
            )
        if state.get("version") != STATE_VERSION:
            raise errors.StateMismatchError(
                f"cannot resume: mixture state version {state.get('version')!r} is not "
                f"supported: expected {STATE_VERSION}"
            )
        self._check_world_sizes(state.get("sources"))
        ours = self.state_dict()
        differ = [
            f"{key}: state has {state.get(key)!r}, this mixture has {ours[key]!r}"
            for key in ("seed", "weights")
            if state.get(key) != ours[key]
        ]
        saved_sources = state.get("sources")
        if not isinstance(saved_sources, Mapping) or set(saved_sources) != set(self._names):
            found = sorted(saved_sources) if isinstance(saved_sources, Mapping) else saved_sources
            differ.append(f"sources: state has {found!r}, this mixture has {sorted(self._names)}")
        step = state.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            differ.append(f"step: expected an int >= 0, found {step!r}")
        if differ:
            raise errors.StateMismatchError(
                "cannot resume: the state was saved by another mixture ("
                + "; ".join(differ)
                + "); mix the same sources with the same weights and seed"
            )
        assert isinstance(saved_sources, Mapping) and isinstance(step, int)
        for name in self._names:
            saved = saved_sources[name]
            try:
                if not isinstance(saved, Mapping):
                    raise errors.StateMismatchError(
                        f"expected a state dict from Dataset.state_dict(), found "
                        f"{type(saved).__name__}"
                    )
                self._sources[name].checked_state(saved)
            except errors.StateMismatchError as exc:
                raise errors.StateMismatchError(f"source {name!r}: {exc}") from exc
        # Every state is checked: loading them checks them again, and passes.
        self._close_streams()
        for name in self._names:
            self._sources[name].load_state_dict(saved_sources[name])
        self._step = step
        batch_size = state.get("batch_size")
        self._batch_size = batch_size if isinstance(batch_size, int) else None

    def _check_world_sizes(self, saved_sources: object) -> None:
        """Refuse a state saved at another world size before anything else: its sources'
        own refusals would advise the elastic resume a mixture does not offer."""
        if not isinstance(saved_sources, Mapping):
            return  # Refused below, with the other differences.
        for name, ds in self._sources.items():
            saved = saved_sources.get(name)
            world = saved.get("world_size") if isinstance(saved, Mapping) else None
            if isinstance(world, bool) or not isinstance(world, int):
                continue  # Not a state: the source's own check says what it lacks.
            if world != ds.params.world_size:
                raise errors.StateMismatchError(
                    f"cannot resume: the mixture state was saved at world size {world} "
                    f"(source {name!r}), this mixture reads at world size "
                    f"{ds.params.world_size}: a mixture resumes only at the world size it "
                    f"was saved at ({world}); elastic resume is not offered for mixtures. "
                    f"Resume with {world} ranks, or start the mixture afresh"
                )

    # --- lifecycle ----------------------------------------------------------------
    def close(self) -> None:
        """Close every source."""
        self._close_streams()
        for ds in self._sources.values():
            ds.close()

    def __enter__(self) -> Mixture:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def mix(
    sources: Mapping[str, datasets.Dataset],
    *,
    weights: Weights,
    seed: int = 0,
) -> Mixture:
    """Several datasets as one stream of batches, each batch drawn from one source with
    probability equal to the source's weight at that step.

    `weights` is `{name: weight}` (normalised; need not sum to 1) or a schedule
    `[(step, {name: weight}), …]`, linear between points. `seed` picks the draws; the
    sources keep their own seeds and plans. The mixture owns the sources from here on:
    it moves each to its next epoch when it ends, and `close()` closes them.
    """
    return Mixture(sources, weights=weights, seed=seed)
