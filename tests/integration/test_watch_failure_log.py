"""The DatasetMount watch and the pod watch, against a fake API server that refuses
their LIST (the CRD not installed yet), log one WARNING while it fails, not one a
retry, and one INFO once a LIST succeeds again and its WATCH delivers (here a bookmark,
`informer.Failures`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import kopf
import pytest
from aiohttp import web
from shardcache_operator import metrics, mount_watch, mounts, pod_watch

pytestmark = pytest.mark.integration

MOUNTS = "/apis/shardcache.io/v1alpha1/namespaces/ml/datasetmounts"
PODS = "/api/v1/namespaces/ml/pods"
BOOKMARK = b'{"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "1"}}}\n'


class FakeApi:
    """Answers 404 to `failing` LISTs, then lists nothing; watches send a bookmark (as
    an API server does within a minute) and hang until closed."""

    def __init__(self) -> None:
        self.failing = True
        self.refused = 0
        self.closed = asyncio.Event()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.query.get("watch") == "1":
            response = web.StreamResponse()
            await response.prepare(request)
            await response.write(BOOKMARK)
            await self.closed.wait()
            return response
        if self.failing:
            self.refused += 1
            return web.Response(status=404, text="the server could not find the resource")
        return web.json_response({"metadata": {"resourceVersion": "1"}, "items": []})


@pytest.fixture
async def api() -> AsyncIterator[tuple[FakeApi, Callable[[], kopf.ConnectionInfo]]]:
    fake = FakeApi()
    app = web.Application()
    app.router.add_get(MOUNTS, fake.handle)
    app.router.add_get(PODS, fake.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    info = kopf.ConnectionInfo(server=f"http://127.0.0.1:{port}")
    try:
        yield fake, lambda: info
    finally:
        fake.closed.set()
        await runner.cleanup()


async def until(check: Callable[[], bool]) -> None:
    for _ in range(500):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in 5 s")


def lines(caplog: pytest.LogCaptureFixture, logger: str) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == logger]


async def test_the_mount_watch_warns_once_while_the_crd_is_missing_and_says_it_recovered(
    api: tuple[FakeApi, Callable[[], kopf.ConnectionInfo]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake, connect = api
    caplog.set_level(logging.INFO, logger=mount_watch.__name__)
    monkeypatch.setattr(mount_watch, "RETRY_SECONDS", 0.01)
    store = mounts.Store()
    task = asyncio.create_task(mount_watch.Watcher(store, namespaces=("ml",)).run(connect))
    try:
        await until(lambda: fake.refused >= 20)
        logged = lines(caplog, mount_watch.__name__)
        assert [level for level, _ in logged] == [logging.WARNING]
        assert "404" in logged[0][1] and "DatasetMount watch" in logged[0][1]
        fake.failing = False
        await until(lambda: store.synced)
        await until(lambda: len(lines(caplog, mount_watch.__name__)) == 2)
        level, message = lines(caplog, mount_watch.__name__)[1]
        assert level == logging.INFO
        assert message.startswith(f"DatasetMount watch: recovered after {fake.refused} failure(s)")
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_the_pod_watch_warns_once_while_the_api_refuses_and_says_it_recovered(
    api: tuple[FakeApi, Callable[[], kopf.ConnectionInfo]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake, connect = api
    caplog.set_level(logging.INFO, logger=pod_watch.__name__)
    monkeypatch.setattr(pod_watch, "RETRY_SECONDS", 0.01)
    watcher = pod_watch.Watcher(
        pod_watch.Index(), metrics.Metrics(), lambda: None, namespaces=("ml",)
    )
    task = asyncio.create_task(watcher.run(connect))
    try:
        await until(lambda: fake.refused >= 20)
        logged = lines(caplog, pod_watch.__name__)
        assert [level for level, _ in logged] == [logging.WARNING]
        assert logged[0][1].startswith("pod watch: ")
        fake.failing = False
        await until(lambda: watcher.synced.is_set())
        await until(lambda: len(lines(caplog, pod_watch.__name__)) == 2)
        level, message = lines(caplog, pod_watch.__name__)[1]
        assert level == logging.INFO
        assert message.startswith(f"pod watch: recovered after {fake.refused} failure(s)")
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
