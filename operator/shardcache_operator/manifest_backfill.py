"""Pins kept without their handed manifests: found, resolved again, and handed.

`manifest_handoff` hands a manifest to the sidecars when a reconcile pins it. A pin kept
from the status is never resolved again, so it was never handed when it was made before
its namespace was listed in `rbac.manifestNamespaces` (the setting turned on later, or a
mount an older operator pinned), when writing failed then, or after its ConfigMaps were
deleted; each node's first sidecar of it then reads the whole dataset to hash it.

So when a reconcile or a source check leaves a mount of those namespaces Ready (at the
operator's start too: kopf resumes every mount), a task of the mount's (`follow`) looks
at each pin this process has not settled, or settled as handed over an hour ago
(`LOOK_AGAIN_SECONDS`: its ConfigMaps may have been deleted since): a GET of its part
0, and of the further parts it counts. A pin they do not hand is resolved again, one
read of the dataset in the operator instead of one per node, and handed when the
source still gives the pinned digest. A source that gives another is a Warning (those
sidecars could not start from it either), and is not read again by this process. A
failed resolve or write is tried again later, backing off to an hour, by the same task;
it ends when every pin is settled, or the mount is no longer Ready or gone.

One mount of a namespace at a time: it is never urgent, it must not burst the API
server with GETs when the operator starts, and its resolves take the namespace's and the
operator's slots as the reconciles do (`source_reads`, `resolve_slots`); per namespace,
so that a tenant whose store trickles its answers delays only its own. Only the replica
whose kopf handles the mounts starts these tasks (peering).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any, Protocol

from shardcache import errors, uris
from shardcache.node import handed_manifests
from shardcache_operator import manifest_handoff, reconcile, specs, status

logger = logging.getLogger(__name__)

#: The first wait, in seconds, after a failed resolve or write; doubled up to the cap.
RETRY_FIRST_SECONDS = 300.0
RETRY_MAX_SECONDS = 3600.0
#: Seconds after a pin was found handed (or handed) before it is looked at again, at the
#: mount's next reconcile or source check: ConfigMaps deleted meanwhile are handed again
#: without an operator restart, for one GET per part of each pin an hour.
LOOK_AGAIN_SECONDS = 3600.0
#: The reason of the Normal Event when a kept pin's manifest was handed.
HANDED = "ManifestHanded"

#: What a look at a pin found or did (`Means.count`; the operator's metric
#: shardcache_operator_manifest_looks_total): its ConfigMaps hand it already; handed
#: now; the source gives another digest; the operator may not get ConfigMaps there; a
#: read, resolve or write failed (tried again later).
PRESENT, WRITTEN, SOURCE_CHANGED, REFUSED, FAILED = (
    "present",
    "handed",
    "source_changed",
    "refused",
    "failed",
)

#: A pin, as the ledger keys it: (namespace, mount uid, source key, digest).
Pin = tuple[str, str, str, str]


class Api(manifest_handoff.Writer, Protocol):
    """The API calls a backfill makes (`kube.Api`)."""

    async def read_config_map(self, namespace: str, name: str) -> dict[str, Any] | None: ...

    async def read_datasetmount(self, namespace: str, name: str) -> dict[str, Any] | None: ...


#: (spec, source key) -> the source resolved again (`reconcile.resolve_again`, bound).
ResolveAgain = Callable[[specs.DatasetMountSpec, str], Awaitable[status.Outcome]]
#: (type, reason, message): an Event on the mount (bound to it).
Say = Callable[[str, str, str], Awaitable[None]]
#: Seconds to sleep (`asyncio.sleep`; tests pass their own).
Sleep = Callable[[float], Awaitable[None]]


@dataclasses.dataclass
class Ledger:
    """What this operator process knows of handed pins (`context.Context.backfills`)."""

    #: Pins that need nothing more from this process for now, with the monotonic time
    #: they are looked at again: handed (by a reconcile or here) or marked too large,
    #: `LOOK_AGAIN_SECONDS` on; never (`math.inf`) where the source gives another digest.
    settled: dict[Pin, float] = dataclasses.field(default_factory=dict)
    #: Pins to try again: (monotonic time not before, the wait that led there).
    later: dict[Pin, tuple[float, float]] = dataclasses.field(default_factory=dict)
    #: Namespaces where the operator may not get or write ConfigMaps (no Role), with
    #: the monotonic time they are tried again (`LOOK_AGAIN_SECONDS` on): said once a
    #: time, and a Role granted later is used without an operator restart.
    refused: dict[str, float] = dataclasses.field(default_factory=dict)
    #: One mount of a namespace looked at at a time, by namespace.
    turns: dict[str, asyncio.Lock] = dataclasses.field(default_factory=dict)
    #: Each mount's task (`follow`) while it runs, by (namespace, mount uid).
    tasks: dict[tuple[str, str], asyncio.Task[None]] = dataclasses.field(default_factory=dict)

    def settle(self, pin: Pin, now: float, *, for_good: bool = False) -> None:
        """`pin` needs nothing more: until `LOOK_AGAIN_SECONDS` from `now`, or for
        this process's life (`for_good`: a source that gives another digest, which
        only a new pin mends)."""
        self.settled[pin] = math.inf if for_good else now + LOOK_AGAIN_SECONDS
        self.later.pop(pin, None)

    def is_settled(self, pin: Pin, now: float) -> bool:
        return now < self.settled.get(pin, -math.inf)

    def due(self, pin: Pin, now: float) -> bool:
        if self.is_settled(pin, now):
            return False
        not_before, _ = self.later.get(pin, (0.0, 0.0))
        return now >= not_before

    def failed(self, pin: Pin, now: float) -> float:
        """Put `pin` off after a failure; the seconds it waits."""
        _, wait = self.later.get(pin, (0.0, 0.0))
        wait = min(RETRY_MAX_SECONDS, wait * 2 if wait else RETRY_FIRST_SECONDS)
        self.later[pin] = (now + wait, wait)
        return wait

    def forget(self, namespace: str, uid: str) -> None:
        """A deleted mount's pins, and its task."""
        task = self.tasks.pop((namespace, uid), None)
        if task is not None:
            task.cancel()
        self.settled = {p: v for p, v in self.settled.items() if p[:2] != (namespace, uid)}
        self.later = {p: v for p, v in self.later.items() if p[:2] != (namespace, uid)}

    def start(self, namespace: str, uid: str, run: Callable[[], Coroutine[Any, Any, None]]) -> bool:
        """Run `run()` as the mount's task unless one runs; whether it was started."""
        key = (namespace, uid)
        if key in self.tasks:
            return False
        task = asyncio.create_task(run(), name=f"hand-manifests {namespace}/{uid}")
        self.tasks[key] = task
        task.add_done_callback(lambda done: self._ended(key, done))
        return True

    def _ended(self, key: tuple[str, str], task: asyncio.Task[None]) -> None:
        if self.tasks.get(key) is task:
            del self.tasks[key]
        if not task.cancelled() and task.exception() is not None:
            logger.error("handing manifests of %s/%s", *key, exc_info=task.exception())

    def close(self) -> None:
        """Cancel every task (the operator stops)."""
        for task in self.tasks.values():
            task.cancel()
        self.tasks.clear()

    def is_refused(self, namespace: str, now: float) -> bool:
        return now < self.refused.get(namespace, -math.inf)

    def refuse(self, namespace: str, exc: PermissionError, now: float) -> str | None:
        """Leave `namespace` alone for `LOOK_AGAIN_SECONDS`: the operator may not get or
        write its ConfigMaps (`exc`). What to say, unless it was said already."""
        if self.is_refused(namespace, now):
            return None
        self.refused[namespace] = now + LOOK_AGAIN_SECONDS
        return (
            f"{exc}: the operator hands no manifests in namespace {namespace} (tried again "
            "in an hour), so each node's first sidecar of a pin there reads the dataset to "
            "hash it"
        )

    def waiting(self, pins: list[Pin], now: float) -> list[Pin]:
        """Those of `pins` not settled at `now`."""
        return [pin for pin in pins if not self.is_settled(pin, now)]


