"""`bench.peers.runner.measure`: how many warm passes a loader runs, and which epoch its
resume reads (a benchmark's method, tested without timing anything real)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest

from bench.peers import loaders, runner
from bench.peers.loaders import base

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Fake:
    """Two samples an epoch; each epoch's batch advances the clock by `pass_s`."""

    kind: base.Kind = "arrow"
    settings = "fake"

    def __init__(self, clock: Clock, pass_s: float) -> None:
        self.clock, self.pass_s = clock, pass_s
        self.epochs: list[int] = []

    def epoch(self, epoch: int) -> Iterator[Any]:
        self.epochs.append(epoch)
        self.clock.now += self.pass_s
        yield pa.record_batch({"uid": [0, 1], "tokens": pa.array([[1], [2]], pa.list_(pa.int32()))})

    def state(self, consumed: int) -> Any | None:
        return None

    def resume(self, state: Any) -> Iterator[Any]:
        raise AssertionError("no state, no resume")

    def close(self) -> None:
        pass


def measured(monkeypatch: pytest.MonkeyPatch, pass_s: float, warm_passes: int) -> Fake:
    clock = Clock()
    fake = Fake(clock, pass_s)
    monkeypatch.setattr(runner.time, "perf_counter", clock)
    monkeypatch.setattr(loaders, "create", lambda name, setup: fake)
    out = runner.measure("fake", setup=None, total_samples=2, warm_passes=warm_passes)  # type: ignore[arg-type]
    assert len(out["warm_passes"]) == len(fake.epochs) - 2  # less the cold and resume epochs
    return fake


def test_a_loader_with_passes_long_enough_runs_the_passes_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = measured(monkeypatch, pass_s=0.2, warm_passes=3)
    # Cold epoch 0, warm 1-3, resume reads epoch 4.
    assert fake.epochs == [0, 1, 2, 3, 4]


def test_short_passes_run_until_they_take_the_minimum_time_together(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = measured(monkeypatch, pass_s=0.06, warm_passes=3)
    warm = fake.epochs[1:-1]
    assert sum(0.06 for _ in warm) >= runner.MIN_WARM_SECONDS
    assert sum(0.06 for _ in warm[:-1]) < runner.MIN_WARM_SECONDS
    assert fake.epochs[-1] == warm[-1] + 1  # the resume reads the epoch after them


def test_very_short_passes_stop_at_the_most_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = measured(monkeypatch, pass_s=0.001, warm_passes=3)
    assert fake.epochs[1:-1] == list(range(1, runner.MAX_WARM_PASSES + 1))
    # More passes asked than the most: they are all run.
    fake = measured(monkeypatch, pass_s=0.001, warm_passes=runner.MAX_WARM_PASSES + 2)
    assert len(fake.epochs[1:-1]) == runner.MAX_WARM_PASSES + 2
