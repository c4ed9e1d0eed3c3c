"""The sidecar's HTTP servers: the control API on a Unix socket, probes on TCP.

* Unix socket (shared volume, trainer only): the versioned control API of
  docs/wire-format.md (`shardcache.contract.protocol`) plus /healthz, /readyz, /metrics.
* TCP (kubelet probes, Prometheus): /healthz, /readyz, /metrics only.

Handlers are thin: they parse the request, call the `CacheNode` (blocking, so always in
a dedicated thread pool: an acquire can wait minutes for a cold shard and must never
stall the event loop or the default executor) and shape the answer. Errors become JSON
bodies with a `kind`; bad input gets a 4xx and the sidecar keeps serving everyone else.

Start-up is asynchronous: the servers answer at once (/healthz is 200, data routes say
"starting"), while the manifest is resolved, checked against the pinned digest, and the
first shards of the startup plan are fetched; /readyz turns 200 when all of it is done.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web

from shardcache import contract, errors, manifests
from shardcache.contract import protocol
from shardcache.node import backings, caches, names, tiers
from shardcache_sidecar import configuration
from shardcache_sidecar import metrics as metrics_mod
from shardcache_sidecar import readers as readers_mod
from shardcache_sidecar import readiness as readiness_mod
from shardcache_sidecar.checkpoint import agent as checkpoint_agent
from shardcache_sidecar.checkpoint import hook as checkpoint_hook
from shardcache_sidecar.ui import routes as ui_routes

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Reader id of the plan pre-registered from the sidecar's own settings at start-up.
STARTUP_READER = "startup"
GATE_MANIFEST = "manifest"
GATE_WARM = "warm"
# How often holds nobody took over are looked for (seconds).
_MAINTENANCE_INTERVAL = 0.2
# Seconds in-flight requests get to finish after SIGTERM.
_SHUTDOWN_TIMEOUT = 3.0
# Backoff while the source keeps failing at start-up (seconds).
_RESOLVE_FIRST_DELAY, _RESOLVE_MAX_DELAY = 1.0, 30.0


class RequestError(Exception):
    """A request the sidecar refuses, with its HTTP status and wire error."""

    def __init__(self, status: int, kind: str, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind, self.code, self.message = status, kind, code, message


@dataclasses.dataclass(frozen=True)
class _Problem:
    """Why data routes are not served (yet)."""

    status: int
    kind: str
    code: str
    message: str

    def error(self) -> RequestError:
        return RequestError(self.status, self.kind, self.code, self.message)


def json_response(doc: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=json.dumps(doc).encode(), status=status, content_type="application/json"
    )


def error_response(exc: RequestError) -> web.Response:
    return json_response(protocol.error_body(exc.kind, exc.code, exc.message), exc.status)


def _request_error(exc: BaseException) -> RequestError:
    """The wire form of an error raised by the cache or by request parsing."""
    if isinstance(exc, errors.ManifestMismatchError):
        return RequestError(409, protocol.KIND_INPUT, protocol.CODE_MANIFEST_MISMATCH, str(exc))
    if isinstance(exc, errors.InputError):
        return RequestError(400, protocol.KIND_INPUT, protocol.CODE_BAD_REQUEST, str(exc))
    if isinstance(exc, errors.SourceError):
        return RequestError(502, protocol.KIND_SOURCE, protocol.CODE_SOURCE_FAILED, str(exc))
    if isinstance(exc, TimeoutError):
        return RequestError(
            504,
            protocol.KIND_CACHE,
            protocol.CODE_TIMEOUT,
            f"timed out waiting for the shard: {exc}",
        )
    if isinstance(exc, errors.CacheError):
        return RequestError(503, protocol.KIND_CACHE, protocol.CODE_INTERNAL, str(exc))
    return RequestError(
        500,
        protocol.KIND_CACHE,
        protocol.CODE_INTERNAL,
        f"internal error: {type(exc).__name__}: {exc}",
    )


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


class Sidecar:
    """State of one sidecar: settings, the cache node once it exists, readers, holds."""

    def __init__(self, settings: configuration.Settings) -> None:
        self.settings = settings
        self.metrics = metrics_mod.Metrics()
        self.readiness = readiness_mod.Readiness()
        self.readiness.require(GATE_MANIFEST, f"resolving the manifest of {settings.source_uri}")
        self.readiness.require(
            GATE_WARM,
            f"waiting for the first {settings.ready_shards} shard(s) of the startup plan",
        )
        self.registry: readers_mod.Registry[tiers.Entry] = readers_mod.Registry(
            clock=time.monotonic
        )
        # Dedicated: acquires block for as long as a cold fetch takes, and must not
        # starve the loop's default executor (DNS, file I/O inside aiohttp).
        self.executor = concurrent.futures.ThreadPoolExecutor(
            settings.control_threads, thread_name_prefix="shardcache-control"
        )
        self.node: caches.CacheNode | None = None
        self.manifest: manifests.Manifest | None = None
        self.problem: _Problem | None = _Problem(
            503, protocol.KIND_UNAVAILABLE, protocol.CODE_STARTING, "the sidecar is starting"
        )
        #: What the warm-up made resident once the warm gate opened (/v1/status).
        self.startup: dict[str, Any] | None = None
        #: What backs the memory tier, found at start (/v1/status, a metric, the log).
        self.backing: backings.Backing | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self.metrics.watch(self._stats, self.readiness.is_ready)

    # --- helpers ----------------------------------------------------------------
    def _stats(self) -> caches.NodeStats | None:
        return None if self.node is None else self.node.stats()

    async def blocking(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(fn, *args, **kwargs))

    def serving(self) -> caches.CacheNode:
        """The node, or the reason data is not served (starting, digest mismatch, ...)."""
        if self.problem is not None:
            raise self.problem.error()
        if self.node is None:
            raise RequestError(503, protocol.KIND_UNAVAILABLE, protocol.CODE_STARTING, "starting")
        return self.node

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

    async def _resolve(self) -> manifests.Manifest | None:
        s = self.settings
        delay = _RESOLVE_FIRST_DELAY
        while not self._closing:
            try:
                return await self.blocking(manifests.resolve, s.source_uri, format=s.source_format)
            except errors.InputError as exc:
                self._refuse(
                    409, protocol.CODE_BAD_REQUEST, f"the dataset source is unusable: {exc}"
                )
                return None
            except errors.SourceError as exc:
                why = f"resolving the manifest of {s.source_uri} failed: {exc}; retrying in {delay:.0f} s"
                log.warning(why)
                self.readiness.waiting(GATE_MANIFEST, why)
                self.problem = _Problem(503, protocol.KIND_UNAVAILABLE, protocol.CODE_STARTING, why)
            await asyncio.sleep(delay)
            delay = min(delay * 2, _RESOLVE_MAX_DELAY)
        return None

    def _refuse(self, status: int, code: str, message: str) -> None:
        """Stop serving data for good (until restarted with other settings), loudly."""
        log.error(message, extra={"code": code})
        self.problem = _Problem(status, protocol.KIND_INPUT, code, message)
        self.readiness.waiting(GATE_MANIFEST, message)

    async def _bring_up(self) -> None:
        s = self.settings
        manifest = await self._resolve()
        if manifest is None:
            return
        if s.manifest_digest is not None and manifest.digest != s.manifest_digest:
            self._refuse(
                409,
                protocol.CODE_MANIFEST_MISMATCH,
                f"{s.source_uri} resolves to manifest {manifest.digest}, but "
                f"{contract.ENV_MANIFEST_DIGEST} pins {s.manifest_digest}: the dataset changed "
                "since it was pinned; refusing to serve it. Re-pin the DatasetMount (or "
                "restore the pinned objects) and restart the pod.",
            )
            return
        node = await self.blocking(
            caches.CacheNode, manifest, s.node_settings(), observer=self.metrics
        )
        self.manifest, self.node = manifest, node
        params = s.startup_plan()
        self.registry.register(STARTUP_READER, params, 0)
        await self.blocking(node.register_reader, STARTUP_READER, params, 0)
        self.problem = None
        self.readiness.open(
            GATE_MANIFEST, f"manifest {manifest.digest}, {len(manifest.shards)} shards"
        )
        log.info(
            "serving %s",
            s.source_uri,
            extra={
                "digest": manifest.digest,
                "shards": len(manifest.shards),
                "rows": manifest.total_rows,
            },
        )
        self._tasks.append(asyncio.create_task(self._warm(node), name="warm"))
        self._tasks.append(asyncio.create_task(self._maintain(), name="maintain"))

    async def _warm(self, node: caches.CacheNode) -> None:
        """Make the startup plan's first shards resident, then open the warm gate.

        Each is acquired and held until all are in: readahead and other acquires may
        evict unleased shards, so a shard warmed first could otherwise be gone by the
        time the last one arrives, and readiness would never come.

        Held shards can fill the memory tier: the next one then does not fit beside
        them, which no retry changes. The gate opens with the shards that fit and says
        so; the trainer still reads everything, shard by shard. A shard bigger than the
        whole tier keeps the gate closed: every read of it would fail too.
        """
        k = self.settings.ready_shards
        shards = node.upcoming(STARTUP_READER, k) if k else []
        delay = _RESOLVE_FIRST_DELAY
        while not self._closing:
            held: list[tiers.Entry] = []
            try:
                for shard in shards:
                    held.append(
                        await self._acquire(
                            node, shard, self.settings.acquire_timeout, beside=tuple(held)
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
            except (errors.ShardcacheError, TimeoutError) as exc:
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
            await asyncio.sleep(_MAINTENANCE_INTERVAL)

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

    # --- probes -----------------------------------------------------------------
    async def healthz(self, request: web.Request) -> web.Response:
        return json_response({"status": "alive", "version": protocol.VERSION})

    async def readyz(self, request: web.Request) -> web.Response:
        report = self.readiness.report()
        return json_response(report, 200 if report["ready"] else 503)

    async def metrics_page(self, request: web.Request) -> web.Response:
        body = await asyncio.get_running_loop().run_in_executor(None, self.metrics.render)
        return web.Response(body=body, headers={"Content-Type": metrics_mod.CONTENT_TYPE})

    # --- control API ------------------------------------------------------------
    async def get_manifest(self, request: web.Request) -> web.Response:
        self.serving()
        assert self.manifest is not None
        return json_response(self.manifest.to_json())

    async def get_status(self, request: web.Request) -> web.Response:
        m = self.manifest
        # Counting resident bytes lists the tier directories: not on the event loop.
        stats = await asyncio.get_running_loop().run_in_executor(None, self._stats)
        return json_response(
            {
                "version": protocol.VERSION,
                "source": self.settings.source_uri,
                "manifest": None
                if m is None
                else {
                    "digest": m.digest,
                    "shards": len(m.shards),
                    "rows": m.total_rows,
                    "bytes": m.total_bytes,
                },
                "problem": None if self.problem is None else dataclasses.asdict(self.problem),
                "readers": [
                    {
                        "id": r.reader_id,
                        **protocol.params_to_json(r.params),
                        "position": r.position,
                    }
                    for r in self.registry.readers()
                ],
                "holds": len(self.registry.holds()),
                "stats": None if stats is None else dataclasses.asdict(stats),
                "ready": self.readiness.report(),
                "startup": self.startup,
                "memory_tier": None if self.backing is None else self.backing.to_json(),
            }
        )

    async def put_reader(self, request: web.Request) -> web.Response:
        node = self.serving()
        reader_id = protocol.check_reader_id(request.match_info["reader_id"])
        body = await _json_body(request)
        params = protocol.params_from_json(body)
        position = protocol.require_int(body, "position", minimum=0)
        digest = body.get("digest")
        assert self.manifest is not None
        if digest is not None and digest != self.manifest.digest:
            raise RequestError(
                409,
                protocol.KIND_INPUT,
                protocol.CODE_MANIFEST_MISMATCH,
                f"the reader expects manifest {digest}, this sidecar serves "
                f"{self.manifest.digest}: the dataset changed under a running job",
            )
        if reader_id != STARTUP_READER and self.registry.get(STARTUP_READER) is not None:
            # The trainer is here: its own plan drives prefetch from now on.
            self.registry.unregister(STARTUP_READER)
            await self.blocking(node.unregister_reader, STARTUP_READER)
        change = self.registry.register(reader_id, params, position)
        if change is readers_mod.Change.UNCHANGED:
            await self.blocking(
                node.update_reader, reader_id, epoch=params.epoch, position=position
            )
        else:
            await self.blocking(node.register_reader, reader_id, params, position)
        log.info(
            "reader %s %s",
            reader_id,
            change.value,
            extra={"reader": reader_id, **protocol.params_to_json(params), "position": position},
        )
        return json_response(
            {
                "reader": reader_id,
                "change": change.value,
                "params": protocol.params_to_json(params),
                "position": position,
            }
        )

    async def post_position(self, request: web.Request) -> web.Response:
        node = self.serving()
        reader_id = self._known_reader(request)
        body = await _json_body(request)
        epoch = protocol.require_int(body, "epoch", minimum=0)
        position = protocol.require_int(body, "position", minimum=0)
        self.registry.move(reader_id, epoch=epoch, position=position)
        await self.blocking(node.update_reader, reader_id, epoch=epoch, position=position)
        return json_response({"reader": reader_id, "epoch": epoch, "position": position})

    async def post_pinned(self, request: web.Request) -> web.Response:
        """The reader pinned shard S itself, from an entry an earlier acquire handed it.

        The client's warm path (the `reuse` fast path of docs/wire-format.md): no hold,
        no lookup here; only what an acquire would have done besides leasing: move the
        reader, so prefetch follows it, and count the memory-tier hit.
        """
        call = await self._shard_call(request)
        await self._follow(call)
        call.node.note_reuse(call.shard)
        return json_response(
            {
                "reader": call.reader_id,
                "shard": call.shard,
                "epoch": call.epoch,
                "position": call.position,
            }
        )

    async def _shard_call(self, request: web.Request) -> _ShardCall:
        """A reader's request about one shard, checked: known reader, shard in range."""
        node = self.serving()
        reader_id = self._known_reader(request)
        body = await _json_body(request)
        call = _ShardCall(
            node=node,
            reader_id=reader_id,
            body=body,
            shard=protocol.require_int(body, "shard"),
            epoch=protocol.require_int(body, "epoch", minimum=0),
            position=protocol.require_int(body, "position", minimum=0),
        )
        _check_shard(node, call.shard)
        return call

    async def _follow(self, call: _ShardCall) -> None:
        """Move the reader to where the call says it is, so prefetch follows it."""
        self.registry.move(call.reader_id, epoch=call.epoch, position=call.position)
        await self.blocking(
            call.node.update_reader, call.reader_id, epoch=call.epoch, position=call.position
        )

    def _known_reader(self, request: web.Request) -> str:
        reader_id = protocol.check_reader_id(request.match_info["reader_id"])
        if self.registry.get(reader_id) is None:
            raise RequestError(
                404,
                protocol.KIND_INPUT,
                protocol.CODE_UNKNOWN_READER,
                f"unknown reader {reader_id!r}: register it with PUT {protocol.reader_path(reader_id)}",
            )
        return reader_id

    async def post_acquire(self, request: web.Request) -> web.Response:
        call = await self._shard_call(request)
        node, reader_id, shard = call.node, call.reader_id, call.shard
        wanted = protocol.optional_float(call.body, "timeout_s")
        timeout = (
            self.settings.acquire_timeout
            if wanted is None
            else min(wanted, self.settings.acquire_timeout)
        )
        await self._follow(call)
        entry = await self._acquire(node, shard, timeout)
        if self.registry.get(reader_id) is None:
            # Unregistered while we waited: nobody will take this over.
            entry.release()
            raise RequestError(
                409,
                protocol.KIND_INPUT,
                protocol.CODE_UNKNOWN_READER,
                f"reader {reader_id!r} was unregistered",
            )
        hold = self.registry.hold(reader_id, shard, entry)
        memory_dir = self.settings.memory_dir
        lock = entry.path.with_name(entry.key + names.LOCK_SUFFIX)
        return json_response(
            {
                "lease": hold.lease_id,
                "shard": shard,
                "path": entry.path.relative_to(memory_dir).as_posix(),
                "lock": lock.relative_to(memory_dir).as_posix(),
                "size": entry.size,
                "memory_dir": str(memory_dir),
                "handoff_timeout_s": self.settings.handoff_timeout,
                # The client may pin this entry again later without asking (POST
                # .../pinned instead) only if a lookup here would check no more than
                # the client's pin does: the lock, the file and its size.
                "reuse": node.memory.verify == "never",
            }
        )

    async def _acquire(
        self,
        node: caches.CacheNode,
        shard: int,
        timeout: float,
        *,
        beside: tuple[tiers.Entry, ...] = (),
    ) -> tiers.Entry:
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(
            self.executor,
            functools.partial(node.acquire, shard, timeout=timeout, beside=beside),
        )
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            # The request went away (shutdown); a lease that arrives later is let go.
            future.add_done_callback(_release_result)
            raise

    async def delete_lease(self, request: web.Request) -> web.Response:
        lease_id = request.match_info["lease_id"]
        hold = self.registry.drop(lease_id)
        if hold is not None:
            hold.lease.release()
        return json_response({"lease": lease_id, "released": hold is not None})

    async def delete_reader(self, request: web.Request) -> web.Response:
        reader_id = protocol.check_reader_id(request.match_info["reader_id"])
        reader, holds = self.registry.unregister(reader_id)
        for hold in holds:
            hold.lease.release()
        if reader is not None and self.node is not None:
            await self.blocking(self.node.unregister_reader, reader_id)
            log.info("reader %s unregistered", reader_id, extra={"reader": reader_id})
        return json_response(
            {"reader": reader_id, "removed": reader is not None, "released_leases": len(holds)}
        )


