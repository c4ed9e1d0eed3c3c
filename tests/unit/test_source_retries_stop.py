"""A retry loop given a stop event ends as soon as it is set, not at its budget's end."""

from __future__ import annotations

import errno
import threading
import time

import pytest

from shardcache import errors, source

pytestmark = pytest.mark.unit


def refused() -> None:
    raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")


def test_setting_the_stop_event_ends_the_retries_at_once() -> None:
    stop = threading.Event()
    policy = source.RetryPolicy(budget_seconds=60.0, initial_delay=5.0, max_delay=5.0, stop=stop)
    threading.Timer(0.3, stop.set).start()
    started = time.monotonic()
    with pytest.raises(errors.SourceError, match="listing s3://b/run: stopped after 1 attempts"):
        source.with_retries(refused, what="listing s3://b/run", policy=policy)
    assert time.monotonic() - started < 3.0


def test_a_stop_event_that_is_never_set_leaves_the_budget_alone() -> None:
    policy = source.RetryPolicy(attempts=3, initial_delay=0.01, stop=threading.Event())
    with pytest.raises(errors.SourceError, match="failed after 3 attempts"):
        source.with_retries(refused, what="listing", policy=policy)
    # The event is not part of what the policy is: equal policies stay equal.
    assert policy == source.RetryPolicy(attempts=3, initial_delay=0.01)
