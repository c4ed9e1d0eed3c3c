"""The UID of each served namespace, for the webhook: it keys the node disk directory.

The AdmissionReview of a pod names its namespace only, and the node disk tier is keyed
by the namespace's UID (`namespace_dirs`), so that a namespace deleted and created again
with the same name never gets the earlier tenant's cached entries. The webhook asks
`Store.uid` for each pod it injects:

- from memory, when the operator's own namespace watch (`Watcher`, like `mount_watch`:
  outside kopf, on every replica) has listed and shows the namespace. A namespace is
  dropped from memory at its first event with a deletionTimestamp (Terminating: the API
  server then refuses pods in it), long before a namespace of the same name can exist
  again, and at its DELETED event;
- otherwise (a namespace newer than the watch's last event, or the watch down) by one
  GET of the namespace, bounded by `READ_TIMEOUT_SECONDS`; concurrent admissions of one
  namespace share it. Its answer is not kept: only the watch's view, which sees
  deletions, is served from memory, so a UID is never served after its namespace is gone.

When the UID cannot be read the pod is refused (`Unavailable`, with the reason), as when
its DatasetMount cannot be read: its controller retries, and no pod starts with a
directory keyed by anything but its namespace's UID.

Permissions: get, list and watch on namespaces: cluster-wide, or with a namespaced
release only those it serves (resourceNames; the watch then asks for each by a
`metadata.name` field selector, which RBAC requires for list and watch by name).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

import aiohttp
import kopf

from shardcache_operator import informer, namespace_dirs

logger = logging.getLogger(__name__)

#: Seconds an admission waits for the GET of its namespace: well inside the webhook's
#: own timeout (the chart's webhook.timeoutSeconds, 10 by default).
READ_TIMEOUT_SECONDS = 5.0
#: The server ends a watch after this long; it is then resumed from its last version.
WATCH_TIMEOUT_SECONDS = 300
#: How much longer than that a connection may stay silent before it is taken for dead.
READ_GRACE_SECONDS = 30
#: Pause before reconnecting after an error (a restarting API server, a network blip).
RETRY_SECONDS = 1.0

#: The GET of one namespace's UID: None when it does not exist; raises when the API
#: cannot say (`kube.Api.read_namespace_uid`).
Reader = Callable[[str], Awaitable[str | None]]


class Unavailable(Exception):
    """The namespace's UID could not be read; the message says why and what to do."""


def _live_uid(obj: Mapping[str, Any]) -> tuple[str, str | None] | None:
    """(name, UID) of a namespace object, UID None when it is being deleted; None when
    the object names no namespace."""
    metadata = obj.get("metadata") or {}
    name = metadata.get("name")
    if not isinstance(name, str) or not name:
        return None
    uid = metadata.get("uid")
    if metadata.get("deletionTimestamp") or not isinstance(uid, str) or not uid:
        return name, None
    return name, uid


