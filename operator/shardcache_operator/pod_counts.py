"""status.attachedPods, written when pods come and go rather than on a timer per mount.

A timer per DatasetMount polled kopf's pod index every 30 s: with 500 mounts it wrote
~1,600 status patches an hour, drew HTTP 429s from API priority and fairness, kept a
tenth of a core busy at idle, and (being synchronous) once held a deletion for a
minute (issue 18). Instead, every pod event that changes a mount's set of pods
(`pod_watch`) and every DatasetMount event (`mount_watch`) `touch`es one `Writer`; its
single task wakes, waits `interval` seconds so a burst of pods becomes one write per
mount, compares the index's count with the status the watch last showed, and patches
only the mounts whose count changed. With nothing changing it sleeps on an event: no
wake-ups.

The mounts written are those of the operator's own DatasetMount watch (`mounts.Store`,
fed by `mount_watch`), not kopf's index: kopf neither lists nor watches while peering
pauses a replica, so its index kept deleted mounts (a 404 every interval) and missed new
ones (never counted) after a pause. While that watch reconnects (`Store.synced` false)
nothing is written: its view may be stale; its next LIST wakes the writer again.
Every replica writes (docs/operator.md, "High availability"): all of them count from
their own live watches, so they write the same values, and a mount whose watched status
already shows the count is not written.

While the installed CRD is older than the operator's (`crd_version`) it writes nothing:
the API server prunes the whole stored object to the older schema on any status write,
so a patch of attachedPods alone would drop the fields the older schema lacks (the pin's
manifestVersion) just as a full status write would. It looks at the gate again every
`recheck` seconds and writes every count that changed meanwhile once the CRD is current.

Each flush also sets the per-mount gauges (`attached_pods`, `pods_on_older_pin`) of the
mounts the watch shows, and removes those it set earlier for mounts the watch no longer
shows. The delete handler removes a released mount's series too (`Metrics.set_phase`),
but only on the active replica, and the mount stays in the watch until its DELETED
event: a flush in between set its series again, and with nothing else removing them a
deleted mount's last counts were exported for as long as the operator ran. The flush
also sets each watched mount's phase gauges (`Metrics.follow_phases`) from its
`status.phase`, and forgets those of mounts gone, for the same reasons.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from shardcache_operator import metrics, mounts, status

logger = logging.getLogger(__name__)

#: (namespace, DatasetMount name) -> the unfinished pods using it (`pod_watch.Index`).
PodIndex = Mapping[tuple[str, str], Iterable[Any]]
#: Writes status.attachedPods of one DatasetMount: (namespace, name, count).
StatusWriter = Callable[[str, str, int], Awaitable[None]]
#: Why status may not be written now (`crd_version.Gate.problem`), or None.
Hold = Callable[[], Awaitable[str | None]]


def count(index: PodIndex, namespace: str, name: str) -> int:
    return len(list(index.get((namespace, name), [])))


#: (namespace, name) -> the DatasetMount as the operator's watch shows it (`Store.watched`).
Watched = Mapping[mounts.Key, Mapping[str, Any]]


def stale(
    index: PodIndex, known: Watched, written: Mapping[mounts.Key, int]
) -> dict[mounts.Key, int]:
    """Mounts whose status.attachedPods differs from the index, with the right count.

    A count already written but not yet seen back through the watch is not stale:
    writing it again would only add a request.
    """
    result: dict[mounts.Key, int] = {}
    for key, obj in list(known.items()):
        now = count(index, *key)
        shown = (obj.get("status") or {}).get("attachedPods")
        if now != shown and written.get(key) != now:
            result[key] = now
    return result


def gone(gauged: Iterable[mounts.Key], known: Watched) -> list[mounts.Key]:
    """The mounts whose gauges were set that the watch no longer shows."""
    return sorted(key for key in gauged if key not in known)


def phase_of(obj: Mapping[str, Any]) -> status.Phase | None:
    """The phase a watched DatasetMount's status shows; None before its first reconcile
    wrote one (or a value this operator does not know)."""
    value = (obj.get("status") or {}).get("phase")
    try:
        return status.Phase(value) if isinstance(value, str) else None
    except ValueError:
        return None


class Writer:
    """One per operator (in its `context.Context`); `run` is its only task."""

    def __init__(self) -> None:
        self._changed = asyncio.Event()
        self._pods: PodIndex = {}
        self._mounts: mounts.Store = mounts.Store()
        #: Counts written whose watch event has not come back yet.
        self._written: dict[mounts.Key, int] = {}
        #: Why the last flush wrote nothing (the CRD is older), or None.
        self.held: str | None = None
        #: Mounts whose per-mount gauges the last flush set: removed once not watched.
        self._gauged: set[mounts.Key] = set()

    def touch(self, pods: PodIndex | None = None, known: mounts.Store | None = None) -> None:
        """A pod or a mount changed. The arguments are live views (kept, they stay
        current): the pod watch's index, the operator's DatasetMount watch's store."""
        if pods is not None:
            self._pods = pods
        if known is not None:
            self._mounts = known
        self._changed.set()

    async def flush(
        self, write: StatusWriter, meters: metrics.Metrics, *, hold: Hold | None = None
    ) -> int:
        """Write every stale count once; returns how many writes were made. None while
        `hold` gives a reason (the gauges still follow the pods: they prune nothing)."""
        # Read at each flush: a LIST replaces `watched` whole.
        known: Watched = self._mounts.watched
        for key, value in list(self._written.items()):
            obj = known.get(key)
            # Gone, or the watch shows what was written: the status speaks for itself.
            if obj is None or (obj.get("status") or {}).get("attachedPods") == value:
                del self._written[key]
        self._gauge(known, meters)
        held = None if hold is None else await hold()
        if held is not None and self.held is None:
            logger.warning("not writing status.attachedPods: %s", held)
        elif held is None and self.held is not None:
            logger.info("writing status.attachedPods again")
        self.held = held
        if held is not None:
            return 0
        if not self._mounts.synced:
            # Reconnecting: a mount deleted or created meanwhile is not known yet. The
            # watch's next LIST touches this writer again.
            return 0
        writes = 0
        for (namespace, name), now in stale(self._pods, known, self._written).items():
            try:
                await write(namespace, name, now)
            except Exception as exc:  # a 404 (deleted meanwhile) or a 429: retry later
                logger.info("writing attachedPods=%d of %s/%s: %s", now, namespace, name, exc)
                self._changed.set()
                continue
            self._written[(namespace, name)] = now
            meters.pod_count_writes_total.inc()
            writes += 1
        return writes

    def _gauge(self, known: Watched, meters: metrics.Metrics) -> None:
        """Set the per-mount gauges of the `known` mounts; remove those of mounts gone."""
        left = gone(self._gauged, known)
        meters.follow_phases({key: phase_of(obj) for key, obj in known.items()}, left)
        self._gauged = set(known)
        # The pod watch's `Index` knows each pod's digest; a plain mapping (tests) not.
        older = getattr(self._pods, "older", None)
        for (namespace, name), obj in list(known.items()):
            meters.attached_pods.labels(namespace=namespace, datasetmount=name).set(
                count(self._pods, namespace, name)
            )
            if older is not None:
                pinned = obj.get("status") or {}
                digest = pinned.get("manifestDigest")
                meters.pods_on_older_pin.labels(namespace=namespace, datasetmount=name).set(
                    older(
                        namespace,
                        name,
                        digest if isinstance(digest, str) else None,
                        status.resolved_at(pinned),
                    )
                )

    async def run(
        self,
        write: StatusWriter,
        meters: metrics.Metrics,
        *,
        interval: float,
        hold: Hold | None = None,
        recheck: float = 30.0,
    ) -> None:
        """Until cancelled: on each change, wait `interval` s (coalescing), then flush.
        While held, flush again every `recheck` s even without a change: the counts
        pending are written as soon as the hold ends."""
        while True:
            if self.held is None:
                await self._changed.wait()
            else:
                # No pod event is due when the CRDs are applied: look again by itself.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), recheck)
            await asyncio.sleep(interval)
            self._changed.clear()
            await self.flush(write, meters, hold=hold)