async def _found(api: Api, namespace: str, mount: str, source: str) -> list[dict[str, Any] | None]:
    """The ConfigMaps of `source`'s parts, read as far as part 0 counts them (where it
    does not, as an older operator wrote them: up to the first missing)."""
    first = await api.read_config_map(namespace, manifest_handoff.config_map_name(mount, source, 0))
    found: list[dict[str, Any] | None] = [first]
    if first is None:
        return found
    annotations = (first.get("metadata") or {}).get("annotations") or {}
    count = str(annotations.get(manifest_handoff.ANNOTATION_PARTS, handed_manifests.MAX_PARTS))
    for part in range(1, min(int(count) if count.isdigit() else 0, handed_manifests.MAX_PARTS)):
        name = manifest_handoff.config_map_name(mount, source, part)
        found.append(await api.read_config_map(namespace, name))
        if found[-1] is None:
            break
    return found


@dataclasses.dataclass(frozen=True)
class Means:
    """What a backfill works with: this process's ledger, the API, a resolve of a
    mount's source, Events on the mount, and the monotonic clock."""

    ledger: Ledger
    api: Api
    resolve_again: ResolveAgain
    say: Say
    #: Called with each look's result (`PRESENT`, ...).
    count: Callable[[str], None]
    now: Callable[[], float] = time.monotonic


