"""`bench.node_probes.cpu_seconds`: a process's CPU to the nanosecond, exited threads too."""

from __future__ import annotations

import os
import threading
import time

import pytest

from bench import node_probes

pytestmark = pytest.mark.unit


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_few_milliseconds_of_cpu_are_counted_finer_than_a_clock_tick() -> None:
    # 3 ms: under one 10 ms tick, which /proc/<pid>/stat would round to 0 or 10 ms.
    before = node_probes.cpu_seconds(os.getpid())
    loop_before = node_probes.cpu_seconds(os.getpid(), thread=threading.get_native_id())
    _spin(0.003)
    took = node_probes.cpu_seconds(os.getpid()) - before
    loop = node_probes.cpu_seconds(os.getpid(), thread=threading.get_native_id()) - loop_before
    assert 0.003 <= loop <= 0.006
    # The process's count has the thread's (other threads of the test run may add more).
    assert took >= loop - 0.0005


def test_the_cpu_of_a_thread_that_exited_is_still_counted() -> None:
    before = node_probes.cpu_seconds(os.getpid())
    thread = threading.Thread(target=_spin, args=(0.3,))
    thread.start()
    thread.join()
    assert node_probes.cpu_seconds(os.getpid()) - before >= 0.25


def test_the_count_never_goes_back_when_a_thread_exits_between_two_readings() -> None:
    # A sum over the live threads lost a thread's few milliseconds when it exited
    # between the readings (under a clock tick: not in the process's ticks either).
    spun, done = threading.Event(), threading.Event()

    def spin_then_wait() -> None:
        _spin(0.005)
        spun.set()
        done.wait()

    thread = threading.Thread(target=spin_then_wait)
    thread.start()
    spun.wait()
    before = node_probes.cpu_seconds(os.getpid())
    done.set()
    thread.join()
    assert node_probes.cpu_seconds(os.getpid()) >= before
