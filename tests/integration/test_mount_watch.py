"""The operator's own DatasetMount watch against a fake API server: list, watch, relist."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import kopf
import pytest
from aiohttp import web
from shardcache_operator import mount_watch, mounts

pytestmark = pytest.mark.integration

PATH = "/apis/shardcache.io/v1alpha1/namespaces/ml/datasetmounts"


def dsm(name: str, uid: str, uri: str = "s3://bucket/a/", version: str = "1") -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "ml", "uid": uid, "resourceVersion": version},
        "spec": {"source": {"uri": uri}},
        "status": {"phase": "Ready"},
    }


class FakeApi:
    """Lists `items`; each watch streams the next script of events, then ends."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.scripts: asyncio.Queue[list[dict[str, Any]]] = asyncio.Queue()
        self.lists = 0
        self.fail_lists = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
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
    app.router.add_get(PATH, fake.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    info = kopf.ConnectionInfo(server=f"http://127.0.0.1:{port}")
    try:
        yield fake, lambda: info
    finally:
        await fake.scripts.put([])  # ends a watch still waiting for its script
        await runner.cleanup()


async def until(check: Callable[[], bool]) -> None:
    for _ in range(200):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in 2 s")


def uri_of(store: mounts.Store, name: str) -> str | None:
    found = store.lookup("ml", name, now=0)
    return None if found is None else str(found["spec"]["source"]["uri"])


async def test_edits_deletions_and_a_relist_reach_the_store(
    api: tuple[FakeApi, Callable[[], kopf.ConnectionInfo]], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake, connect = api
    monkeypatch.setattr(mount_watch, "RETRY_SECONDS", 0.01)
    store = mounts.Store()
    fake.items = [dsm("flip", "u-1"), dsm("doomed", "u-2")]
    watcher = mount_watch.Watcher(store, namespaces=("ml",))
    task = asyncio.create_task(watcher.run(connect))
    try:
        await until(lambda: store.synced)
        assert uri_of(store, "flip") == "s3://bucket/a/"
        # An edit, then a deletion, then the watch ends and is resumed.
        await fake.scripts.put(
            [
                {"type": "MODIFIED", "object": dsm("flip", "u-1", "s3://bucket/b/", "2")},
                {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "3"}}},
                {"type": "DELETED", "object": dsm("doomed", "u-2", version="4")},
            ]
        )
        await until(lambda: uri_of(store, "flip") == "s3://bucket/b/")
        await until(lambda: uri_of(store, "doomed") is None)
        # The version expired: list again; a mount deleted meanwhile is gone from the view.
        fake.items = [dsm("flip", "u-3", "s3://bucket/c/", "9")]
        await fake.scripts.put([{"type": "ERROR", "object": {"code": 410, "message": "gone"}}])
        await until(lambda: fake.lists == 2 and uri_of(store, "flip") == "s3://bucket/c/")
        # The watch breaks and the list fails: nothing is served from the old view.
        fake.fail_lists = 1000
        await fake.scripts.put([{"type": "ERROR", "object": {"code": 500, "message": "boom"}}])
        await until(lambda: not store.synced)
        assert uri_of(store, "flip") is None
        fake.fail_lists = 0
        await until(lambda: store.synced)
        assert uri_of(store, "flip") == "s3://bucket/c/"
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert not store.synced


def test_a_namespaced_operator_watches_each_served_namespace() -> None:
    assert mount_watch.paths(()) == ["/apis/shardcache.io/v1alpha1/datasetmounts"]
    assert mount_watch.paths(("ml", "nlp")) == [
        PATH,
        "/apis/shardcache.io/v1alpha1/namespaces/nlp/datasetmounts",
    ]


async def test_each_list_and_event_wakes_the_pod_count_writer(
    api: tuple[FakeApi, Callable[[], kopf.ConnectionInfo]],
) -> None:
    """The pod-count writer writes the mounts this watch shows: it must hear of each
    change (kopf's indexer, which woke it before, is paused on a standby replica)."""
    fake, connect = api
    store, seen = mounts.Store(), []
    fake.items = [dsm("a", "u-1")]
    watcher = mount_watch.Watcher(
        store, namespaces=("ml",), changed=lambda: seen.append(sorted(store.watched))
    )
    task = asyncio.create_task(watcher.run(connect))
    try:
        await until(lambda: seen == [[("ml", "a")]])
        await fake.scripts.put([{"type": "ADDED", "object": dsm("b", "u-2", version="2")}])
        await until(lambda: len(seen) == 2)
        assert seen[-1] == [("ml", "a"), ("ml", "b")]
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
