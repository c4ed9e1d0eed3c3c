"""What the operator's own watches share (`pod_watch`, `mount_watch`): a session with
kopf's credentials, a paged LIST, a WATCH resumed from its last version, and the loop
that runs them (`run`).

Both run outside kopf: kopf's watches pause on a standby replica and its index never
drops what was deleted during a pause, while the webhook answers on every replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

import aiohttp
import kopf

#: Items per LIST page: bounded memory for the initial list of a large cluster.
LIST_LIMIT = 500
#: Seconds between two warnings of a watch that keeps failing. It retries every
#: second, so a missing CRD or a refusing API server logged a warning a second, for
#: as long as it lasted; each later warning counts the failures since the last.
FAILURE_LOG_SECONDS = 60.0


class Gone(Exception):
    """The API server no longer has the version a watch asked for (HTTP 410)."""


#: LISTs a watch's collections into its view: (session, server) -> path -> resourceVersion.
Lister = Callable[[aiohttp.ClientSession, str], Awaitable[Mapping[str, str]]]
#: WATCHes one collection into the view until it ends: (session, server, path, version,
#: working), calling `working()` whenever the stream proves it carries (`watch`).
PathWatcher = Callable[[aiohttp.ClientSession, str, str, str, Callable[[], None]], Awaitable[None]]


def _nothing() -> None:
    return None


def session(info: kopf.ConnectionInfo) -> aiohttp.ClientSession:
    """An HTTP session with the operator's credentials (those kopf logs in with)."""
    context = ssl.create_default_context(cafile=info.ca_path) if info.ca_path else None
    if context is None:
        context = ssl.create_default_context()
        if info.ca_data:
            data = info.ca_data
            context.load_verify_locations(cadata=data.decode() if isinstance(data, bytes) else data)
    if info.insecure:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if info.certificate_path and info.private_key_path:
        context.load_cert_chain(info.certificate_path, info.private_key_path)
    headers = {"Accept": "application/json"}
    auth = None
    if info.token:
        headers["Authorization"] = f"{info.scheme or 'Bearer'} {info.token}"
    elif info.username and info.password:
        auth = aiohttp.BasicAuth(info.username, info.password)
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(ssl=context), headers=headers, auth=auth
    )


async def list_all(
    session: aiohttp.ClientSession,
    url: str,
    params: Mapping[str, str],
    headers: Mapping[str, str] | None = None,
) -> tuple[list[dict[str, Any]], str]:
    """Every item of the collection at `url`, page by page, and the version to watch
    from. Gone on 410 (a continue token that expired)."""
    items: list[dict[str, Any]] = []
    token = ""
    while True:
        query = {**params, "limit": str(LIST_LIMIT)}
        if token:
            query["continue"] = token
        async with session.get(url, params=query, headers=headers) as response:
            if response.status == 410:
                raise Gone()
            response.raise_for_status()
            listing = await response.json()
        items.extend(listing.get("items") or [])
        metadata = listing.get("metadata") or {}
        token = metadata.get("continue") or ""
        if not token:
            return items, str(metadata.get("resourceVersion"))


async def watch(
    session: aiohttp.ClientSession,
    url: str,
    params: Mapping[str, str],
    version: str,
    apply: Callable[[str, dict[str, Any]], None],
    *,
    timeout_seconds: int,
    silent_seconds: float,
    headers: Mapping[str, str] | None = None,
    working: Callable[[], None] = _nothing,
) -> None:
    """Until an error: WATCH from `version`, calling `apply(kind, obj)` for each ADDED,
    MODIFIED and DELETED event, and again from the last version seen when the server
    ends the watch (after `timeout_seconds`). A connection silent for `silent_seconds`
    is an error; Gone when the version is too old (410).

    `working()` is called after each event other than ERROR (bookmarks included) and
    each time the server ends the watch cleanly: the stream demonstrably carries.
    An accepted request alone is not that: a proxy may cut the stream just after."""
    while True:
        query = {
            **params,
            "watch": "1",
            "resourceVersion": version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(timeout_seconds),
        }
        timeout = aiohttp.ClientTimeout(total=None, sock_read=silent_seconds)
        async with session.get(url, params=query, timeout=timeout, headers=headers) as response:
            if response.status == 410:
                raise Gone()
            response.raise_for_status()
            async for line in response.content:
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise Gone()
                    raise RuntimeError(f"watch error: {obj.get('message')}")
                version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    apply(str(kind), obj)
                working()
        working()


