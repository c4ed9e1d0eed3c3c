"""A watch that keeps failing (the CRD missing, the API refusing) logged a WARNING at
every retry, once a second: now one when it starts failing, then at most one every
`informer.FAILURE_LOG_SECONDS` with a count, and one INFO when it recovers: once its
WATCH carries again after a LIST, not at every LIST that works (a watch whose LIST worked
and WATCH failed logged a WARNING and a false "recovered" at every retry)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import aiohttp
import kopf
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


class FlakyWatch:
    """LIST works, a second after the last (the retry); every WATCH after the first
    `failing` LISTs fails, then each path's watch calls `working` whenever its `deliver`
    is set, and otherwise hangs."""

    def __init__(self, clock: Clock, failing: int, paths: tuple[str, ...] = ("/a",)) -> None:
        self.clock, self.failing, self.paths = clock, failing, paths
        self.lists = 0
        self.deliver: dict[str, asyncio.Event] = {path: asyncio.Event() for path in paths}
        self.watching: set[str] = set()
        self.all_watching = asyncio.Event()

    async def list_view(self, session: aiohttp.ClientSession, server: str) -> dict[str, str]:
        self.lists += 1
        self.clock.now += 1
        return {path: "1" for path in self.paths}

    async def watch_path(
        self,
        session: aiohttp.ClientSession,
        server: str,
        path: str,
        version: str,
        working: Callable[[], None] = lambda: None,  # a `run` that passes none: never
    ) -> None:
        if self.lists <= self.failing:
            raise RuntimeError("403 Forbidden: cannot watch datasetmounts")
        self.watching.add(path)
        if self.watching == set(self.paths):
            self.all_watching.set()
        while True:
            await self.deliver[path].wait()
            self.deliver[path].clear()
            working()


@contextlib.asynccontextmanager
async def no_session(info: kopf.ConnectionInfo) -> AsyncIterator[aiohttp.ClientSession]:
    """The fakes make no request; a real session built a TLS context per retry (slow)."""
    yield cast(aiohttp.ClientSession, None)


async def start(
    api: FlakyWatch, failures: informer.Failures, monkeypatch: pytest.MonkeyPatch
) -> asyncio.Task[None]:
    monkeypatch.setattr(informer, "session", no_session)
    return asyncio.create_task(
        informer.run(
            lambda: kopf.ConnectionInfo(server="http://127.0.0.1:1"),
            api.list_view,
            api.watch_path,
            failures,
            retry_seconds=0.0,
        )
    )


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_watch_whose_list_works_but_watch_fails_is_not_logged_as_recovered_each_retry(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    clock = Clock()
    failures = informer.Failures("DatasetMount watch", logging.getLogger(LOGGER), 60.0, clock)
    api = FlakyWatch(clock, failing=61)  # a minute of retries, one a second
    task = await start(api, failures, monkeypatch)
    try:
        await api.all_watching.wait()  # the 62nd WATCH is accepted; nothing delivered yet
    finally:
        await stop(task)
    assert api.lists == 62
    logged = records(caplog)
    # One warning when it starts failing, one "still failing" a minute later (the 61st
    # failure), and no false "recovered" between them, nor for the WATCH accepted.
    assert [level for level, _ in logged] == [logging.WARNING, logging.WARNING]
    assert logged[0][1].startswith("DatasetMount watch: 403 Forbidden: cannot watch")
    assert "still failing" in logged[1][1]
    assert "61 failure(s) in 60 s" in logged[1][1]


async def test_a_watch_recovers_once_every_path_delivers_after_the_list(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    clock = Clock()
    failures = informer.Failures("pod watch", logging.getLogger(LOGGER), 60.0, clock)
    api = FlakyWatch(clock, failing=3, paths=("/ns/a", "/ns/b"))
    task = await start(api, failures, monkeypatch)
    try:
        await api.all_watching.wait()
        assert [level for level, _ in records(caplog)] == [logging.WARNING]
        api.deliver["/ns/a"].set()  # one namespace's watch carries, the other not yet
        for _ in range(10):
            await asyncio.sleep(0)
        assert [level for level, _ in records(caplog)] == [logging.WARNING]
        api.deliver["/ns/b"].set()
        for _ in range(10):
            await asyncio.sleep(0)
        api.deliver["/ns/a"].set()  # more events: said once
        for _ in range(10):
            await asyncio.sleep(0)
    finally:
        await stop(task)
    assert records(caplog)[1:] == [(logging.INFO, "pod watch: recovered after 3 failure(s) in 3 s")]


class Stream:
    """One WATCH response: `lines`, then a clean end."""

    def __init__(self, lines: list[bytes]) -> None:
        self.status = 200
        self.content = self._lines(lines)

    @staticmethod
    async def _lines(lines: list[bytes]) -> AsyncIterator[bytes]:
        for line in lines:
            yield line

    def raise_for_status(self) -> None:
        return None


class Responses:
    """A session whose GETs answer `streams` in turn, then fail (ending the watch)."""

    def __init__(self, *streams: Stream) -> None:
        self.streams = list(streams)

    @contextlib.asynccontextmanager
    async def get(self, url: str, **kwargs: Any) -> AsyncIterator[Stream]:
        if not self.streams:
            raise RuntimeError("connection refused")
        yield self.streams.pop(0)


async def test_a_watch_says_it_works_at_each_event_or_bookmark_and_clean_end_not_on_error() -> None:
    calls: list[str] = []
    applied: list[str] = []
    bookmark = b'{"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "5"}}}\n'
    added = b'{"type": "ADDED", "object": {"metadata": {"name": "a", "resourceVersion": "6"}}}\n'
    error = b'{"type": "ERROR", "object": {"code": 500, "message": "etcd timeout"}}\n'
    session = Responses(Stream([bookmark, b"\n", added]), Stream([error]))
    with pytest.raises(RuntimeError, match="etcd timeout"):
        await informer.watch(
            cast(aiohttp.ClientSession, session),
            "http://api/x",
            {},
            "1",
            lambda kind, obj: applied.append(kind),
            timeout_seconds=60,
            silent_seconds=90,
            working=lambda: calls.append("working"),
        )
    assert applied == ["ADDED"]
    # The bookmark, the event and the server's clean end; the ERROR stream: nothing.
    assert calls == ["working"] * 3


async def test_a_quiet_watch_reports_its_outage_up_to_the_list_that_worked_not_to_the_proof(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a quiet cluster the WATCH is shown to carry only at the server's timeout (5
    minutes for the pod watch): the outage was counted to then, so 3 s of failures read
    as 303 s. It ends at the LIST that worked; the lag is said."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    clock = Clock()
    failures = informer.Failures("pod watch", logging.getLogger(LOGGER), 60.0, clock)
    api = FlakyWatch(clock, failing=3)
    task = await start(api, failures, monkeypatch)
    try:
        await api.all_watching.wait()
        clock.now += 300  # nothing happens until the server ends the watch
        api.deliver["/a"].set()
        for _ in range(10):
            await asyncio.sleep(0)
    finally:
        await stop(task)
    assert records(caplog)[1:] == [
        (
            logging.INFO,
            "pod watch: recovered after 3 failure(s) in 3 s (listed then; its WATCH was "
            "shown to carry 300 s later: a quiet watch proves itself only by an event, a "
            "bookmark or the server ending it)",
        )
    ]
