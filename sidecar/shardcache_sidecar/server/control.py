"""The control API on the Unix socket (docs/wire-format.md, `shardcache.contract.protocol`).

    GET    /v1/manifest                  the pinned manifest
    GET    /v1/status                    readers, holds, cache stats, readiness
    PUT    /v1/readers/{id}              register (or move) a reader's plan
    DELETE /v1/readers/{id}              unregister it, releasing its holds
    POST   /v1/readers/{id}/position     where the reader is now
    POST   /v1/readers/{id}/acquire      lease a shard, blocking until it is resident
    POST   /v1/readers/{id}/pinned       the reader pinned a shard itself (warm path)
    POST   /v1/readers/{id}/notes        pinned shards and dropped holds, batched
    DELETE /v1/leases/{id}               release a hold the reader did not take over

Every route but /v1/status is a `routing.Route` in `TABLE`: a call of (sidecar, the
path's id, the raw body) answering a `replies.Answer`, served by both transports of the
socket:
`socket_server`'s own HTTP/1.1 protocol (the hot path: no aiohttp request machinery)
and aiohttp's (`ROUTES`, the same calls: anything the lean protocol hands over).

Handlers are thin: they parse the request, call the `CacheNode` and shape the answer.
What cannot block runs on the event loop (moving or forgetting a reader, a lookup of a
resident shard): a hop to a thread and back cost more than the call. What can (a fetch, an
acquire that waits for room, a plan computed for a new reader) runs in the sidecar's
thread pool (`lifecycle.Sidecar.blocking`, `lifecycle.Sidecar.acquire`). Errors are raised
(`replies.RequestError`, `errors.InputError`, ...) and become JSON bodies with a `kind`
in the server's middleware; bad input gets a 4xx and the sidecar keeps serving
everyone else.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from shardcache import uris
from shardcache.contract import protocol
from shardcache.node import caches, names, tiers
from shardcache_sidecar import readers
from shardcache_sidecar.server import lifecycle, replies, routing

# The logger name the sidecar's logs carried before the server was split.
log = logging.getLogger("shardcache_sidecar.server")

ROUTES = web.RouteTableDef()


async def get_manifest(sidecar: lifecycle.Sidecar, _: str, raw: bytes) -> replies.Answer:
    sidecar.serving()
    # Encoded once when the manifest was pinned: the same bytes for every open.
    return replies.Answer(sidecar.manifest_body)


@ROUTES.get(protocol.STATUS)
async def get_status(request: web.Request) -> web.Response:
    sidecar = request.app[lifecycle.SIDECAR]
    # What it shows is exact, not up to a check interval old.
    sidecar.drop_dead_readers()
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
                    # The order of the position shown (`seq`): a client's counter of
                    # its reader's moves is comparable with it when a position looks stale.
                    protocol.SEQ_FIELD: r.seq,
                    protocol.READER_LOCK_FIELD: r.locked,
                    # What a reader stuck in an acquire waits on, and since when.
                    "waiting": sidecar.reader_waits(r),
                }
                for r in sidecar.registry.readers()
            ],
            "readers_dropped_dead": sidecar.readers_dropped_dead,
            "holds": len(sidecar.registry.holds()),
            "stats": None if stats is None else dataclasses.asdict(stats),
            "ready": sidecar.readiness.report(),
            "startup": sidecar.startup,
            "memory_tier": None if sidecar.backing is None else sidecar.backing.to_json(),
        }
    )


async def put_reader(sidecar: lifecycle.Sidecar, reader_id: str, raw: bytes) -> replies.Answer:
    node = sidecar.serving()
    reader_id = protocol.check_reader_id(reader_id)
    body = replies.json_object(raw)
    params = protocol.params_from_json(body)
    position = protocol.require_int(body, "position", minimum=0)
    claims_lock = protocol.optional_bool(body, protocol.READER_LOCK_FIELD)
    skips_handed = protocol.optional_bool(body, protocol.SKIP_HANDED_FIELD)
    seq = protocol.optional_seq(body)
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
        node.unregister_reader(startup)
    if sidecar.registry.get(reader_id) is None and sidecar.registry.locked_at_rank(params.rank):
        # A rank restarted after a crash registers a new reader: the dead one goes
        # first, so it neither counts in the new one's share of the memory tier nor
        # keeps the fill on its plan. Only for a rank a locked reader reads already:
        # K ranks opening at once each tried every other's lock (K^2 / 2 probes of
        # four system calls, a quarter of a registration's CPU at K=16), and the
        # check every second finds the dead readers of other ranks.
        sidecar.drop_dead_readers()
    locked = claims_lock and sidecar.reader_lock_seen(reader_id)
    change = sidecar.registry.register(reader_id, params, position, locked=locked, seq=seq)
    reader = sidecar.registry.get(reader_id)
    assert reader is not None
    # Where the reader is now: a registration older than a position applied since
    # (`seq`) leaves it there.
    params, position = reader.params, reader.position
    if skips_handed:
        sidecar.handed.opt_in(reader_id, len(sidecar.manifest.shards))
    else:
        sidecar.handed.forget(reader_id)
    move: Callable[[], None]
    if change is readers.Change.UNCHANGED:
        move = functools.partial(
            node.update_reader, reader_id, epoch=params.epoch, position=position
        )
    else:
        move = functools.partial(node.register_reader, reader_id, params, position)
    if node.plan_is_cheap(params):
        # The epoch's order is made (the ranks of a job register together): slicing
        # it costs less than the hop to a thread and back.
        move()
    else:
        await sidecar.blocking(move)
    log.info(
        "reader %s %s",
        reader_id,
        change.value,
        extra={"reader": reader_id, **protocol.params_to_json(params), "position": position},
    )
    answer: dict[str, Any] = {
        "reader": reader_id,
        "change": change.value,
        "params": protocol.params_to_json(params),
        "position": position,
        "features": list(protocol.FEATURES),
    }
    ahead = min(protocol.optional_int(body, "ahead", minimum=0, default=0), protocol.MAX_AHEAD)
    if ahead and node.memory.verify == "never":
        # Feature `open_ahead`: the reader's first shards, as an acquire of the first
        # would grant them, so a warm open needs no acquire round trip.
        upcoming = node.upcoming(reader_id, min(ahead, node.settings.prefetch_depth) + 1)
        held = node.held_at(reader_id)
        if held is not None:
            # A sample-mode reader's current and next windows only: pins of a later
            # window's shards would be held beside those (`_grant_ahead`).
            upcoming = [s for s in upcoming if s in held]
        answer["reuse"] = True
        skip = sidecar.handed.of(reader_id)
        answer["ahead"] = [
            _handover(sidecar, reader_id, s, e, reuse=True)
            for s, e in _grant(sidecar, node, upcoming, skip=skip)
        ]
    return replies.answer(answer)


async def delete_reader(sidecar: lifecycle.Sidecar, reader_id: str, raw: bytes) -> replies.Answer:
    reader_id = protocol.check_reader_id(reader_id)
    reader, holds = sidecar.forget_reader(reader_id)
    if reader is not None and sidecar.node is not None:
        log.info("reader %s unregistered", reader_id, extra={"reader": reader_id})
    return replies.answer(
        {"reader": reader_id, "removed": reader is not None, "released_leases": len(holds)}
    )


async def post_position(sidecar: lifecycle.Sidecar, reader_id: str, raw: bytes) -> replies.Answer:
    node = sidecar.serving()
    reader_id = _known_reader(sidecar, reader_id)
    body = replies.json_object(raw)
    epoch, position = await _follow(
        sidecar,
        node,
        reader_id,
        protocol.require_int(body, "epoch", minimum=0),
        protocol.require_int(body, "position", minimum=0),
        protocol.optional_seq(body),
    )
    return replies.answer({"reader": reader_id, "epoch": epoch, "position": position})


async def post_acquire(sidecar: lifecycle.Sidecar, reader_id: str, raw: bytes) -> replies.Answer:
    settings = sidecar.settings
    call = _shard_call(sidecar, reader_id, raw)
    node, reader_id, shard = call.node, call.reader_id, call.shard
    wanted = protocol.optional_float(call.body, "timeout_s")
    timeout = settings.acquire_timeout if wanted is None else min(wanted, settings.acquire_timeout)
    ahead = min(protocol.optional_int(call.body, "ahead", minimum=0, default=0), protocol.MAX_AHEAD)
    await _follow(sidecar, call.node, call.reader_id, call.epoch, call.position, call.seq)
    # A resident shard is leased here at once; only a miss waits in the thread pool. A
    # lookup here checks the lock, the files and the size: a memory tier that hashed
    # its entries on every lookup would do it in the thread pool instead.
    looked = node.memory.verify == "never"
    entry = node.lookup(shard) if looked else None
    if entry is None:
        started = time.monotonic()
        entry = await sidecar.acquire(node, shard, timeout, reader_id=reader_id, missed=looked)
        sidecar.tuner.missed(reader_id, time.monotonic() - started)
    sidecar.tuner.sized(entry.size)
    if sidecar.registry.get(reader_id) is None:
        # Unregistered while we waited: nobody will take this over.
        entry.release()
        raise replies.RequestError(
            409,
            protocol.KIND_INPUT,
            protocol.CODE_UNKNOWN_READER,
            f"reader {reader_id!r} was unregistered",
        )
    answer = _handover(sidecar, reader_id, shard, entry)
    answer["memory_dir"] = str(settings.memory_dir)
    answer["handoff_timeout_s"] = settings.handoff_timeout
    # The client may pin this entry again later without asking (POST .../pinned
    # instead) only if a lookup here would check no more than the client's pin does:
    # the lock, the file and its size.
    answer["reuse"] = reuse = node.memory.verify == "never"
    if reuse:
        sidecar.handed.mark(reader_id, shard)
    if ahead and reuse:
        answer["ahead"] = [
            _handover(sidecar, reader_id, s, e, reuse=True)
            for s, e in _grant_ahead(sidecar, node, reader_id, entry, shard, ahead)
        ]
    return replies.answer(answer)


def _handover(
    sidecar: lifecycle.Sidecar,
    reader_id: str,
    shard: int,
    entry: tiers.Entry,
    *,
    reuse: bool = False,
) -> dict[str, Any]:
    """Hold `entry` for the reader until it takes it over; what the answer says of it.
    `reuse`: the answer lets the client pin the entry again itself (`skip_handed`)."""
    hold = sidecar.registry.hold(reader_id, shard, entry)
    if reuse:
        sidecar.handed.mark(reader_id, shard)
    # A memory-tier entry is the file named by its key in the memory directory, its
    # lock file beside it (`tiers`); pathlib's relative_to cost more than the rest.
    return {
        "lease": hold.lease_id,
        "shard": shard,
        "path": entry.key,
        "lock": entry.key + names.LOCK_SUFFIX,
        "size": entry.size,
    }


def _grant_ahead(
    sidecar: lifecycle.Sidecar,
    node: caches.CacheNode,
    reader_id: str,
    acquired: tiers.Entry,
    shard: int,
    count: int,
) -> list[tuple[int, tiers.Entry]]:
    """Leases on the reader's next shards after `shard`, as far as they are resident.

    They save the reader a round trip per shard; it pins them at once (its own locks,
    dropped when it closes the reader or dies). Stops at the first shard that is not
    resident: the grants are the next shards in plan order, with no gap.

    Pins granted ahead must never take the room that keeps readers going, or a reader
    waits for room another one holds for later (a rank blocked in a collective with the
    waiting one never gets there: a deadlock until the acquire times out). So the
    memory tier first keeps room for two shards per registered reader (the one it reads
    and the next) and for the startup shards a restarted sidecar warms; what is left,
    shared among the readers, bounds one answer's grants, besides the prefetch depth.
    Shards are taken to be the size of the acquired one.

    None for a sample-mode reader: it leases the shards of the window its caller reads
    and the next, and pins granted ahead would be shards of the windows after them,
    held beside those (`windows.held_at`, the memory tier's check of the readers'
    windows); a window's few shards cost it a round trip each.
    """
    if node.samples(reader_id):
        return []
    limit = min(count, node.settings.prefetch_depth)
    skip = sidecar.handed.of(reader_id)
    # Shards handed before are passed over, not granted (`skip_handed`): look past
    # them, up to `MAX_AHEAD` shards further, for `limit` the reader would have to
    # ask for, so that its next round trip is as far off as without them.
    reach = limit + 1 if skip is None else limit + 1 + protocol.MAX_AHEAD
    upcoming = node.upcoming(reader_id, reach)
    if not upcoming or upcoming[0] != shard:
        # Not where the reader's plan says it is (a tool, a test, a plan moved under
        # it): "the next shards" would be a guess.
        return []
    return _grant(sidecar, node, upcoming[1:], acquired.size, skip=skip, most=limit)


def _grant(
    sidecar: lifecycle.Sidecar,
    node: caches.CacheNode,
    shards: list[int],
    shard_size: int | None = None,
    *,
    skip: bytearray | None = None,
    most: int | None = None,
) -> list[tuple[int, tiers.Entry]]:
    """Leases on `shards`, in order, as far as they are resident and within the budget
    `_grant_ahead` explains, at most `most` of them (default: all); shards are taken to
    be `shard_size` bytes (default: the first one's).

    Leaves out the shards marked in `skip` (`handed`: the reader's client pins those
    again itself) without a lookup: whether one is still resident is the client's pin
    to find out, and it asks for the shard if not. So the grants may have gaps there."""
    granted: list[tuple[int, tiers.Entry]] = []
    budget: int | None = None
    for next_shard in shards:
        if most is not None and len(granted) >= most:
            break
        if skip is not None and skip[next_shard]:
            continue
        entry = node.lookup(next_shard, count=False)
        if entry is None:
            break
        if budget is None:
            readers = max(1, len(sidecar.registry))
            size = entry.size if shard_size is None else shard_size
            kept = (2 * readers + sidecar.settings.ready_shards) * max(1, size)
            budget = (node.settings.memory_limit - kept) // readers
        if entry.size > budget:
            entry.release()
            break
        budget -= entry.size
        granted.append((next_shard, entry))
    return granted


async def post_pinned(sidecar: lifecycle.Sidecar, reader_id: str, raw: bytes) -> replies.Answer:
    """The reader pinned shard S itself, from an entry an earlier acquire handed it.

    The client's warm path (the `reuse` fast path of docs/wire-format.md): no hold,
    no lookup here; only what an acquire would have done besides leasing: move the
    reader, so prefetch follows it, and count the memory-tier hit.
    """
    call = _shard_call(sidecar, reader_id, raw)
    epoch, position = await _follow(
        sidecar, call.node, call.reader_id, call.epoch, call.position, call.seq
    )
    call.node.note_reuse((call.shard,))
    return replies.answer(
        {"reader": call.reader_id, "shard": call.shard, "epoch": epoch, "position": position}
    )


async def post_notes(sidecar: lifecycle.Sidecar, reader_id: str, raw: bytes) -> replies.Answer:
    """What a reader did without asking, batched: the shards it pinned itself (each as
    a `pinned` call) and the holds it no longer needs (each as a lease release), then
    where it is now. One request for what were several, sent off the read path.

    A batch built before a request that reached the sidecar first (`seq`) moves the
    reader nowhere; its shards and holds are applied all the same."""
    node = sidecar.serving()
    reader_id = _known_reader(sidecar, reader_id)
    body = replies.json_object(raw)
    epoch = protocol.require_int(body, "epoch", minimum=0)
    position = protocol.require_int(body, "position", minimum=0)
    seq = protocol.optional_seq(body)
    pinned = protocol.int_list(body, "pinned")
    released = protocol.lease_list(body, "released")
    stalls = protocol.stalls_from_json(body)
    node.check_shards(pinned)
    dropped = 0
    for lease_id in released:
        hold = sidecar.registry.drop(lease_id)
        if hold is not None:
            hold.lease.release()
            dropped += 1
    epoch, position = await _follow(sidecar, node, reader_id, epoch, position, seq)
    node.note_reuse(pinned)
    if stalls is not None:
        reader = sidecar.registry.get(reader_id)
        waited, stepped = sidecar.registry.report_stalls(reader_id, stalls)
        if reader is not None:
            sidecar.metrics.stalled(reader.params.rank, waited, stepped)
            sidecar.tuner.reported(reader, stalls, node=node, registered=sidecar.registry.readers())
    # json.dumps's bytes for these five fields, without its walk of a dict: about half
    # of a warm pass's requests are notes. The id matched `READER_ID_PATTERN` when the
    # reader registered (nothing to escape), and the rest are ints.
    return replies.Answer(
        b'{"reader": "%s", "epoch": %d, "position": %d, "pinned": %d, "released": %d}'
        % (reader_id.encode(), epoch, position, len(pinned), dropped)
    )


async def delete_lease(sidecar: lifecycle.Sidecar, lease_id: str, raw: bytes) -> replies.Answer:
    hold = sidecar.registry.drop(lease_id)
    if hold is not None:
        hold.lease.release()
    return replies.answer({"lease": lease_id, "released": hold is not None})


@dataclasses.dataclass(frozen=True)
class _ShardCall:
    node: caches.CacheNode
    reader_id: str
    body: dict[str, Any]
    shard: int
    epoch: int
    position: int
    seq: int | None


def _shard_call(sidecar: lifecycle.Sidecar, reader_id: str, raw: bytes) -> _ShardCall:
    """A reader's request about one shard, checked: known reader, shard in range."""
    node = sidecar.serving()
    reader_id = _known_reader(sidecar, reader_id)
    body = replies.json_object(raw)
    call = _ShardCall(
        node=node,
        reader_id=reader_id,
        body=body,
        shard=protocol.require_int(body, "shard"),
        epoch=protocol.require_int(body, "epoch", minimum=0),
        position=protocol.require_int(body, "position", minimum=0),
        seq=protocol.optional_seq(body),
    )
    node.check_shards((call.shard,))
    return call


async def _follow(
    sidecar: lifecycle.Sidecar,
    node: caches.CacheNode,
    reader_id: str,
    epoch: int,
    position: int,
    seq: int | None,
) -> tuple[int, int]:
    """Move the reader to where the call says it is, so prefetch follows it; the epoch
    and position it is at then.

    Not when the call's position is older than one applied already (`seq`,
    `protocol.FEATURE_SEQ`): the client built it first but it arrived after (a batch of
    notes goes on the client's notifier thread, a position call on the trainer's), and
    applying it moved prefetch and the status back until the reader's next call.

    On the event loop, unless the reader enters an epoch whose global order nobody made
    yet: computing it for a large manifest takes long enough to stall other readers.
    (The first rank of a job to get there makes it in the thread pool; the others slice
    it, which costs less than the hop.)"""
    reader = sidecar.registry.get(reader_id)
    if reader is not None and reader.behind(seq):
        return reader.params.epoch, reader.position
    new_epoch = reader is None or reader.params.epoch != epoch
    sidecar.registry.move(reader_id, epoch=epoch, position=position, seq=seq)
    if new_epoch and (reader is None or not node.plan_is_cheap(reader.params.with_epoch(epoch))):
        await sidecar.blocking(node.update_reader, reader_id, epoch=epoch, position=position)
    else:
        node.update_reader(reader_id, epoch=epoch, position=position)
    return epoch, position


def _known_reader(sidecar: lifecycle.Sidecar, reader_id: str) -> str:
    if sidecar.registry.get(reader_id) is not None:
        return reader_id  # checked when it registered
    reader_id = protocol.check_reader_id(reader_id)
    if sidecar.registry.get(reader_id) is None:
        raise replies.RequestError(
            404,
            protocol.KIND_INPUT,
            protocol.CODE_UNKNOWN_READER,
            f"unknown reader {reader_id!r}: register it with PUT {protocol.reader_path(reader_id)}",
        )
    return reader_id


#: Every route both transports serve: all of the control API but /v1/status (whose
#: answer counts the tiers' files in a thread: never hot). The lean transport matches a
#: request against these exactly and hands anything else to aiohttp.
TABLE: tuple[routing.Route, ...] = (
    routing.Route("GET", protocol.MANIFEST, get_manifest),
    routing.Route("PUT", protocol.reader_path("{reader_id}"), put_reader),
    routing.Route("DELETE", protocol.reader_path("{reader_id}"), delete_reader),
    routing.Route("POST", protocol.position_path("{reader_id}"), post_position),
    routing.Route("POST", protocol.acquire_path("{reader_id}"), post_acquire),
    routing.Route("POST", protocol.pinned_path("{reader_id}"), post_pinned),
    routing.Route("POST", protocol.notes_path("{reader_id}"), post_notes),
    routing.Route("DELETE", protocol.lease_path("{lease_id}"), delete_lease),
)


routing.add(ROUTES, TABLE)