@dataclasses.dataclass(frozen=True)
class _ShardCall:
    node: caches.CacheNode
    reader_id: str
    body: dict[str, Any]
    shard: int
    epoch: int
    position: int


def _check_shard(node: caches.CacheNode, shard: int) -> None:
    n = len(node.manifest.shards)
    if not 0 <= shard < n:
        raise RequestError(
            400,
            protocol.KIND_INPUT,
            protocol.CODE_UNKNOWN_SHARD,
            f"shard index {shard} is out of range: the manifest has {n} shards (0..{n - 1})",
        )


def _release_result(future: asyncio.Future[tiers.Entry]) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().release()


async def _json_body(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    try:
        body = json.loads(raw) if raw else None
    except ValueError as exc:
        raise errors.InputError(f"request body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise errors.InputError(f"request body: expected a JSON object, found {raw[:80]!r}")
    return body


def _middleware(sidecar: Sidecar) -> Callable[..., Awaitable[web.StreamResponse]]:
    @web.middleware
    async def errors_to_json(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        route = (
            request.match_info.route.resource.canonical
            if request.match_info.route.resource
            else "unmatched"
        )
        try:
            response = await handler(request)
        except RequestError as exc:
            response = error_response(exc)
        except web.HTTPException as exc:
            # aiohttp's own 404/405: same JSON shape as every other error.
            code = (
                protocol.CODE_UNKNOWN_ROUTE
                if exc.status in (404, 405)
                else protocol.CODE_BAD_REQUEST
            )
            message = f"{request.method} {request.path}: {exc.reason}"
            response = error_response(RequestError(exc.status, protocol.KIND_INPUT, code, message))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            rejected = _request_error(exc)
            if (
                rejected.status >= 500
                and rejected.kind == protocol.KIND_CACHE
                and rejected.code == protocol.CODE_INTERNAL
            ):
                log.exception("%s %s failed", request.method, request.path)
            else:
                log.warning("%s %s: %s", request.method, request.path, rejected.message)
            response = error_response(rejected)
        sidecar.metrics.requests.labels(route, str(response.status)).inc()
        return response

    return errors_to_json


def _probe_routes(sidecar: Sidecar) -> list[web.RouteDef]:
    return [
        web.get(protocol.HEALTHZ, sidecar.healthz),
        web.get(protocol.READYZ, sidecar.readyz),
        web.get(protocol.METRICS, sidecar.metrics_page),
    ]


def control_app(sidecar: Sidecar) -> web.Application:
    app = web.Application(middlewares=[_middleware(sidecar)])
    app.add_routes(_probe_routes(sidecar))
    app.add_routes(
        [
            web.get(protocol.MANIFEST, sidecar.get_manifest),
            web.get(protocol.STATUS, sidecar.get_status),
            web.put(protocol.reader_path("{reader_id}"), sidecar.put_reader),
            web.delete(protocol.reader_path("{reader_id}"), sidecar.delete_reader),
            web.post(protocol.position_path("{reader_id}"), sidecar.post_position),
            web.post(protocol.acquire_path("{reader_id}"), sidecar.post_acquire),
            web.post(protocol.pinned_path("{reader_id}"), sidecar.post_pinned),
            web.delete(protocol.lease_path("{lease_id}"), sidecar.delete_lease),
        ]
    )
    return app


def probe_app(sidecar: Sidecar) -> web.Application:
    app = web.Application(middlewares=[_middleware(sidecar)])
    app.add_routes(_probe_routes(sidecar))
    # The web inspector (/ui): read-only, here on the metrics port, never on the socket.
    defaults = ui_routes.Defaults.from_plan(sidecar.settings.startup_plan())
    ui_routes.mount(app, ui_routes.NodeInspector(sidecar.serving), defaults)
    return app


def remove_stale_socket(path: Path) -> None:
    """Remove a socket file left by a killed sidecar; refuse if one is still serving."""
    if not path.exists() and not path.is_symlink():
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(os.fspath(path))
    except (ConnectionRefusedError, FileNotFoundError):
        log.info("removing stale control socket %s", path)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return
    except OSError as exc:
        raise errors.InputError(
            f"{path} exists and is not a usable socket ({exc}); remove it"
        ) from exc
    finally:
        probe.close()
    raise errors.InputError(
        f"another sidecar is already serving on {path}: stop it first, or use another run directory"
    )


async def serve(
    settings: configuration.Settings,
    stop: asyncio.Event,
    *,
    on_start: Callable[[Sidecar], None] | None = None,
) -> None:
    """Run the sidecar until `stop` is set; then shut down cleanly and remove the socket."""
    settings.socket_path.parent.mkdir(parents=True, exist_ok=True)
    settings.memory_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_socket(settings.socket_path)
    sidecar = Sidecar(settings)
    agent: checkpoint_agent.Agent | None = None
    # Waiting acquires can take minutes; on SIGTERM they get a few seconds, not the
    # default minute, so the cache closes and the checkpoint agent drains within the
    # pod's grace period.
    runner_options: dict[str, Any] = {
        "access_log": None,
        "handle_signals": False,
        "shutdown_timeout": _SHUTDOWN_TIMEOUT,
    }
    control = web.AppRunner(control_app(sidecar), **runner_options)
    probes = web.AppRunner(probe_app(sidecar), **runner_options)
    await control.setup()
    await probes.setup()
    try:
        await web.UnixSite(control, os.fspath(settings.socket_path)).start()
        # The trainer may run as another user than the sidecar; the socket lives in
        # the pod's own volume, so the pod boundary is the access boundary.
        os.chmod(settings.socket_path, 0o666)
        await web.TCPSite(probes, settings.metrics_host, settings.metrics_port).start()
        log.info(
            "listening",
            extra={
                "socket": str(settings.socket_path),
                "metrics": f"{settings.metrics_host}:{settings.metrics_port}",
            },
        )
        sidecar.start()
        if settings.checkpoint is not None:
            agent = checkpoint_hook.attach(
                settings.checkpoint, sidecar.readiness, sidecar.metrics.registry
            )
        if on_start is not None:
            # Where other agents (checkpoints) hook in, e.g. to add a readiness gate.
            on_start(sidecar)
        await stop.wait()
        log.info("shutting down")
    finally:
        await control.cleanup()
        await probes.cleanup()
        if agent is not None:
            await checkpoint_hook.detach(agent)
        await sidecar.close()
        with contextlib.suppress(FileNotFoundError):
            settings.socket_path.unlink()
