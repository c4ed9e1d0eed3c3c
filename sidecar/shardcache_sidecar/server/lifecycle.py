"""The sidecar's state and its lifecycle: bring-up, warm-up, maintenance, shutdown.

Start-up is asynchronous: the servers answer at once (/healthz is 200, data routes say
"starting"), while the tier directories are checked (`tier_checks`), the manifest is
resolved, checked against the pinned digest, and the first shards of the startup plan
are fetched; /readyz turns 200 when all of it is done.

`Sidecar` is the app state every handler (`control`, `probes`) reaches through
`request.app[SIDECAR]`: settings, metrics, readiness gates, the reader registry, and
the cache node once it exists. Calls into the node block (an acquire can wait minutes
for a cold shard), so they run in a dedicated thread pool (`blocking`, `acquire`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import gc
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from aiohttp import web

from shardcache import contract, errors, manifests, s3_settings, source, source_credentials, uris
from shardcache.contract import protocol
from shardcache.node import (
    backings,
    caches,
    decode_budgets,
    handed_manifests,
    pinned_manifests,
    reader_locks,
    tiers,
)
from shardcache_sidecar import (
    configuration,
    metrics,
    prefetch_tuner,
    readers,
    readiness,
    tier_checks,
)
from shardcache_sidecar.server import handed, replies

# The logger name the sidecar's logs carried before the server was split (the JSON
# `logger` field), shared by the server's modules.
log = logging.getLogger("shardcache_sidecar.server")
T = TypeVar("T")

#: Reader id of the plan pre-registered from the sidecar's own settings at start-up.
STARTUP_READER = "startup"
GATE_TIERS = "tiers"
GATE_MANIFEST = "manifest"
GATE_WARM = "warm"
#: Seconds between two checks of tier directories the sidecar cannot use yet
#: (`tier_checks`): a few system calls each, and a node directory the node-cache
#: DaemonSet prepares after the pod started is taken up within this long.
TIER_RECHECK_S = 2.0
# Past a hold's expiry, when the loop looks again (seconds): a timer may fire a hair early.
_EXPIRY_MARGIN = 0.001
#: Seconds between two checks that the readers' processes live (their reader locks,
#: `drop_dead_readers`): a dead rank's reader steers prefetch and counts in the memory
#: budget of the others for at most this long. A check is a few system calls per
#: reader with a lock, and one wake-up of the loop; none run while no reader with a
#: lock is registered (`_watch_readers` then sleeps until one is).
READER_CHECK_S = 1.0
# Backoff while the source keeps failing at start-up (seconds).
_RESOLVE_FIRST_DELAY, _RESOLVE_MAX_DELAY = 1.0, 30.0
#: Retries inside one try to resolve the manifest: a few seconds, not the data path's
#: minute (`source.RetryPolicy`), since the loop around it retries for good with the
#: backoff above and says why in /readyz (and counts it) after each try.
_RESOLVE_RETRY = source.RetryPolicy(budget_seconds=5.0)
#: Where the sidecar's S3 settings come from, for messages about them.
_CREDENTIALS_ORIGIN = (
    "the sidecar's environment (the Secret named by spec.source.secretRef, by envFrom)"
)


def credentials_problem(uri: str, environ: Mapping[str, str]) -> str | None:
    """What is wrong with the S3 settings the sidecar reads `uri` with (its environment,
    which the webhook makes from the mount's Secret: one of the key pair without the
    other, a newline around a value, a password in the endpoint), or None. Checked
    before anything else, so a warm node's pinned manifest does not hide it."""
    scheme, _ = source.split_uri(uri)
    if scheme != "s3":
        return None
    return s3_settings.problem(environ, origin=_CREDENTIALS_ORIGIN, pair=True)


def partial_warm_reason(
    resident: list[int], wanted: int, shard: int, exc: tiers.RoomHeldError
) -> str:
    """Why the warm gate opened with fewer shards than asked for."""
    return (
        f"first {len(resident)} of {wanted} startup shards {resident} resident; shard "
        f"{shard} ({exc.size} bytes decoded) does not fit beside them ({exc.held} bytes) in "
        f"the memory tier (limit {exc.limit} bytes): raise spec.cache.memory "
        f"({contract.ENV_MEMORY_LIMIT}) or lower spec.prefetch.readyShards "
        f"({contract.ENV_READY_SHARDS})"
    )