@dataclasses.dataclass
class Failures:
    """The log of a watch's failed attempts: a WARNING when it starts failing, then at
    most one every `interval_seconds` with the count since the last, and one INFO when
    the watch works again (`recovered`; `run` says when that is)."""

    #: The watch, as its log lines name it ("pod watch").
    what: str
    logger: logging.Logger
    interval_seconds: float = FAILURE_LOG_SECONDS
    clock: Callable[[], float] = time.monotonic
    #: When the current run of failures began; None while the watch works.
    _since: float | None = None
    _logged_at: float = 0.0
    _failures: int = 0
    _unlogged: int = 0

    def failed(self, exc: BaseException, *, then: str) -> None:
        """One attempt failed with `exc`; `then` says what the watch does meanwhile
        ("retrying in 1 s")."""
        now = self.clock()
        self._failures += 1
        if self._since is None:
            self._since = self._logged_at = now
            self._unlogged = 0
            self.logger.warning(
                "%s: %s; %s (while it fails, logged again at most every %.0f s)",
                self.what,
                exc,
                then,
                self.interval_seconds,
            )
            return
        self._unlogged += 1
        if now - self._logged_at < self.interval_seconds:
            return
        self.logger.warning(
            "%s: still failing: %s; %d failure(s) in %.0f s, %d since the last warning; %s",
            self.what,
            exc,
            self._failures,
            now - self._since,
            self._unlogged,
            then,
        )
        self._logged_at = now
        self._unlogged = 0

    def recovered(self, listed_at: float | None = None) -> None:
        """The watch works again: says so once if it had been failing. `listed_at`: the
        clock at the LIST of the attempt that works, where it is known only later that
        it works: the failures lasted until then, not until now."""
        if self._since is None:
            return
        now = self.clock()
        until = now if listed_at is None else min(now, max(listed_at, self._since))
        self.logger.info(
            "%s: recovered after %d failure(s) in %.0f s%s",
            self.what,
            self._failures,
            until - self._since,
            _proven_later(now - until),
        )
        self._since = None
        self._failures = self._unlogged = 0


def _proven_later(lag: float) -> str:
    """Why "recovered" is logged `lag` s after the LIST it counts from, when it is."""
    if lag < 1:
        return ""
    return (
        f" (listed then; its WATCH was shown to carry {lag:.0f} s later: a quiet watch "
        "proves itself only by an event, a bookmark or the server ending it)"
    )


def _all_working(
    paths: Iterable[str], then: Callable[[], None]
) -> Callable[[str], Callable[[], None]]:
    """Per path, the `working` callback of its watch: `then()` once every path's has been
    called (and at each call after that, as `Failures.recovered` expects)."""
    waiting = set(paths)

    def of(path: str) -> Callable[[], None]:
        def working() -> None:
            waiting.discard(path)
            if not waiting:
                then()

        return working

    return of


async def run(
    connect: Callable[[], kopf.ConnectionInfo],
    list_view: Lister,
    watch_path: PathWatcher,
    failures: Failures,
    *,
    retry_seconds: float,
    meanwhile: str = "",
    on_listed: Callable[[], None] = _nothing,
    on_lost: Callable[[], None] = _nothing,
) -> None:
    """Until cancelled: list, watch every path listed, resume; `connect` gives fresh
    credentials each attempt.

    An expired version (410) lists again at once; any other error is logged through
    `failures` (`meanwhile` says what the view's reader does until then, "reading the
    API, ") and retried after `retry_seconds`. `on_listed` is called after each LIST
    that succeeds; `on_lost` whenever the view may be stale: after an expired version,
    after an error, and when cancelled.

    The watch has recovered (`failures.recovered`) once, after a LIST, every path's
    WATCH has shown it carries (`watch`'s `working`: an event, a bookmark, or a clean
    end by the server). Not at the LIST: a LIST that works says nothing of the WATCH
    after it (a role granting list without watch, a proxy cutting long requests), and
    such a watch logged a WARNING and a false "recovered" INFO at every retry. On a
    quiet cluster that is up to the server's watch timeout after the LIST (5 minutes
    for the pod watch); a failure before then counts as the same run of failures. The
    failures' duration it logs ends at that LIST, where the view was whole again, and
    the lag is said: counted to the proof, a 3 s outage read as minutes.
    """
    try:
        while True:
            try:
                info = connect()
                async with session(info) as http:
                    versions = await list_view(http, info.server)
                    on_listed()
                    # Bound now: the view is whole from this LIST on.
                    listed = functools.partial(failures.recovered, failures.clock())
                    working = _all_working(versions, listed)
                    await asyncio.gather(
                        *(
                            watch_path(http, info.server, path, version, working(path))
                            for path, version in versions.items()
                        )
                    )
            except asyncio.CancelledError:
                raise
            except Gone:
                on_lost()
                failures.logger.info("%s: resourceVersion expired; listing again", failures.what)
            except Exception as exc:  # keep watching through API restarts and blips
                on_lost()
                failures.failed(exc, then=f"{meanwhile}retrying in {retry_seconds:.0f} s")
                await asyncio.sleep(retry_seconds)
    finally:
        on_lost()
