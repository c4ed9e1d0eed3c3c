"""The operator's own watch of DatasetMounts, feeding the webhook's `mounts.Store`.

kopf already watches DatasetMounts, but only while this replica is the active one: peering
pauses kopf's listing and watching on a standby, so kopf's index stops at the moment a
replica is outranked and misses every deletion made during the pause, even after it
resumes. The webhook answers on every replica, so it needs mounts as they are now. This
watch runs outside kopf (like `pod_watch`) and ignores peering:

- LIST then WATCH the DatasetMounts of the served namespaces (cluster-wide or each named
  one); the LIST replaces the Store's view whole (`Store.listed`), so a mount deleted
  while the watch was down is gone too; each event updates it (`Store.seen`);
- resumes from the last resourceVersion (bookmarks keep it fresh) and lists again when
  the API server says it is too old (410 Gone);
- on any error the Store is told (`Store.lost`) and the webhook reads the API (a copy
  served for `mounts.READ_TTL_SECONDS` at most) until the next LIST succeeds; the
  first error is a WARNING, later ones one a minute with a count (`informer.Failures`),
  and an INFO once the watch works again: a LIST and then a WATCH that delivers an event
  or bookmark, or is ended by the server (`informer.run`), not at the LIST alone.

A watch connection that goes silent without an error is dropped after
`WATCH_TIMEOUT_SECONDS + READ_GRACE_SECONDS` without a byte, then listed again.
The same permissions as kopf's watch: list and watch datasetmounts.

`changed` is called after each LIST and each event: it wakes the pod-count writer
(`pod_counts`), which writes the counts of exactly the mounts this watch shows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
import kopf

from shardcache_operator import informer, mounts, specs

logger = logging.getLogger(__name__)

#: The server ends a watch after this long; it is then resumed from its last version.
WATCH_TIMEOUT_SECONDS = 60
#: How much longer than that a connection may stay silent before it is taken for dead.
READ_GRACE_SECONDS = 30
#: Pause before reconnecting after an error (a restarting API server, a network blip).
RETRY_SECONDS = 1.0


def paths(namespaces: tuple[str, ...]) -> list[str]:
    """The DatasetMount collections to watch: cluster-wide, or one per served namespace."""
    base = f"/apis/{specs.GROUP}/{specs.VERSION}"
    if not namespaces:
        return [f"{base}/{specs.PLURAL}"]
    return [f"{base}/namespaces/{ns}/{specs.PLURAL}" for ns in namespaces]


class Watcher:
    """The informer; `run` is its only task."""

    def __init__(
        self,
        store: mounts.Store,
        *,
        namespaces: tuple[str, ...] = (),
        changed: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self._namespaces = namespaces
        self._changed = changed
        self._failures = informer.Failures("DatasetMount watch", logger)

    async def run(self, connect: Callable[[], kopf.ConnectionInfo]) -> None:
        """Until cancelled: list, watch, resume (`informer.run`); `connect` gives fresh
        credentials. Whenever the view may be stale the store is told (`Store.lost`)."""
        await informer.run(
            connect,
            self._list,
            self._watch,
            self._failures,
            retry_seconds=RETRY_SECONDS,
            meanwhile="reading mounts from the API, ",
            on_lost=self.store.lost,
        )

    async def _list(self, session: aiohttp.ClientSession, server: str) -> dict[str, str]:
        objs: list[Mapping[str, Any]] = []
        versions: dict[str, str] = {}
        for path in paths(self._namespaces):
            items, versions[path] = await informer.list_all(session, server + path, {})
            objs.extend(items)
        self.store.listed(objs)
        self._notify()
        return versions

    def _seen(self, kind: str, obj: Mapping[str, Any]) -> None:
        self.store.seen(kind, obj)
        self._notify()

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed()

    async def _watch(
        self,
        session: aiohttp.ClientSession,
        server: str,
        path: str,
        version: str,
        working: Callable[[], None],
    ) -> None:
        await informer.watch(
            session,
            server + path,
            {},
            version,
            self._seen,
            timeout_seconds=WATCH_TIMEOUT_SECONDS,
            silent_seconds=WATCH_TIMEOUT_SECONDS + READ_GRACE_SECONDS,
            working=working,
        )