def too_large_reason(wanted: int, shard: int, exc: tiers.EntryTooLargeError) -> str:
    """Why the warm gate stays closed for good: a shard no memory tier of this size holds."""
    return (
        f"shard {shard} of the first {wanted} startup shards is {exc.size} bytes decoded, "
        f"more than the whole memory tier holds (limit {exc.limit} bytes): it can never be "
        f"resident and every read of it fails; raise spec.cache.memory "
        f"({contract.ENV_MEMORY_LIMIT}) above {exc.size} bytes"
    )


def no_decode_room_reason(wanted: int, shard: int, exc: decode_budgets.DecodeRoomError) -> str:
    """Why the warm gate stays closed for good: a shard whose decode never fits the room
    this sidecar has to decode in. Its decoded size and the room are fixed while the
    sidecar runs, so a retry would only meet the same refusal."""
    return (
        f"shard {shard} of the first {wanted} startup shards cannot be decoded here: {exc}. "
        "Not retried: neither its decoded size nor the room changes until the sidecar "
        "restarts with more memory, and every read of that shard fails the same way"
    )


def _freeze_startup_objects() -> None:
    """Leave what start-up made (modules, the manifest, the cache node) out of every
    later collection.

    Why: a full collection walks every tracked object, and the sidecar's imports and
    manifest are most of them: 11-18 ms on the event loop each time one runs (measured
    here), and a control request arriving meanwhile waits that long (issue 14: the p99
    at K=1 and K=16 was 17-20 ms with a p50 under 1 ms). Frozen, they are never scanned
    again; what the requests allocate is still collected as before. One collection
    first, so that no garbage of start-up is kept forever."""
    gc.collect()
    gc.freeze()


