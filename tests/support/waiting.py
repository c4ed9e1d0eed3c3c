"""Waiting on an observable event instead of on the clock.

A test never sleeps and then checks: it polls for the thing it expects, with a generous
limit that only a hung or broken system reaches, and a failure says what it waited for
and what it last saw. No test asserts how long something took; timing is for benches.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# Far above anything a loaded 2-core CI machine needs; reached only when the awaited
# event will never come.
GENEROUS_S = 60.0


def wait_until(
    what: str,
    check: Callable[[], T | None],
    *,
    timeout: float = GENEROUS_S,
    interval: float = 0.02,
    describe: Callable[[], str] | None = None,
) -> T:
    """Poll `check()` until it returns something true (not None, False, 0 or empty),
    then return it.

    On time-out, fail naming `what` was awaited and, through `describe`, what was last
    seen, so a red run says why without rerunning it.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= deadline:
            seen = f"\nlast seen: {describe()}" if describe else ""
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}{seen}")
        time.sleep(interval)


def finishes(what: str, call: Callable[[], T], *, timeout: float = GENEROUS_S) -> T:
    """Run `call` in a thread and return its result, or fail if it is still running.

    For "fails at once instead of waiting" checks: the code under test is given a wait
    far longer than `timeout` (e.g. an hour), so finishing at all shows it did not wait;
    no elapsed time is compared.
    """
    outcome: list[T] = []
    raised: list[BaseException] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=run, name=f"finishes: {what}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise AssertionError(f"still running after {timeout:g} s: {what}")
    if raised:
        raise raised[0]
    return outcome[0]
