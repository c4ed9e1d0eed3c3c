"""The operator's namespace watch (`namespace_uids.Watcher`) against a fake API server:
the UIDs the webhook keys node disk directories by follow deletions and re-creations,
and nothing is served from a view that may be stale."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import kopf
import pytest
from aiohttp import web
from shardcache_operator import namespace_uids

pytestmark = pytest.mark.integration

FIRST = "0b6c1f2e-3d4a-4b5c-8d6e-7f8091a2b3c4"
AGAIN = "9e8d7c6b-5a49-4382-b716-0a1b2c3d4e5f"


def namespace(name: str, uid: str, version: str = "1", **metadata: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "uid": uid, "resourceVersion": version, **metadata}}


class FakeApi:
    """Lists `items`; each watch streams the next script of events, then ends. Records
    each request's field selector."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.scripts: asyncio.Queue[list[dict[str, Any]]] = asyncio.Queue()
        self.lists = 0
        self.fail_lists = 0
        self.selectors: list[str | None] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.selectors.append(request.query.get("fieldSelector"))
        if request.query.get("watch") != "1":
            if self.fail_lists:
                self.fail_lists -= 1
                return web.Response(status=503)
            self.lists += 1
            return web.json_response({"metadata": {"resourceVersion": "1"}, "items": self.items})
        events = await self.scripts.get()
        response = web.StreamResponse()
        await response.prepare(request)
        for event in events:
            await response.write(json.dumps(event).encode() + b"\n")
        await response.write_eof()
        return response


@pytest.fixture
async def api() -> AsyncIterator[tuple[FakeApi, Callable[[], kopf.ConnectionInfo]]]:
    fake = FakeApi()
    app = web.Application()
    app.router.add_get(namespace_uids.Watcher.PATH, fake.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    info = kopf.ConnectionInfo(server=f"http://127.0.0.1:{port}")
    try:
        yield fake, lambda: info
    finally:
        for _ in range(4):  # ends the watches still waiting for their scripts
            await fake.scripts.put([])
        await runner.cleanup()


async def until(check: Callable[[], bool]) -> None:
    for _ in range(200):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in 2 s")


async def test_a_namespace_deleted_and_created_again_reaches_the_store_with_its_new_uid(
    api: tuple[FakeApi, Callable[[], kopf.ConnectionInfo]], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake, connect = api
    monkeypatch.setattr(namespace_uids, "RETRY_SECONDS", 0.01)
    store = namespace_uids.Store()
    fake.items = [namespace("ml", FIRST)]
    task = asyncio.create_task(namespace_uids.Watcher(store).run(connect))
    try:
        await until(lambda: store.cached("ml") == FIRST)
        await fake.scripts.put(
            [
                {
                    "type": "MODIFIED",
                    "object": namespace("ml", FIRST, "2", deletionTimestamp="2026-11-28T15:00:00Z"),
                },
                {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "3"}}},
            ]
        )
        await until(lambda: store.cached("ml") is None)
        await fake.scripts.put(
            [
                {"type": "DELETED", "object": namespace("ml", FIRST, "4")},
                {"type": "ADDED", "object": namespace("ml", AGAIN, "5")},
            ]
        )
        await until(lambda: store.cached("ml") == AGAIN)
        # The watch breaks and the list fails: nothing is served from the old view.
        fake.fail_lists = 1000
        await fake.scripts.put([{"type": "ERROR", "object": {"code": 500, "message": "boom"}}])
        await until(lambda: store.cached("ml") is None)
        fake.items = [namespace("ml", AGAIN, "9")]
        fake.fail_lists = 0
        await until(lambda: store.cached("ml") == AGAIN)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert store.cached("ml") is None
    assert set(fake.selectors) == {None}, "a cluster-wide release watches every namespace"


async def test_a_namespaced_release_lists_and_watches_each_served_namespace_by_name(
    api: tuple[FakeApi, Callable[[], kopf.ConnectionInfo]],
) -> None:
    """RBAC's resourceNames (the chart's, for a namespaced release) allows list and
    watch only with a metadata.name field selector."""
    fake, connect = api
    store = namespace_uids.Store()
    fake.items = [namespace("ml", FIRST)]
    task = asyncio.create_task(namespace_uids.Watcher(store, namespaces=("ml", "nlp")).run(connect))
    try:
        await until(lambda: store.cached("ml") == FIRST and len(fake.selectors) >= 4)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert set(fake.selectors) == {"metadata.name=ml", "metadata.name=nlp"}