class Sidecar:
    """State of one sidecar: settings, the cache node once it exists, readers, holds."""

    def __init__(self, settings: configuration.Settings) -> None:
        self.settings = settings
        self.metrics = metrics.Metrics()
        self.readiness = readiness.Readiness()
        self.readiness.require(
            GATE_TIERS,
            f"checking the memory tier {settings.memory_dir} and the disk tier {settings.disk_dir}",
        )
        self.readiness.require(
            GATE_MANIFEST, f"resolving the manifest of {uris.redact(settings.source_uri)}"
        )
        self.readiness.require(
            GATE_WARM,
            f"waiting for the first {settings.ready_shards} shard(s) of the startup plan",
        )
        self.registry: readers.Registry[tiers.Entry] = readers.Registry(clock=time.monotonic)
        #: What each reader opted into `skip_handed` was handed with `reuse`.
        self.handed = handed.Handed()
        # Dedicated: acquires block for as long as a cold fetch takes, and must not
        # starve the loop's default executor (DNS, file I/O inside aiohttp).
        self.executor = concurrent.futures.ThreadPoolExecutor(
            settings.control_threads, thread_name_prefix="shardcache-control"
        )
        self.node: caches.CacheNode | None = None
        self.manifest: manifests.Manifest | None = None
        #: The manifest's JSON, encoded once: every rank fetches it when it opens the
        #: dataset, K at once on a K-GPU node, and a large one takes milliseconds.
        self.manifest_body = b""
        self.problem: replies.Problem | None = replies.Problem(
            503, protocol.KIND_UNAVAILABLE, protocol.CODE_STARTING, "the sidecar is starting"
        )
        #: What the warm-up made resident once the warm gate opened (/v1/status).
        self.startup: dict[str, Any] | None = None
        #: What backs the memory tier, found at start (/v1/status, a metric, the log).
        self.backing: backings.Backing | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        #: Readers dropped because the process that opened them was gone (/v1/status).
        self.readers_dropped_dead = 0
        #: A registration whose reader lock this sidecar cannot see was logged once.
        self._warned_unseen_lock = False
        #: Set when a reader with a lock this sidecar sees registers: `_watch_readers`
        #: waits on it while no such reader is registered, so an idle sidecar's loop
        #: is not woken every `READER_CHECK_S` for nothing.
        self._locked_reader = asyncio.Event()
        #: What keeps the sidecar from using each tier directory, by tier, from the
        #: last start-up check (`tier_checks`); None before the first one.
        self.tier_problems: Mapping[str, str] | None = None
        self.metrics.watch(self.stats, self.readiness.is_ready, lambda: self.tier_problems)
        self.metrics.watch_readers(self.reader_stalls)
        #: Tunes each reader's prefetch depth from its stall reports (`prefetch_tuner`).
        self.tuner = prefetch_tuner.Tuner.for_settings(settings, self.metrics)
        self.metrics.watch_depths(self.reader_depths)

    # --- for the handlers -------------------------------------------------------
    def stats(self) -> caches.NodeStats | None:
        return None if self.node is None else self.node.stats()

    def reader_stalls(self) -> list[metrics.ReaderStalls]:
        """Readers that reported stall totals, or whose loop is stuck in an acquire
        (`Registry.stalls_now`; at scrape time, on the event loop)."""
        found = [
            # The warm-up's waits are no training loop's.
            (r, r.stalls if r.reader_id == STARTUP_READER else self.registry.stalls_now(r))
            for r in self.registry.readers()
        ]
        return [(r.reader_id, r.params.rank, s) for r, s in found if s is not None]

    def reader_waits(self, reader: readers.Reader) -> list[dict[str, Any]]:
        """What /v1/status shows of the reader's acquires waiting now: the shard, since
        when, and the attempt in flight to make it resident (None while nothing makes
        it so: the acquire is queued for a control thread, or between two tries)."""
        node, manifest = self.node, self.manifest
        now = time.monotonic()
        return [
            {
                "shard": w.shard,
                "path": None if manifest is None else manifest.shards[w.shard].path,
                "since": caches.utc_text(w.since_wall),
                "seconds": round(now - w.since, 3),
                "timeout_s": w.timeout_s,
                "attempt": None if node is None else node.in_flight(w.shard),
            }
            for w in reader.waits
        ]

    def reader_depths(self) -> list[metrics.ReaderDepth]:
        """Each registered reader's prefetch depth (at scrape time, on the event loop)."""
        node = self.node
        if node is None:
            return []
        return [
            (r.reader_id, r.params.rank, node.prefetch_depth(r.reader_id))
            for r in self.registry.readers()
        ]

    def forget_reader(
        self, reader_id: str
    ) -> tuple[readers.Reader | None, list[readers.Hold[tiers.Entry]]]:
        """Unregister a reader: its holds released, its plan out of prefetch and fill.
        The reader and the holds it had (none for an unknown reader)."""
        reader, holds = self.registry.unregister(reader_id)
        self.tuner.forget(reader_id)
        self.handed.forget(reader_id)
        for hold in holds:
            hold.lease.release()
        if reader is not None and self.node is not None:
            # A dict removal under the node's lock, which is only ever held briefly:
            # no thread hop.
            self.node.unregister_reader(reader_id)
        return reader, holds

    def reader_lock_seen(self, reader_id: str) -> bool:
        """Whether the reader lock a registration says its client holds is one this
        sidecar sees. Not seen (the containers mount different directories as the
        memory tier, or the sidecar may not read the file): the reader is kept until
        it is closed, as one without a lock; dropping it would drop a live reader."""
        found = reader_locks.probe(self.settings.memory_dir, (reader_id,))[reader_id]
        if found in (reader_locks.Found.HELD, reader_locks.Found.FREE):
            # FREE: the process died right after asking; the next check drops it.
            # The caller registers it as locked before the loop runs the watch again.
            self._locked_reader.set()
            return True
        if not self._warned_unseen_lock:
            self._warned_unseen_lock = True
            log.warning(
                "reader %s says its process holds %s, which this sidecar %s: its readers "
                "are kept until they are closed, also when their process dies; mount the "
                "same memory volume in the trainer and the sidecar",
                reader_id,
                reader_locks.path_of(self.settings.memory_dir, reader_id),
                "cannot find" if found is reader_locks.Found.MISSING else "cannot read",
            )
        return False

    def drop_dead_readers(self) -> list[str]:
        """Unregister each reader whose process is gone: its client held a reader lock,
        and now nobody does (the kernel dropped it with the process, even on SIGKILL).
        On the event loop: a few system calls per reader with a lock."""
        locked = self.registry.locked()
        if not locked:
            return []
        found = reader_locks.probe(self.settings.memory_dir, locked)
        dead = [
            r
            for r, f in found.items()
            if f in (reader_locks.Found.FREE, reader_locks.Found.MISSING)
        ]
        for reader_id in dead:
            reader, holds = self.forget_reader(reader_id)
            if reader is None:
                continue
            self.readers_dropped_dead += 1
            self.metrics.reader_dropped_dead()
            log.warning(
                "reader %s (rank %d) dropped: the process that opened it is gone (its "
                "reader lock is free); %d hold(s) released",
                reader_id,
                reader.params.rank,
                len(holds),
                extra={"reader": reader_id, "rank": reader.params.rank},
            )
        return dead

    async def blocking(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(fn, *args, **kwargs))

    def serving(self) -> caches.CacheNode:
        """The node, or the reason data is not served (starting, digest mismatch, ...)."""
        if self.problem is not None:
            raise self.problem.error()
        if self.node is None:
            raise replies.RequestError(
                503, protocol.KIND_UNAVAILABLE, protocol.CODE_STARTING, "starting"
            )
        return self.node

    async def acquire(
        self,
        node: caches.CacheNode,
        shard: int,
        timeout: float,
        *,
        beside: tuple[tiers.Entry, ...] = (),
        reader_id: str | None = None,
        count: bool = True,
        missed: bool = False,
    ) -> tiers.Entry:
        """Lease shard `shard`, fetching it if it is not resident (in the thread pool).

        `reader_id`: the reader it is for, shown waiting on the shard in /v1/status
        (and as stuck in the stall fraction) until the acquire ends. `count`: a
        reader's lookup (`CacheNode.acquire`); the warm-up's is not. `missed`: the
        caller's own lookup missed, counted (`CacheNode.lookup`)."""
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(
            self.executor,
            functools.partial(
                node.acquire, shard, timeout=timeout, beside=beside, count=count, missed=missed
            ),
        )
        wait = None if reader_id is None else self.registry.begin_wait(reader_id, shard, timeout)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            # The request went away (shutdown); a lease that arrives later is let go.
            future.add_done_callback(_release_result)
            raise
        finally:
            if reader_id is not None:
                self.registry.end_wait(reader_id, wait)

    # --- lifecycle --------------------------------------------------------------
    def start(self) -> None:
        self._report_backing()
        self._tasks.append(asyncio.create_task(self._bring_up(), name="bring-up"))

    def _report_backing(self) -> None:
        """Say what backs the memory tier: its page size sets the warm read speed."""
        found = self.backing = backings.of(self.settings.memory_dir)
        self.metrics.backed_by(found)
        if found is None:
            log.info("memory tier %s: backing unknown (no mount table)", self.settings.memory_dir)
        elif found.small_pages:
            log.info(
                "memory tier %s: %s; warm reads pay a TLB miss every 4 KiB (about 15-25%% "
                "slower than huge pages or a disk's page cache, docs/benchmarks.md): "
                "cache.medium Disk or a huge-page tmpfs read faster",
                self.settings.memory_dir,
                found.describe(),
            )
        else:
            log.info("memory tier %s: %s", self.settings.memory_dir, found.describe())

    def _pinned_copies(self) -> tiers.Tier:
        """The node disk tier, for the pinned manifest kept there (`pinned_manifests`)."""
        s = self.settings
        return tiers.Tier(s.disk_dir, limit_bytes=s.disk_limit, name="disk", fsync=True)

    async def _resolve(self) -> manifests.Manifest | None:
        s = self.settings
        problem = credentials_problem(s.source_uri, os.environ)
        if problem is not None:
            self.metrics.manifest_failed()
            self._refuse(
                409, protocol.CODE_BAD_REQUEST, f"the dataset source is unusable: {problem}"
            )
            return None
        if s.manifest_digest is not None:
            # A pinned manifest another sidecar on this node resolved: no store request.
            kept = await self.blocking(
                pinned_manifests.load,
                self._pinned_copies(),
                digest=s.manifest_digest,
                uri=s.source_uri,
            )
            if kept is not None:
                log.info("manifest %s from the node disk tier", kept.digest)
                self.metrics.manifest_loaded("node")
                return kept
            # The manifest the operator pinned, handed over in ConfigMaps: no read of
            # the dataset to hash it.
            handed = await self.blocking(
                handed_manifests.load,
                s.handed_manifests_dir,
                digest=s.manifest_digest,
                uri=s.source_uri,
            )
            if handed is not None:
                log.info("manifest %s handed by the operator", handed.digest)
                self.metrics.manifest_loaded("operator")
                await self.blocking(
                    pinned_manifests.keep, self._pinned_copies(), handed, uri=s.source_uri
                )
                return handed
            # The slow start users ask about: say why, and where the manifest was looked for.
            why = (
                f"the pinned manifest {s.manifest_digest} is neither in the node disk tier nor "
                f"handed by the operator (in {s.handed_manifests_dir}: only in the namespaces "
                "of the chart's rbac.manifestNamespaces): reading every shard of "
                f"{uris.redact(s.source_uri)} to hash it"
            )
            log.info(why)
            self.readiness.waiting(GATE_MANIFEST, why)
        delay = _RESOLVE_FIRST_DELAY
        while not self._closing:
            try:
                manifest = await self.blocking(
                    manifests.resolve, s.source_uri, format=s.source_format, retry=_RESOLVE_RETRY
                )
                self.metrics.manifest_loaded("source")
                if manifest.digest == s.manifest_digest:
                    await self.blocking(
                        pinned_manifests.keep, self._pinned_copies(), manifest, uri=s.source_uri
                    )
                return manifest
            except errors.AccessDeniedError as exc:
                self.metrics.manifest_failed()
                self._refuse(
                    409,
                    protocol.CODE_ACCESS_DENIED,
                    f"the object store refused the credentials in {_CREDENTIALS_ORIGIN}: "
                    f"{exc}; fix the Secret's {contract.ENV_S3_ACCESS_KEY_ID} and "
                    f"{contract.ENV_S3_SECRET_ACCESS_KEY} and restart the pod",
                )
                return None
            except errors.InputError as exc:
                self.metrics.manifest_failed()
                self._refuse(
                    409, protocol.CODE_BAD_REQUEST, f"the dataset source is unusable: {exc}"
                )
                return None
            except errors.SourceError as exc:
                self.metrics.manifest_failed()
                why = f"resolving the manifest of {uris.redact(s.source_uri)} failed: {exc}; retrying in {delay:.0f} s"
                log.warning(why)
                self.readiness.waiting(GATE_MANIFEST, why)
                self.problem = replies.Problem(
                    503, protocol.KIND_UNAVAILABLE, protocol.CODE_STARTING, why
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, _RESOLVE_MAX_DELAY)
        return None

    def _refuse(self, status: int, code: str, message: str) -> None:
        """Stop serving data for good (until restarted with other settings), loudly."""
        log.error(message, extra={"code": code})
        self.problem = replies.Problem(status, protocol.KIND_INPUT, code, message)
        self.readiness.waiting(GATE_MANIFEST, message)

    async def _tiers_usable(self) -> bool:
        """Wait until the sidecar can use its memory and disk tier directories (True),
        or it is closing (False). Until then the `tiers` gate says why, and the log at
        ERROR each time the reason changes: the cause is usually a node directory the
        node-cache DaemonSet prepares soon, so the sidecar waits for it rather than exit
        (`tier_checks`)."""
        s = self.settings
        since = time.monotonic()
        logged = None
        while not self._closing:
            found = await self.blocking(
                tier_checks.problems, s.memory_dir, s.disk_dir, retry_s=TIER_RECHECK_S
            )
            self.tier_problems = found
            if not found:
                if logged is not None:
                    log.info(
                        "the tier directories are usable now, after %.0f s",
                        time.monotonic() - since,
                    )
                self.readiness.open(
                    GATE_TIERS, f"memory tier {s.memory_dir} and disk tier {s.disk_dir} usable"
                )
                return True
            why = "; ".join(found.values())
            if why != logged:
                log.error(why)
                logged = why
            self.readiness.waiting(GATE_TIERS, why)
            self.readiness.waiting(
                GATE_MANIFEST, "not begun: waiting for the tier directories (gate tiers)"
            )
            await asyncio.sleep(TIER_RECHECK_S)
        return False

    async def _bring_up(self) -> None:
        s = self.settings
        if not await self._tiers_usable():
            return
        self.readiness.waiting(
            GATE_MANIFEST, f"resolving the manifest of {uris.redact(s.source_uri)}"
        )
        manifest = await self._resolve()
        if manifest is None:
            return
        if s.manifest_digest is not None and manifest.digest != s.manifest_digest:
            self._refuse(
                409,
                protocol.CODE_MANIFEST_MISMATCH,
                f"{uris.redact(s.source_uri)} resolves to manifest {manifest.digest}, but "
                f"{contract.ENV_MANIFEST_DIGEST} pins {s.manifest_digest}: the dataset changed "
                "since it was pinned (or it was pinned by a shardcache of another manifest "
                f"version; this one is {manifests.MANIFEST_VERSION}); refusing to serve it. "
                "Re-pin the DatasetMount (or restore the pinned objects) and restart the pod.",
            )
            return
        try:
            # The credentials files, read again when the store refuses those in use: a
            # key rotated in the Secret reaches this running pod (`source_credentials`).
            renewal = await self.blocking(
                source_credentials.Renewable, manifest.root, s.credentials_dir
            )
        except errors.InputError as exc:
            self._refuse(409, protocol.CODE_BAD_REQUEST, f"the dataset source is unusable: {exc}")
            return
        node = await self.blocking(
            caches.CacheNode, manifest, s.node_settings(), observer=self.metrics, renewal=renewal
        )
        self.manifest_body = json.dumps(manifest.to_json()).encode()
        self.manifest, self.node = manifest, node
        params = s.startup_plan()
        self.registry.register(STARTUP_READER, params, 0)
        await self.blocking(
            node.register_reader, STARTUP_READER, params, 0, fill_ranks=s.local_ranks
        )
        self.problem = None
        _freeze_startup_objects()
        self.readiness.open(
            GATE_MANIFEST, f"manifest {manifest.digest}, {len(manifest.shards)} shards"
        )
        log.info(
            "serving %s",
            uris.redact(s.source_uri),
            extra={
                "digest": manifest.digest,
                "shards": len(manifest.shards),
                "rows": manifest.total_rows,
                # Sized from the CPU quota and memory limit unless set (`quotas`).
                "fetch_concurrency": node.fetch_concurrency,
            },
        )
        self._tasks.append(asyncio.create_task(self._warm(node), name="warm"))
        self._tasks.append(asyncio.create_task(self._maintain(), name="maintain"))
        self._tasks.append(asyncio.create_task(self._watch_readers(), name="watch-readers"))

    async def _warm(self, node: caches.CacheNode) -> None:
        """Make the startup plan's first shards resident, then open the warm gate.

        Each is acquired and held until all are in: readahead and other acquires may
        evict unleased shards, so a shard warmed first could otherwise be gone by the
        time the last one arrives, and readiness would never come.

        Held shards can fill the memory tier: the next one then does not fit beside
        them, which no retry changes. The gate opens with the shards that fit and says
        so; the trainer still reads everything, shard by shard. A shard bigger than the
        whole tier, or whose decode never fits the room the sidecar has to decode in
        (`DecodeRoomError`), keeps the gate closed, said once: every read of it would
        fail too, and no retry changes either size.
        """
        k = self.settings.ready_shards
        shards = node.upcoming(STARTUP_READER, k) if k else []
        delay = _RESOLVE_FIRST_DELAY
        while not self._closing:
            held: list[tiers.Entry] = []
            try:
                for shard in shards:
                    held.append(
                        await self.acquire(
                            node,
                            shard,
                            self.settings.acquire_timeout,
                            beside=tuple(held),
                            reader_id=STARTUP_READER,
                            count=False,
                        )
                    )
            except tiers.RoomHeldError as exc:
                resident = shards[: len(held)]
                why = partial_warm_reason(resident, len(shards), shards[len(held)], exc)
                log.warning(why)
                self.startup = {"wanted": len(shards), "resident": len(held), "shards": resident}
                self.readiness.open(GATE_WARM, why)
                return
            except tiers.EntryTooLargeError as exc:
                why = too_large_reason(len(shards), shards[len(held)], exc)
                log.error(why)
                self.readiness.waiting(GATE_WARM, why)
                return
            except decode_budgets.DecodeRoomError as exc:
                # Before the retried errors below (it is a CacheError): no wait helps.
                why = no_decode_room_reason(len(shards), shards[len(held)], exc)
                log.error(why)
                self.readiness.waiting(GATE_WARM, why)
                return
            except (errors.ShardcacheError, TimeoutError, OSError) as exc:
                # OSError: a tier directory that failed after the start-up check (made
                # unwritable, removed); retried like a failing source.
                why = f"making the first shards {shards} resident failed: {exc}; retrying in {delay:.0f} s"
                log.warning(why)
                self.readiness.waiting(GATE_WARM, why)
            else:
                self.startup = {"wanted": len(shards), "resident": len(shards), "shards": shards}
                self.readiness.open(GATE_WARM, f"first {len(shards)} shard(s) {shards} resident")
                log.info("ready: the first %d shard(s) %s are resident", len(shards), shards)
                return
            finally:
                for entry in held:
                    entry.release()
            await asyncio.sleep(delay)
            delay = min(delay * 2, _RESOLVE_MAX_DELAY)

    async def _maintain(self) -> None:
        while not self._closing:
            for hold in self.registry.expired(self.settings.handoff_timeout):
                log.warning(
                    "dropping hold on shard %d: reader %s never took it over within %g s "
                    "(the trainer died or cannot see the memory directory)",
                    hold.shard,
                    hold.reader_id,
                    self.settings.handoff_timeout,
                )
                hold.lease.release()
            # Asleep until the oldest hold expires, not polling: each wake-up of the loop
            # cost about 0.2 ms of CPU on the 2-core machine, and the 0.2 s poll was a
            # tenth of the sidecar's CPU over a warm pass with one rank (docs/benchmarks.md,
            # "Issue 14 on 2 cores, session 7"). A hold made meanwhile expires later.
            expiry = self.registry.next_expiry(self.settings.handoff_timeout)
            await asyncio.sleep(max(0.0, expiry - time.monotonic()) + _EXPIRY_MARGIN)

    async def _watch_readers(self) -> None:
        """Drop the readers of dead processes every `READER_CHECK_S` seconds. Not only
        at a new registration: a rank that is not restarted registers none, and its
        reader would keep steering prefetch and the fill, and keep its share of the
        memory budget that `control._grant` divides among the readers.

        While no reader with a lock is registered there is nothing to check: the watch
        sleeps until `reader_lock_seen` finds one (an idle sidecar's loop stays asleep)."""
        while not self._closing:
            if not self.registry.locked():
                self._locked_reader.clear()
                await self._locked_reader.wait()
                continue
            await asyncio.sleep(READER_CHECK_S)
            try:
                self.drop_dead_readers()
            except Exception:  # the watch outlives one bad check; the next one retries
                log.exception("checking whether the readers' processes live failed")

    async def close(self) -> None:
        self._closing = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for hold in self.registry.holds():
            self.registry.drop(hold.lease_id)
            hold.lease.release()
        if self.node is not None:
            node, self.node = self.node, None
            await asyncio.get_running_loop().run_in_executor(None, node.close)
        # Acquires still waiting on the source are abandoned, not awaited: the process
        # is going away and the kernel drops their locks.
        self.executor.shutdown(wait=False, cancel_futures=True)


#: Where handlers find the sidecar: `request.app[SIDECAR]`.
SIDECAR = web.AppKey("sidecar", Sidecar)


def _release_result(future: asyncio.Future[tiers.Entry]) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().release()
