"""The control API on the Unix socket (docs/wire-format.md, `shardcache.contract.protocol`).

    GET    /v1/manifest                  the pinned manifest
    GET    /v1/status                    readers, holds, cache stats, readiness
    PUT    /v1/readers/{id}              register (or move) a reader's plan
    DELETE /v1/readers/{id}              unregister it, releasing its holds
    POST   /v1/readers/{id}/position     where the reader is now
    POST   /v1/readers/{id}/acquire      lease a shard, blocking until it is resident
    POST   /v1/readers/{id}/pinned       the reader pinned a shard itself (warm path)
    DELETE /v1/leases/{id}               release a hold the reader did not take over

Handlers are thin: they parse the request, call the `CacheNode` through the sidecar's
thread pool (`lifecycle.Sidecar.blocking`) and shape the answer. Errors are raised
(`replies.RequestError`, `errors.InputError`, ...) and become JSON bodies with a `kind`
in the server's middleware; bad input gets a 4xx and the sidecar keeps serving
everyone else.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from aiohttp import web

from shardcache import uris
from shardcache.contract import protocol
from shardcache.node import caches, names
from shardcache_sidecar import readers
from shardcache_sidecar.server import lifecycle, replies

# The logger name the sidecar's logs carried before the server was split.
log = logging.getLogger("shardcache_sidecar.server")

ROUTES = web.RouteTableDef()


@ROUTES.get(protocol.MANIFEST)
async def get_manifest(request: web.Request) -> web.Response:
    sidecar = request.app[lifecycle.SIDECAR]
    sidecar.serving()
    assert sidecar.manifest is not None
    return replies.json_response(sidecar.manifest.to_json())


@ROUTES.get(protocol.STATUS)
async def get_status(request: web.Request) -> web.Response:
    sidecar = request.app[lifecycle.SIDECAR]
    m = sidecar.manifest
    # Counting resident bytes lists the tier directories: not on the event loop.
    stats = await asyncio.get_running_loop().run_in_executor(None, sidecar.stats)
    return replies.json_response(
        {
            "version": protocol.VERSION,
            "source": uris.redact(sidecar.settings.source_uri),
            "manifest": None
            if m is None
            else {
                "digest": m.digest,
                "shards": len(m.shards),
                "rows": m.total_rows,
                "bytes": m.total_bytes,
            },
            "problem": None if sidecar.problem is None else dataclasses.asdict(sidecar.problem),
            "readers": [
                {
                    "id": r.reader_id,
                    **protocol.params_to_json(r.params),
                    "position": r.position,
                }
                for r in sidecar.registry.readers()
            ],
            "holds": len(sidecar.registry.holds()),
            "stats": None if stats is None else dataclasses.asdict(stats),
            "ready": sidecar.readiness.report(),
            "startup": sidecar.startup,
            "memory_tier": None if sidecar.backing is None else sidecar.backing.to_json(),
        }
    )


@ROUTES.put(protocol.reader_path("{reader_id}"))
async def put_reader(request: web.Request) -> web.Response:
    sidecar = request.app[lifecycle.SIDECAR]
    node = sidecar.serving()
    reader_id = protocol.check_reader_id(request.match_info["reader_id"])
    body = await replies.json_body(request)
    params = protocol.params_from_json(body)
    position = protocol.require_int(body, "position", minimum=0)
    digest = body.get("digest")
    assert sidecar.manifest is not None
    if digest is not None and digest != sidecar.manifest.digest:
        raise replies.RequestError(
            409,
            protocol.KIND_INPUT,
            protocol.CODE_MANIFEST_MISMATCH,
            f"the reader expects manifest {digest}, this sidecar serves "
            f"{sidecar.manifest.digest}: the dataset changed under a running job",
        )
    startup = lifecycle.STARTUP_READER
    if reader_id != startup and sidecar.registry.get(startup) is not None:
        # The trainer is here: its own plan drives prefetch from now on.
        sidecar.registry.unregister(startup)
        await sidecar.blocking(node.unregister_reader, startup)
    change = sidecar.registry.register(reader_id, params, position)
    if change is readers.Change.UNCHANGED:
        await sidecar.blocking(node.update_reader, reader_id, epoch=params.epoch, position=position)
    else:
        await sidecar.blocking(node.register_reader, reader_id, params, position)
    log.info(
        "reader %s %s",
        reader_id,
        change.value,
        extra={"reader": reader_id, **protocol.params_to_json(params), "position": position},
    )
    return replies.json_response(
        {
            "reader": reader_id,
            "change": change.value,
            "params": protocol.params_to_json(params),
            "position": position,
        }
    )


@ROUTES.delete(protocol.reader_path("{reader_id}"))
async def delete_reader(request: web.Request) -> web.Response:
    sidecar = request.app[lifecycle.SIDECAR]
    reader_id = protocol.check_reader_id(request.match_info["reader_id"])
    reader, holds = sidecar.registry.unregister(reader_id)
    for hold in holds:
        hold.lease.release()
    if reader is not None and sidecar.node is not None:
        await sidecar.blocking(sidecar.node.unregister_reader, reader_id)
        log.info("reader %s unregistered", reader_id, extra={"reader": reader_id})
    return replies.json_response(
        {"reader": reader_id, "removed": reader is not None, "released_leases": len(holds)}
    )


@ROUTES.post(protocol.position_path("{reader_id}"))
async def post_position(request: web.Request) -> web.Response:
    sidecar = request.app[lifecycle.SIDECAR]
    node = sidecar.serving()
    reader_id = _known_reader(sidecar, request)
    body = await replies.json_body(request)
    epoch = protocol.require_int(body, "epoch", minimum=0)
    position = protocol.require_int(body, "position", minimum=0)
    sidecar.registry.move(reader_id, epoch=epoch, position=position)
    await sidecar.blocking(node.update_reader, reader_id, epoch=epoch, position=position)
    return replies.json_response({"reader": reader_id, "epoch": epoch, "position": position})


@ROUTES.post(protocol.acquire_path("{reader_id}"))
async def post_acquire(request: web.Request) -> web.Response:
    sidecar = request.app[lifecycle.SIDECAR]
    settings = sidecar.settings
    call = await _shard_call(sidecar, request)
    node, reader_id, shard = call.node, call.reader_id, call.shard
    wanted = protocol.optional_float(call.body, "timeout_s")
    timeout = settings.acquire_timeout if wanted is None else min(wanted, settings.acquire_timeout)
    await _follow(sidecar, call)
    entry = await sidecar.acquire(node, shard, timeout)
    if sidecar.registry.get(reader_id) is None:
        # Unregistered while we waited: nobody will take this over.
        entry.release()
        raise replies.RequestError(
            409,
            protocol.KIND_INPUT,
            protocol.CODE_UNKNOWN_READER,
            f"reader {reader_id!r} was unregistered",
        )
    hold = sidecar.registry.hold(reader_id, shard, entry)
    memory_dir = settings.memory_dir
    lock = entry.path.with_name(entry.key + names.LOCK_SUFFIX)
    return replies.json_response(
        {
            "lease": hold.lease_id,
            "shard": shard,
            "path": entry.path.relative_to(memory_dir).as_posix(),
            "lock": lock.relative_to(memory_dir).as_posix(),
            "size": entry.size,
            "memory_dir": str(memory_dir),
            "handoff_timeout_s": settings.handoff_timeout,
            # The client may pin this entry again later without asking (POST
            # .../pinned instead) only if a lookup here would check no more than
            # the client's pin does: the lock, the file and its size.
            "reuse": node.memory.verify == "never",
        }
    )


@ROUTES.post(protocol.pinned_path("{reader_id}"))
async def post_pinned(request: web.Request) -> web.Response:
    """The reader pinned shard S itself, from an entry an earlier acquire handed it.

    The client's warm path (the `reuse` fast path of docs/wire-format.md): no hold,
    no lookup here; only what an acquire would have done besides leasing: move the
    reader, so prefetch follows it, and count the memory-tier hit.
    """
    sidecar = request.app[lifecycle.SIDECAR]
    call = await _shard_call(sidecar, request)
    await _follow(sidecar, call)
    call.node.note_reuse(call.shard)
    return replies.json_response(
        {
            "reader": call.reader_id,
            "shard": call.shard,
            "epoch": call.epoch,
            "position": call.position,
        }
    )


@ROUTES.delete(protocol.lease_path("{lease_id}"))
async def delete_lease(request: web.Request) -> web.Response:
    sidecar = request.app[lifecycle.SIDECAR]
    lease_id = request.match_info["lease_id"]
    hold = sidecar.registry.drop(lease_id)
    if hold is not None:
        hold.lease.release()
    return replies.json_response({"lease": lease_id, "released": hold is not None})


@dataclasses.dataclass(frozen=True)
class _ShardCall:
    node: caches.CacheNode
    reader_id: str
    body: dict[str, Any]
    shard: int
    epoch: int
    position: int


async def _shard_call(sidecar: lifecycle.Sidecar, request: web.Request) -> _ShardCall:
    """A reader's request about one shard, checked: known reader, shard in range."""
    node = sidecar.serving()
    reader_id = _known_reader(sidecar, request)
    body = await replies.json_body(request)
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


async def _follow(sidecar: lifecycle.Sidecar, call: _ShardCall) -> None:
    """Move the reader to where the call says it is, so prefetch follows it."""
    sidecar.registry.move(call.reader_id, epoch=call.epoch, position=call.position)
    await sidecar.blocking(
        call.node.update_reader, call.reader_id, epoch=call.epoch, position=call.position
    )


def _known_reader(sidecar: lifecycle.Sidecar, request: web.Request) -> str:
    reader_id = protocol.check_reader_id(request.match_info["reader_id"])
    if sidecar.registry.get(reader_id) is None:
        raise replies.RequestError(
            404,
            protocol.KIND_INPUT,
            protocol.CODE_UNKNOWN_READER,
            f"unknown reader {reader_id!r}: register it with PUT {protocol.reader_path(reader_id)}",
        )
    return reader_id


def _check_shard(node: caches.CacheNode, shard: int) -> None:
    n = len(node.manifest.shards)
    if not 0 <= shard < n:
        raise replies.RequestError(
            400,
            protocol.KIND_INPUT,
            protocol.CODE_UNKNOWN_SHARD,
            f"shard index {shard} is out of range: the manifest has {n} shards (0..{n - 1})",
        )
