"""`shardcache.gather_ahead.gathered`: order, bounded read-ahead, errors, and its threads
stopped on close, on abandonment and never waited on in a forked child."""

from __future__ import annotations

import gc
import os
import random
import threading
import time
from collections.abc import Generator
from typing import cast

import pyarrow as pa
import pytest

from shardcache import errors, gather_ahead, selections
from shardcache.node import quotas


class FakeSelection:
    """A selection whose gather takes a random while: finishing out of order. All are of
    one window (`gatherer`)."""

    gatherer = object()

    def __init__(self, n: int, *, delay: float = 0.0, fail: bool = False) -> None:
        self.n = n
        self.delay = delay
        self.fail = fail

    def gather(self) -> pa.RecordBatch:
        time.sleep(self.delay)
        if self.fail:
            raise ValueError(f"gather {self.n} failed")
        return pa.record_batch({"n": [self.n]})


class Items:
    """A generator of (key, selection) that records how far it was pulled and whether
    it was closed."""

    def __init__(self, count: int, *, delays: list[float] | None = None, fail_at: int = -1):
        self.count = count
        self.delays = delays or [0.0] * count
        self.fail_at = fail_at
        self.pulled = 0
        self.closed = False

    def __call__(self) -> Generator[tuple[int, selections.Selection], None, None]:
        try:
            for n in range(self.count):
                self.pulled = n + 1
                fake = FakeSelection(n, delay=self.delays[n], fail=n == self.fail_at)
                yield n, cast(selections.Selection, fake)
        finally:
            self.closed = True


def gather_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(gather_ahead.THREAD_NAME)]


@pytest.mark.parametrize("threads", [0, 1, 2, 3, 8])
def test_batches_come_in_the_items_order_whatever_order_the_gathers_finish(threads: int) -> None:
    rng = random.Random(threads)
    items = Items(60, delays=[rng.uniform(0, 0.004) for _ in range(60)])
    got = [
        (k, b.column("n")[0].as_py()) for k, b in gather_ahead.gathered(items(), threads=threads)
    ]
    assert got == [(n, n) for n in range(60)]
    assert items.closed and not gather_threads()


def test_at_most_depth_items_are_pulled_ahead_of_the_consumer() -> None:
    items = Items(100)
    ahead = gather_ahead.gathered(items(), threads=3)
    depth = 3 * gather_ahead.AHEAD_PER_THREAD
    for handed in range(1, 20):
        next(ahead)
        # The one handed over, and `depth` more being gathered or waiting.
        assert items.pulled <= handed + depth
    ahead.close()


def test_inline_gather_pulls_nothing_ahead() -> None:
    items = Items(10)
    ahead = gather_ahead.gathered(items(), threads=1)
    next(ahead)
    next(ahead)
    assert items.pulled == 2 and not gather_threads()
    ahead.close()
    assert items.closed


def test_a_failed_gather_raises_in_the_consumer_after_the_batches_before_it() -> None:
    items = Items(20, fail_at=7)
    got: list[int] = []
    with pytest.raises(ValueError, match="gather 7 failed"):
        for key, _ in gather_ahead.gathered(items(), threads=4):
            got.append(key)
    assert got == list(range(7))
    assert items.closed and not gather_threads()


def test_closing_the_iterator_stops_its_threads_and_closes_the_items() -> None:
    items = Items(200, delays=[0.002] * 200)
    ahead = gather_ahead.gathered(items(), threads=4)
    next(ahead)
    assert gather_threads()
    ahead.close()
    assert not gather_threads() and items.closed


def test_an_abandoned_iterator_stops_its_threads() -> None:
    items = Items(200, delays=[0.002] * 200)
    ahead = gather_ahead.gathered(items(), threads=4)
    next(ahead)
    next(ahead)
    del ahead
    gc.collect()
    assert not gather_threads() and items.closed


# Python 3.12 warns of any fork with threads running: this test forks one on purpose.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_closes_an_open_iterator_without_waiting_on_the_parents_threads() -> None:
    # A gather that would block the child for good if it waited on the parent's pool.
    items = Items(50, delays=[0.05] * 50)
    ahead = gather_ahead.gathered(items(), threads=4)
    next(ahead)
    pid = os.fork()
    if pid == 0:  # the child: close what the parent left open, and say how it went
        code = 1
        try:
            ahead.close()
            code = 0 if items.closed and not gather_threads() else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.01)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung closing the parent's iterator")
    ahead.close()
    assert os.waitstatus_to_exitcode(status) == 0
    assert not gather_threads()


@pytest.mark.parametrize("bad", [-1, "2", 1.5, True, None])
def test_a_bad_thread_count_is_refused_naming_what_was_expected(bad: object) -> None:
    with pytest.raises(errors.InputError, match=r"gather_threads: expected a thread count"):
        gather_ahead.check_threads(bad)


def test_the_default_pool_is_the_quotas_cpus_but_the_callers_capped() -> None:
    assert gather_ahead.default_threads(quotas.Quota(16, 3.5, None)) == 3
    assert gather_ahead.default_threads(quotas.Quota(5, None, None)) == 4
    assert gather_ahead.default_threads(quotas.Quota(64, None, None)) == (
        gather_ahead.MAX_DEFAULT_THREADS
    )
    # Two CPUs: two threads (two copies at once); one CPU: the inline gather.
    assert gather_ahead.default_threads(quotas.Quota(2, None, None)) == 2
    assert gather_ahead.default_threads(quotas.Quota(3, None, None)) == 2
    assert gather_ahead.default_threads(quotas.Quota(4, 1.5, None)) == 2
    assert gather_ahead.default_threads(quotas.Quota(1, None, None)) == 1
    assert gather_ahead.default_threads(quotas.Quota(4, 0.5, None)) == 1
    # Loader processes share the CPUs: 16 among 4 leaves each 3 beside its caller.
    assert gather_ahead.default_threads(quotas.Quota(16, None, None), sharers=4) == 3
    assert gather_ahead.default_threads(quotas.Quota(16, None, None), sharers=8) == 2
    assert gather_ahead.default_threads(quotas.Quota(16, None, None), sharers=16) == 1


def test_a_plan_that_waits_is_asked_again_after_the_queued_batches_are_taken() -> None:
    """Items that say "not yet" (no selection) while chunks are queued, as a plan that
    leases no window past the caller's and the next does: nothing is lost, repeated or
    reordered, and a wait never comes with nothing queued."""
    backlog = gather_ahead.Backlog()
    waits: list[int] = []

    def items() -> Generator[tuple[int, selections.Selection | None], None, None]:
        for n in range(40):
            # Every fifth item waits once for each chunk queued when it is pulled.
            while n % 5 == 0 and backlog.chunks:
                waits.append(backlog.chunks)
                yield n, None
            yield n, cast(selections.Selection, FakeSelection(n))

    got = [
        (k, b.column("n")[0].as_py())
        for k, b in gather_ahead.gathered(items(), threads=2, backlog=backlog)
    ]
    assert got == [(n, n) for n in range(40)]
    assert waits and all(w > 0 for w in waits)
    assert not gather_threads()