def pins_of(body: Mapping[str, Any]) -> list[tuple[Pin, str]]:
    """(pin, URI) of each source pinned for what the mount `body` names now; none when
    its spec is invalid or a reconcile is under way."""
    metadata = body.get("metadata") or {}
    namespace, uid = str(metadata.get("namespace") or ""), str(metadata.get("uid") or "")
    try:
        spec = specs.parse_spec(body.get("spec"))
    except errors.InputError:
        return []
    return [
        ((namespace, uid, key, digest), uri)
        for key, uri, digest in reconcile.current_pins(spec, body.get("status") or {})
    ]


def wants_look(ledger: Ledger, body: Mapping[str, Any], now: float) -> bool:
    """Whether the mount `body` has a pin this process has not settled at `now`, and it
    may look: Ready, in a namespace whose ConfigMaps it may get."""
    metadata = body.get("metadata") or {}
    if ledger.is_refused(str(metadata.get("namespace") or ""), now):
        return False
    if (body.get("status") or {}).get("phase") != status.Phase.READY:
        return False
    return bool(ledger.waiting([pin for pin, _ in pins_of(body)], now))


async def follow(first: Mapping[str, Any], means: Means, *, sleep: Sleep = asyncio.sleep) -> None:
    """The mount's task: `backfill` the mount as `first` shows it (the status its
    reconcile writes), then as the API server has it, until every pin is settled or
    the mount is no longer Ready, or gone."""
    metadata = first.get("metadata") or {}
    namespace, name = str(metadata.get("namespace") or ""), str(metadata.get("name") or "")
    uid = str(metadata.get("uid") or "")
    ledger, now = means.ledger, means.now
    body: Mapping[str, Any] | None = first
    while body is not None and wants_look(ledger, body, now()):
        await backfill(body, means)
        waiting = ledger.waiting([pin for pin, _ in pins_of(body)], now())
        if not waiting or ledger.is_refused(namespace, now()):
            return
        # Not due yet, or failed now: wait for the first of them to be due.
        due = min(ledger.later.get(pin, (now(), 0.0))[0] for pin in waiting)
        await sleep(max(1.0, due - now()))
        try:
            body = await means.api.read_datasetmount(namespace, name)
        except Exception as exc:  # the API server: the next reconcile starts it again
            logger.info("%s/%s: reading the mount to hand its manifests: %s", namespace, name, exc)
            return
        if body is not None and str((body.get("metadata") or {}).get("uid") or "") != uid:
            return


async def backfill(body: Mapping[str, Any], means: Means) -> None:
    """Hand the pins of the Ready mount `body` that its ConfigMaps do not hand (the
    module's docstring). Never raises for the mount, the source or the API."""
    ledger, now = means.ledger, means.now
    namespace = str((body.get("metadata") or {}).get("namespace") or "")
    if ledger.is_refused(namespace, now()):
        return
    pins = pins_of(body)
    if not any(ledger.due(pin, now()) for pin, _ in pins):
        return
    spec = specs.parse_spec(body.get("spec"))  # valid: it has pins
    async with ledger.turns.setdefault(namespace, asyncio.Lock()):
        for pin, uri in pins:
            if ledger.due(pin, now()):
                await _backfill_one(pin, uri, spec, body, means)
            if ledger.is_refused(namespace, now()):
                return


