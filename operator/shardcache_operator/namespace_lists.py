"""One pod LIST per namespace per round, shared by the round's mounts.

The check-sidecars timer runs per DatasetMount, and every mount of a namespace asks
the same question of the API server: the namespace's unfinished opted-in pods (the
sidecars of each mount are told apart by their env, not by the selector). One LIST per
mount every 30 s made a namespace with 50 mounts cost 50 LISTs of the same pods; the
first mount's check now lists and reduces the answer (`sidecar_health.assess`), and the
namespace's other mounts reuse it until it is `max_age_seconds` old. Checks that ask
while a LIST is under way wait for it rather than starting another. A failed LIST is
not kept: the next check lists again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


def _retrieve(future: asyncio.Future[Any]) -> None:
    # Every waiter may have been cancelled: the error is theirs to see, not the loop's
    # "exception was never retrieved" at shutdown.
    if not future.cancelled():
        future.exception()


@dataclasses.dataclass
class Shared(Generic[T]):
    """Per namespace, the last answer of `fetch`, reused while younger than
    `max_age_seconds` (monotonic)."""

    max_age_seconds: float
    clock: Callable[[], float] = time.monotonic
    _entries: dict[str, tuple[float, asyncio.Future[T]]] = dataclasses.field(default_factory=dict)

    async def get(self, namespace: str, fetch: Callable[[], Awaitable[T]]) -> T:
        now = self.clock()
        # Namespaces whose mounts stopped asking are dropped, not kept for ever.
        for ns, (at, done) in list(self._entries.items()):
            if done.done() and not 0 <= now - at < self.max_age_seconds:
                del self._entries[ns]
        entry = self._entries.get(namespace)
        if entry is None:
            future: asyncio.Future[T] = asyncio.ensure_future(fetch())
            future.add_done_callback(_retrieve)
            entry = self._entries[namespace] = (now, future)
        future = entry[1]
        try:
            # Shielded: a waiter cancelled (its mount deleted) leaves the LIST to the others.
            return await asyncio.shield(future)
        except Exception:
            if self._entries.get(namespace) is entry:
                del self._entries[namespace]
            raise