@dataclasses.dataclass
class Store:
    """Namespace name -> UID, as the watch shows it, and the GET when it does not."""

    read_timeout_seconds: float = READ_TIMEOUT_SECONDS
    _uids: dict[str, str] = dataclasses.field(default_factory=dict)
    #: Whether `_uids` is the watch's view (listed, no error since).
    _synced: bool = False
    #: GETs under way, by namespace, shared by the admissions that wait for them.
    _reads: dict[str, asyncio.Future[str | None]] = dataclasses.field(default_factory=dict)

    def listed(self, objs: Iterable[Mapping[str, Any]]) -> None:
        """The watch's LIST: the whole view, replaced."""
        self._uids = {}
        for obj in objs:
            self.seen("ADDED", obj)
        self._synced = True

    def seen(self, kind: str, obj: Mapping[str, Any]) -> None:
        """One watch event."""
        found = _live_uid(obj)
        if found is None:
            return
        name, uid = found
        if kind == "DELETED" or uid is None:
            self._uids.pop(name, None)
        else:
            self._uids[name] = uid

    def lost(self) -> None:
        """The watch stopped: its view may miss a deletion, so none of it is served."""
        self._synced = False
        self._uids = {}

    def cached(self, namespace: str) -> str | None:
        """The UID the watch shows for `namespace`, None when it shows none."""
        return self._uids.get(namespace) if self._synced else None

    async def uid(self, namespace: str, read: Reader) -> str:
        """The UID of `namespace` (module docstring); `Unavailable` saying why not."""
        known = self.cached(namespace)
        if known is None:
            known = await self._read(namespace, read)
        try:
            return namespace_dirs.check_uid(known, namespace=namespace)
        except ValueError as exc:
            raise Unavailable(str(exc)) from exc

    async def _read(self, namespace: str, read: Reader) -> str:
        future = self._reads.get(namespace)
        if future is None:
            future = asyncio.ensure_future(read(namespace))
            self._reads[namespace] = future

            def done(finished: asyncio.Future[str | None]) -> None:
                self._reads.pop(namespace, None)
                # Every waiter may have timed out: the error is theirs, not the loop's
                # "exception was never retrieved".
                if not finished.cancelled():
                    finished.exception()

            future.add_done_callback(done)
        try:
            # Shielded: one admission timing out leaves the GET to the others waiting.
            found = await asyncio.wait_for(asyncio.shield(future), self.read_timeout_seconds)
        except TimeoutError as exc:
            raise Unavailable(
                f"reading namespace {namespace} took over {self.read_timeout_seconds:g} s"
            ) from exc
        except Exception as exc:  # any API failure: this pod is refused, saying it
            raise Unavailable(
                f"reading namespace {namespace} failed ({type(exc).__name__}: {exc})"
            ) from exc
        if found is None:
            raise Unavailable(f"namespace {namespace} does not exist")
        return found


def selections(namespaces: tuple[str, ...]) -> dict[str, dict[str, str]]:
    """The namespace collections to watch, by key: every namespace (key ""), or each
    served one by name (RBAC's resourceNames allows list and watch only so)."""
    if not namespaces:
        return {"": {}}
    return {ns: {"fieldSelector": f"metadata.name={ns}"} for ns in namespaces}


class Watcher:
    """The informer of namespaces into a `Store`; `run` is its only task."""

    PATH = "/api/v1/namespaces"

    def __init__(self, store: Store, *, namespaces: tuple[str, ...] = ()) -> None:
        self.store = store
        self._selections = selections(namespaces)
        self._failures = informer.Failures("namespace watch", logger)

    async def run(self, connect: Callable[[], kopf.ConnectionInfo]) -> None:
        """Until cancelled: list, watch, resume (`informer.run`); while the view may be
        stale the store serves none of it (`Store.lost`)."""
        await informer.run(
            connect,
            self._list,
            self._watch,
            self._failures,
            retry_seconds=RETRY_SECONDS,
            meanwhile="reading namespaces from the API, ",
            on_lost=self.store.lost,
        )

    async def _list(self, session: aiohttp.ClientSession, server: str) -> dict[str, str]:
        objs: list[Mapping[str, Any]] = []
        versions: dict[str, str] = {}
        for key, params in self._selections.items():
            items, versions[key] = await informer.list_all(session, server + self.PATH, params)
            objs.extend(items)
        self.store.listed(objs)
        return versions

    async def _watch(
        self,
        session: aiohttp.ClientSession,
        server: str,
        key: str,
        version: str,
        working: Callable[[], None],
    ) -> None:
        await informer.watch(
            session,
            server + self.PATH,
            self._selections[key],
            version,
            self.store.seen,
            timeout_seconds=WATCH_TIMEOUT_SECONDS,
            silent_seconds=WATCH_TIMEOUT_SECONDS + READ_GRACE_SECONDS,
            working=working,
        )