async def _backfill_one(
    pin: Pin, uri: str, spec: specs.DatasetMountSpec, body: Mapping[str, Any], means: Means
) -> None:
    ledger, api, say, now = means.ledger, means.api, means.say, means.now
    namespace, uid, key, digest = pin
    name = str((body.get("metadata") or {}).get("name") or "")
    where = "spec.source" if key == manifest_handoff.PRIMARY else f"mixture source {key}"
    try:
        found = await _found(api, namespace, name, key)
    except PermissionError as exc:
        await _refused(namespace, name, exc, means)
        return
    except Exception as exc:  # the API server: looked at again later
        wait = ledger.failed(pin, now())
        means.count(FAILED)
        logger.info(
            "%s/%s: reading the ConfigMaps of %s: %s (looked at again in %g s)",
            namespace,
            name,
            where,
            exc,
            wait,
        )
        return
    if manifest_handoff.hands(found, digest):
        ledger.settle(pin, now())
        means.count(PRESENT)
        return
    logger.info(
        "%s/%s: the manifest %s of %s is pinned but not handed: resolving it again",
        namespace,
        name,
        digest,
        where,
    )
    outcome = await means.resolve_again(spec, key)
    if isinstance(outcome, status.Failed):
        wait = ledger.failed(pin, now())
        means.count(FAILED)
        logger.info(
            "%s/%s: resolving %s again to hand its manifest failed (%s); tried again in %g s",
            namespace,
            name,
            where,
            outcome.message,
            wait,
        )
        return
    assert isinstance(outcome, status.Resolved)
    if outcome.digest != digest:
        ledger.settle(pin, now(), for_good=True)
        means.count(SOURCE_CHANGED)
        await say(
            "Warning",
            manifest_handoff.REASON,
            f"the manifest {digest} pinned for {where} was not handed to the sidecars: "
            f"{uris.redact(uri)} now gives manifest {outcome.digest}. A sidecar on a node without a "
            "copy of the pinned manifest cannot start until the pinned data is back "
            "(or the mount is pinned again)",
        )
        return
    # A reconcile may have pinned again while this one read: hand only the pin it keeps.
    try:
        current = await api.read_datasetmount(namespace, name)
        if current is None or str((current.get("metadata") or {}).get("uid") or "") != uid:
            return
        now_spec = specs.parse_spec(current.get("spec"))
    except Exception as exc:  # changed to an invalid spec, or the API server
        wait = ledger.failed(pin, now())
        means.count(FAILED)
        logger.info(
            "%s/%s: not handed, the mount could not be read again (%s); tried again in %g s",
            namespace,
            name,
            exc,
            wait,
        )
        return
    kept = reconcile.current_pins(now_spec, current.get("status") or {})
    if (key, uri, digest) not in kept:
        return
    try:
        failure = await manifest_handoff.hand(
            api,
            owner=manifest_handoff.owner(body),
            namespace=namespace,
            source=key,
            digest=digest,
            parts=outcome.handed,
        )
    except PermissionError as exc:
        # Not tried again with the backoff: each try would read the dataset again.
        await _refused(namespace, name, exc, means)
        return
    if failure is not None:
        wait = ledger.failed(pin, now())
        means.count(FAILED)
        logger.warning("%s/%s: %s (tried again in %g s)", namespace, name, failure, wait)
        await say("Warning", manifest_handoff.REASON, failure)
        return
    ledger.settle(pin, now())
    means.count(WRITTEN)
    if outcome.handed:
        await say(
            "Normal",
            HANDED,
            f"the manifest {digest} of {where}, pinned before it could be handed, is "
            f"handed to the sidecars now ({len(outcome.handed)} ConfigMap parts)",
        )


async def _refused(namespace: str, name: str, exc: PermissionError, means: Means) -> None:
    """The operator may not get or write ConfigMaps in `namespace`: counted, and said (on
    mount `name`) unless said within the hour."""
    means.count(REFUSED)
    message = means.ledger.refuse(namespace, exc, means.now())
    if message is not None:
        logger.warning("%s/%s: %s", namespace, name, message)
        await means.say("Warning", manifest_handoff.REASON, message)
