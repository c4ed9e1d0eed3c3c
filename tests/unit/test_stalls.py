"""The data-stall signal: waiting inside the iterator against stepping between batches."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from shardcache import stalls

pytestmark = pytest.mark.unit


def test_fraction_is_waiting_over_all_the_loops_time() -> None:
    meter = stalls.StallMeter()
    meter.record(1.0, 3.0)
    meter.record(3.0, 1.0)
    assert meter.fraction == pytest.approx(0.5)
    assert (meter.wait_seconds, meter.step_seconds, meter.batches) == (4.0, 4.0, 2)


def test_recent_fraction_follows_a_recovery_and_the_total_remembers() -> None:
    meter = stalls.StallMeter(alpha=0.2)
    for _ in range(50):
        meter.record(0.9, 0.1)
    assert meter.recent_fraction > 0.85
    for _ in range(50):
        meter.record(0.0, 1.0)
    assert meter.recent_fraction < 0.01
    assert meter.fraction == pytest.approx(0.45)


def test_the_time_between_two_iterations_is_the_next_batchs_step_and_the_end_its_wait() -> None:
    meter = stalls.StallMeter()
    meter.handed(0.0, 0.1)  # the first batch: nothing stepped before it
    meter.ended(0.5, 0.6)  # stepped 0.4 after it, then 0.1 inside the ending next()
    meter.handed(1.0, 1.2)  # 0.4 more between the iterations, then a wait of 0.2
    assert meter.batches == 2
    assert meter.wait_seconds == pytest.approx(0.1 + 0.1 + 0.2)
    assert meter.step_seconds == pytest.approx(0.4 + 0.4)


def test_a_wait_that_ends_in_an_error_counts_with_the_next_batch_a_retrying_loop_gets() -> None:
    def failing() -> Iterator[int]:
        time.sleep(0.05)
        raise TimeoutError("the acquire's timeout")
        yield 0  # a generator

    meter = stalls.StallMeter()
    with pytest.raises(TimeoutError):
        next(meter.wrap(failing()))
    assert meter.batches == 0
    next(meter.wrap(iter([1])))  # the loop carries on with a new iteration
    assert meter.batches == 1 and meter.wait_seconds >= 0.05


def test_a_loop_of_short_epochs_whose_data_is_ready_measures_mostly_stepping() -> None:
    # Two batches an epoch: timed per iterator, every epoch's first batch counted as a
    # share of 1 (no step before it) and the recent fraction stayed near one half.
    meter = stalls.StallMeter()
    for _ in range(40):
        for _ in meter.wrap(range(2)):
            time.sleep(0.01)
    assert meter.recent_fraction < 0.2 and meter.fraction < 0.2


def slow_source(n: int, delay: float) -> Iterator[int]:
    for i in range(n):
        time.sleep(delay)
        yield i


def test_a_loop_starved_by_its_iterator_measures_mostly_waiting() -> None:
    meter = stalls.StallMeter()
    assert list(meter.wrap(slow_source(5, 0.04))) == [0, 1, 2, 3, 4]
    assert meter.batches == 5 and meter.fraction > 0.8


def test_a_loop_whose_data_is_ready_measures_mostly_stepping() -> None:
    meter = stalls.StallMeter()
    for _ in meter.wrap(range(5)):
        time.sleep(0.04)
    # The last step (after the last batch) is not counted: 4 steps, 5 waits.
    assert meter.step_seconds >= 4 * 0.04 and meter.fraction < 0.2
    assert set(meter.snapshot()) == {
        "wait_seconds",
        "step_seconds",
        "batches",
        "stall_fraction",
        "recent_stall_fraction",
    }
