"""A watch that keeps failing (the CRD missing, the API refusing) logged a WARNING at
every retry, once a second: now one when it starts failing, then at most one every
`informer.FAILURE_LOG_SECONDS` with a count, and one INFO when it recovers."""

from __future__ import annotations

import logging

import pytest
from shardcache_operator import informer

pytestmark = pytest.mark.unit

LOGGER = "test.informer.failures"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def records(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOGGER]


def test_a_failing_watch_warns_once_then_every_interval_with_a_count_then_recovers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    clock = Clock()
    failures = informer.Failures("pod watch", logging.getLogger(LOGGER), 60.0, clock)
    for _ in range(60):  # a minute of retries, one a second
        failures.failed(RuntimeError("404 Not Found"), then="retrying in 1 s")
        clock.now += 1
    logged = records(caplog)
    assert len(logged) == 1
    level, message = logged[0]
    assert level == logging.WARNING
    assert message.startswith("pod watch: 404 Not Found; retrying in 1 s")
    failures.failed(RuntimeError("404 Not Found"), then="retrying in 1 s")  # 60 s on: due
    level, message = records(caplog)[1]
    assert level == logging.WARNING
    assert "61 failure(s) in 60 s, 60 since the last warning" in message
    clock.now += 5
    failures.recovered()
    failures.recovered()  # once only
    assert records(caplog)[2:] == [
        (logging.INFO, "pod watch: recovered after 61 failure(s) in 65 s")
    ]
    # A new failure is news again.
    failures.failed(RuntimeError("503"), then="retrying in 1 s")
    assert records(caplog)[3][0] == logging.WARNING
    assert records(caplog)[3][1].startswith("pod watch: 503;")


def test_a_watch_that_never_failed_logs_nothing_when_it_works(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    failures = informer.Failures("DatasetMount watch", logging.getLogger(LOGGER))
    failures.recovered()
    assert records(caplog) == []
