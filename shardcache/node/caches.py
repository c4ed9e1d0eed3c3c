"""The node cache: source → disk tier → decode → memory tier, with a prefetcher.

One `CacheNode` serves every reader of one dataset in a process: the sidecar, or the
trainer itself in embedded mode. Readers register their plan; the prefetcher reads
ahead along it with bounded concurrency; `acquire` blocks until a shard is resident in
the memory tier and returns a lease on it. Blocking and thread-based, so the sidecar
calls it from an executor and embedded mode calls it directly.

The prefetcher's fetch threads take the most urgent shard wanted (`work_queues`): each
reader's next shards up to its depth, then the rest of every registered reader's epoch,
round robin over the readers (the fill, `fill_orders`), as far as the memory tier has
room for it beside a wave of readahead. Only registered readers' plans: a sidecar
serving one rank of many never fetches the others'. Each shard's pass through the cold
path is stamped for benchmarks when the timeline logger listens (`timelines`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import copy
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import pyarrow as pa
import pyarrow.fs as pafs

from shardcache import (
    errors,
    faultpoints,
    formats,
    manifests,
    plans,
    source,
    source_credentials,
    uris,
    windows,
)
from shardcache.contract import variables
from shardcache.node import (
    after_fork,
    decode_budgets,
    epoch_plans,
    fill_orders,
    quotas,
    tiers,
    timelines,
    volume_cycles,
    window_claims,
    work_queues,
)

log = logging.getLogger(__name__)

GiB = 1 << 30
#: Most bytes a byte of JSON Lines text decodes to: a digit and its comma ("0,") to an
#: 8-byte number is 4; twice that for margin. What its decode may take (`_decode`).
_TEXT_EXPANSION = 8
#: Decoded bytes per source byte the fill assumes before the first shard is decoded
#: (Parquet tokens compress 2-3 times); after that, the largest ratio seen. Only sizes
#: how many shards the fill queues: each decode checks the exact size against the room.
_FIRST_EXPANSION = 4.0
#: Shards queued for the fetch threads, per thread, below which the fill tops the queue
#: up: enough that a thread never waits for the next, few enough that the room the fill
#: counted on is checked again soon.
_FILL_AHEAD_PER_THREAD = 2
#: An epoch order of at most this many shards is one permutation cheap enough to make on
#: the event loop (`plan_is_cheap`)...
_CHEAP_ORDER_SHARDS = 1024
#: ...when a rank's share is at most this many blocks on average: their runs are made
#: for the rank's plan, at 2-3 us a block here (6 shards of 42 blocks, 0.33-0.51 ms;
#: 64 shards of one block, 0.20 ms). It was 8 shards, which sent a rank of a manifest of
#: many small shards through the thread pool, whose hop cost more than the plan (about
#: 0.47 ms of sidecar CPU against 0.20, `bench.node_requests`, "position (a new epoch)").
_CHEAP_RANK_BLOCKS = 8 * 42
#: Seconds an acquire waits for room while the sample-mode readers' current and next
#: windows cannot all be resident before it gives up (`_window_room_check`): long enough
#: that a reader's position, which the sidecar learns at its next request, is not stale.
_WINDOW_ROOM_GRACE_S = 2.0
#: How long a metrics scrape waits for a tier's lock to read its size: within a
#: scraper's timeout (Prometheus: 10 s), so that a lock held by a stopped process
#: shows as the tier unusable (`NodeStats.tier_errors`) instead of no answer at all.
STATS_LOCK_TIMEOUT_S = 2.0


@dataclasses.dataclass(frozen=True)
class NodeSettings:
    disk_dir: Path
    memory_dir: Path
    #: Bytes of source shards kept on the node's disk; shared by every pod on the node.
    disk_limit: int = variables.DISK_LIMIT.required_default
    #: Bytes of decoded shards in the memory tier. Not the sidecar's default (the
    #: contract's): in-process on a laptop or notebook there is no pod memory limit to
    #: share, and 4 GiB holds a few 1 GiB shards ahead of a reader.
    memory_limit: int = 4 * GiB
    #: Shards decoded ahead of each reader (the contract's default, and its reason).
    prefetch_depth: int = variables.PREFETCH_DEPTH.required_default
    #: Concurrent source fetches + decodes. Decoding takes a core each. 0 (the
    #: contract's default): sized from the container's CPU quota and memory limit
    #: (`quotas.fetch_concurrency`), never from the host's core count.
    fetch_concurrency: int = variables.FETCH_CONCURRENCY.required_default
    retry: source.RetryPolicy = dataclasses.field(default_factory=source.RetryPolicy)
    #: Longest an acquire waits for room in a full memory tier (seconds).
    wait_timeout: float = 300.0
    #: This process is the only one that commits or evicts memory-tier entries (the
    #: sidecar, on its pod's own volume; trainers only lease them): the tier answers
    #: membership from memory, not with `stat` calls on the sidecar's event loop
    #: (`tiers._membership`). False in embedded mode, where processes may share a dir.
    memory_sole_writer: bool = False


class NodeObserver(tiers.TierObserver, Protocol):
    def fetched(self, nbytes: int, seconds: float) -> None: ...

    def reused(self, tier: str, count: int) -> None:
        """`count` hits in `tier` that readers took without a lookup (`note_reuse`)."""
        ...

    def fetch_failed(self, shard: int, error: BaseException) -> None:
        """A fetch of `shard` a reader waited on (an acquire, the warm-up, or a
        readahead or fill an acquire joined) failed after its retries."""
        ...

    def readahead_failed(self, shard: int, error: BaseException) -> None:
        """A fetch of `shard` for the readahead or the fill that no reader waited on
        failed after its retries: the reader's own acquire fetches it again, and that
        one counts as `fetch_failed` if it fails too."""
        ...


#: Where an attempt to make a shard resident is (`_Attempt.stage`), and what that means
#: to a person reading a timeout or /v1/status: what the shard waits on.
STAGES = {
    "slot": "waiting for a fetch slot (every one is busy with another shard)",
    "disk": "reading its source bytes from the node disk tier (or waiting while another "
    "process fetches them into it)",
    "fetch": "fetching its source bytes from the store",
    "decode_budget": "waiting for memory to decode it in (other decodes hold the budget)",
    "decode": "decoding it",
    "insert": "writing it to the memory tier",
    "room": "waiting for room in the memory tier (readers lease what fills it)",
}


def utc_text(wall: float) -> str:
    """A `time.time()` as /v1/status and errors show it (ISO 8601, UTC)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(wall))


@dataclasses.dataclass(frozen=True)
class FetchFailure:
    """The last shard fetch that failed after its retries (`NodeStats.last_fetch_error`):
    a count alone says something broke, not which shard or why."""

    shard: int
    path: str
    error: str
    #: When, UTC (ISO 8601).
    at: str


@dataclasses.dataclass(frozen=True)
class VolumeCycle:
    """The last acquire failed on the memory volume's cycle (`NodeStats.last_volume_cycle`):
    what the reader was told, so /v1/status shows it after the rank exited."""

    error: str
    #: When, UTC (ISO 8601).
    at: str


@dataclasses.dataclass
class NodeStats:
    disk_resident_bytes: int = 0
    #: What bounds the disk tier's directory: the largest limit of the live sidecars
    #: sharing it (`tiers.Tier.bound_bytes`), which every insert counts against; it was
    #: this process's own limit until 2026-11-28, below the resident bytes whenever a
    #: mount with a larger `cache.disk` shared the node's tier.
    disk_limit_bytes: int = 0
    #: This process's own disk limit (the mount's `cache.disk`, clamped to the volume).
    disk_own_limit_bytes: int = 0
    memory_resident_bytes: int = 0
    memory_limit_bytes: int = 0
    #: What the sample-mode readers' current and next windows take of the memory tier
    #: at once, each shard once (`CacheNode.window_need`, other processes' claims on a
    #: shared tier included): the memory limit must hold it.
    sample_windows_bytes: int = 0
    readers: int = 0
    fetches: int = 0
    fetched_bytes: int = 0
    fetch_seconds: float = 0.0
    #: Failed fetches a reader waited on (`NodeObserver.fetch_failed`): one per
    #: failed fetch of a shard that an acquire (or the warm-up) needed.
    fetch_failures: int = 0
    #: Failed fetches of the readahead and the fill that no reader waited on
    #: (`NodeObserver.readahead_failed`): not in `fetch_failures`, which counted one
    #: missing shard three times and more with them.
    readahead_failures: int = 0
    #: The last failed fetch, whoever made it (the readahead's too): the reason.
    last_fetch_error: FetchFailure | None = None
    #: Acquires failed because the readers themselves held the memory volume's
    #: missing room (`CacheNode._volume_cycle_check`): each such acquire once.
    volume_cycles: int = 0
    #: The last of those: the error the reader got, and when (UTC, ISO 8601).
    last_volume_cycle: VolumeCycle | None = None
    hits: dict[str, int] = dataclasses.field(default_factory=lambda: {"disk": 0, "memory": 0})
    misses: dict[str, int] = dataclasses.field(default_factory=lambda: {"disk": 0, "memory": 0})
    evictions: dict[str, int] = dataclasses.field(default_factory=lambda: {"disk": 0, "memory": 0})
    evicted_bytes: dict[str, int] = dataclasses.field(
        default_factory=lambda: {"disk": 0, "memory": 0}
    )
    corrupted: dict[str, int] = dataclasses.field(default_factory=lambda: {"disk": 0, "memory": 0})
    #: Tiers whose size could not be read, by name, with the error (its resident bytes
    #: are then 0 here, unknown in fact): e.g. a directory made unwritable under a
    #: running sidecar, where even the tier lock cannot be opened.
    tier_errors: dict[str, str] = dataclasses.field(default_factory=dict)


class _Counting:
    """Keeps NodeStats and forwards every event to an outer observer (metrics)."""

    def __init__(self, outer: NodeObserver | None, paths: Sequence[str] = ()) -> None:
        self.stats = NodeStats()
        self._outer = outer
        self._lock = threading.Lock()
        #: Each shard's path in the manifest, to name a failed one.
        self._paths = paths

    def forked(self) -> None:
        """In a forked child: a lock of its own (a parent's thread may have held it)."""
        self._lock = threading.Lock()

    def snapshot(self) -> NodeStats:
        """A copy the caller may read while fetch threads keep counting."""
        with self._lock:
            return copy.deepcopy(self.stats)

    def hit(self, tier: str) -> None:
        with self._lock:
            self.stats.hits[tier] = self.stats.hits.get(tier, 0) + 1
        if self._outer:
            self._outer.hit(tier)

    def miss(self, tier: str) -> None:
        with self._lock:
            self.stats.misses[tier] = self.stats.misses.get(tier, 0) + 1
        if self._outer:
            self._outer.miss(tier)

    def evicted(self, tier: str, nbytes: int) -> None:
        with self._lock:
            self.stats.evictions[tier] = self.stats.evictions.get(tier, 0) + 1
            self.stats.evicted_bytes[tier] = self.stats.evicted_bytes.get(tier, 0) + nbytes
        if self._outer:
            self._outer.evicted(tier, nbytes)

    def corrupted(self, tier: str, key: str) -> None:
        with self._lock:
            self.stats.corrupted[tier] = self.stats.corrupted.get(tier, 0) + 1
        if self._outer:
            self._outer.corrupted(tier, key)

    def reused(self, tier: str, count: int) -> None:
        with self._lock:
            self.stats.hits[tier] = self.stats.hits.get(tier, 0) + count
        if self._outer:
            self._outer.reused(tier, count)

    def fetched(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.stats.fetches += 1
            self.stats.fetched_bytes += nbytes
            self.stats.fetch_seconds += seconds
        if self._outer:
            self._outer.fetched(nbytes, seconds)

    def fetch_failed(self, shard: int, error: BaseException) -> None:
        self._failed(shard, error)
        if self._outer:
            self._outer.fetch_failed(shard, error)

    def readahead_failed(self, shard: int, error: BaseException) -> None:
        self._failed(shard, error, ahead=True)
        if self._outer:
            self._outer.readahead_failed(shard, error)

    def volume_cycle(self, error: str) -> None:
        with self._lock:
            self.stats.volume_cycles += 1
            self.stats.last_volume_cycle = VolumeCycle(error, utc_text(time.time()))

    def _failed(self, shard: int, error: BaseException, *, ahead: bool = False) -> None:
        path = self._paths[shard] if 0 <= shard < len(self._paths) else ""
        failure = FetchFailure(shard, path, str(error), utc_text(time.time()))
        with self._lock:
            if ahead:
                self.stats.readahead_failures += 1
            else:
                self.stats.fetch_failures += 1
            self.stats.last_fetch_error = failure


@dataclasses.dataclass
class _Reader:
    params: plans.PlanParams
    #: Which shard the reader reads where (block mode): all the node reads ahead and
    #: grants along. None until first needed when made by `make_spans`
    #: (`planned(lazy=True)`).
    spans: plans.ShardSpans | None
    position: int
    #: Sample mode (plan version 2): the windows the reader meets, with their shards.
    plan_windows: list[windows.Window] = dataclasses.field(default_factory=list)
    window_ends: list[int] = dataclasses.field(default_factory=list)
    #: Shards read ahead of it when set (`CacheNode.set_prefetch_depth`); else the
    #: settings' depth.
    depth: int | None = None
    #: Makes `spans` when they are first asked for (`upcoming`).
    make_spans: Callable[[], plans.ShardSpans] | None = None

    def __post_init__(self) -> None:
        self.window_ends = windows.window_ends(self.plan_windows)

    @classmethod
    def planned(
        cls,
        manifest: manifests.Manifest,
        orders: epoch_plans.EpochPlans,
        params: plans.PlanParams,
        position: int,
        *,
        lazy: bool = False,
    ) -> _Reader:
        """The reader's plan; with `lazy`, made when first asked for (`upcoming`)
        instead of now (not for sample mode, whose windows are made now).

        Block mode keeps only the plan's shard spans, not its runs: the runs (each
        shard's blocks permuted, a `Run` per block) cost a registration most of its
        plan, and the node never reads a row (docs/benchmarks.md, "The registration
        request, session 27")."""
        if params.sampled:
            # A sample-mode reader holds every shard of its window while it gathers.
            wins = windows.rank_windows(manifest.shard_rows, manifest.digest, params)
            return cls(params, plans.ShardSpans([], []), position, plan_windows=wins)
        if lazy:
            return cls(
                params, None, position, make_spans=functools.partial(orders.rank_spans, params)
            )
        return cls(params, orders.rank_spans(params), position)

    def upcoming(self, count: int) -> list[int]:
        if self.params.sampled:
            return windows.next_shards(self.plan_windows, self.window_ends, self.position, count)
        spans = self.spans
        if spans is None:
            assert self.make_spans is not None
            spans = self.spans = self.make_spans()
        return spans.next(self.position, count)


class _Attempt:
    """One attempt in flight to make a shard resident, and the acquires waiting on it.

    Each waiting acquire is handed a lease of its own on what the attempt inserted,
    taken while the attempt's own lease still held it: between an insert that let go of
    it and a waiter's lookup, another reader's acquire could evict it, and the waiter
    then fetched and decoded it again. `wanting` counts the waiters still waiting (one
    that gave up takes itself off, or, once `settled`, the lease left for it);
    `leases` are the ones left for them. Both change under the node's lock.

    `why` began it and `stage` (a key of `STAGES`, since `stage_at`) is where it is:
    what an acquire that times out on it, and /v1/status, say it waits on. Written by
    the one thread running the attempt, read by anyone without the lock (each a single
    assignment)."""

    __slots__ = (
        "done",
        "fetch_error",
        "leases",
        "settled",
        "stage",
        "stage_at",
        "stage_wall",
        "started",
        "started_wall",
        "wanting",
        "why",
    )

    def __init__(self, why: str) -> None:
        self.done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.wanting = 0
        self.leases: list[tiers.Entry] = []
        self.settled = False
        self.why = why
        #: The attempt's fetch failed after its retries (`_disk_entry`): counted when
        #: it ends, once it is known whether a reader waited on it (`_count_failure`).
        self.fetch_error: BaseException | None = None
        self.started = self.stage_at = time.monotonic()
        self.started_wall = self.stage_wall = time.time()
        self.stage = "slot"

    def at(self, stage: str) -> None:
        if stage != self.stage:
            self.stage_at, self.stage_wall = time.monotonic(), time.time()
            self.stage = stage

    def to_json(self) -> dict[str, object]:
        """What /v1/status shows of it."""
        now = time.monotonic()
        return {
            "why": self.why,
            "started": utc_text(self.started_wall),
            "seconds": round(now - self.started, 3),
            "stage": self.stage,
            "stage_since": utc_text(self.stage_wall),
            "stage_seconds": round(now - self.stage_at, 3),
            "waiting_acquires": self.wanting,
        }


def _no_progress(stage: str) -> None:
    """Where a load not run for an attempt tells its stages: nowhere."""


class _Waited(Exception):
    """An acquire's wait for `attempt` ended at its deadline (`_await_attempt`); the
    acquire says what it waited on."""

    def __init__(self, attempt: _Attempt) -> None:
        super().__init__()
        self.attempt = attempt


def _reclaim_at_start(tier: tiers.Tier) -> None:
    """Remove what processes killed mid-write left in `tier` (`Tier.reclaim`): a data
    file without its meta file counts against the limit and no eviction takes it, so a
    node's disk tier shrank by one shard for every sidecar killed at the wrong moment.
    A tier that cannot be read now is left to the first insert to report."""
    try:
        removed, freed = tier.reclaim()
    except (OSError, errors.CacheError) as exc:
        log.info("%s tier %s: nothing reclaimed at start: %s", tier.name, tier.root, exc)
        return
    if removed:
        log.info(
            "%s tier %s: reclaimed %d files (%d bytes) left by processes killed mid-write",
            tier.name, tier.root, removed, freed,
        )  # fmt: skip


#: Why a disk-tier entry is in the way (`CacheNode._uncached`), before the tier's words.
_BAD_AND_KEPT = (
    "its entry there is another user's, fails its check against the manifest's sha256, "
    "and cannot be removed: "
)


class CacheNode:
    def __init__(
        self,
        manifest: manifests.Manifest,
        settings: NodeSettings,
        *,
        filesystem: pafs.FileSystem | None = None,
        storage_options: dict[str, str] | None = None,
        observer: NodeObserver | None = None,
        renewal: source_credentials.Renewable | None = None,
    ) -> None:
        self.manifest = manifest
        self.settings = settings
        if renewal is not None:
            filesystem = renewal.fs
        elif filesystem is None:
            filesystem, _ = source.filesystem(manifest.root, storage_options=storage_options)
        self._fs = filesystem
        #: Where a filesystem with other credentials comes from when the store refuses
        #: these (a key rotated in the sidecar's Secret); None: the refusal stands.
        self._renewal = renewal
        self._events = _Counting(observer, [s.path for s in manifest.shards])
        self.disk = tiers.Tier(
            settings.disk_dir,
            limit_bytes=settings.disk_limit,
            name="disk",
            fsync=True,
            # Sizes only: every hit is hashed against the manifest's sha256 instead
            # (`_intact`), not against the entry's meta file, which its writer wrote.
            verify="never",
            observer=self._events,
            wait_timeout=settings.wait_timeout,
        )
        # Memory-tier files are written by this code and never leave tmpfs: a full
        # checksum on every acquire would cost a pass over the data; sizes are checked.
        # Nor are they hashed on insert (`hashed=False`): nothing ever compares that
        # sha256, and hashing the decoded file (2-3 times the source's bytes) took a
        # fifth of a cold shard's time (docs/benchmarks.md, issue 14's cold path).
        self.memory = tiers.Tier(
            settings.memory_dir,
            limit_bytes=settings.memory_limit,
            name="memory",
            fsync=False,
            verify="never",
            hashed=False,
            observer=self._events,
            wait_timeout=settings.wait_timeout,
            sole_writer=settings.memory_sole_writer,
        )
        for tier in (self.disk, self.memory):
            _reclaim_at_start(tier)
        # Memory-tier keys by shard, computed once: a key is a sha256 of the shard's
        # identity, and the prefetcher looks up several at every request.
        self._memory_keys = [manifest.decoded_key(i) for i in range(len(manifest.shards))]
        #: The memory tier's `removals` when every shard was last found resident.
        self._all_resident_at: int | None = None
        self._lock = threading.Lock()
        #: Disk-tier keys served without caching them there (`_uncached`), said once each.
        self._uncached_keys: set[str] = set()
        self._inflight: dict[int, _Attempt] = {}
        self._readers: dict[str, _Reader] = {}
        #: Readers' acquires in progress: when they are as many as the readers, none
        #: can unmap what it holds of the memory volume (`_volume_cycle_check`).
        self._acquiring = 0
        #: Readers' acquires ended so far: progress that restarts a cycle's grace.
        self._acquires_ended = 0
        #: The epoch's global order, made once for all the readers that share it.
        self._orders = epoch_plans.EpochPlans(manifest.shard_rows, manifest.digest)
        quota = quotas.read()
        #: Bytes the decodes may hold at once (`decode_budgets.capacity`): the container's
        #: memory limit less the memory volume and the process, or the tier's limit.
        self._decode_room = quotas.decode_room(
            quota,
            volume_bytes=quotas.volume_bytes(
                settings.memory_limit,
                tmpfs_size=quotas.tmpfs_size(settings.memory_dir),
                memory_limit=quota.memory_limit,
            ),
            base=quotas.process_base(),
        )
        self._decode_capacity = decode_budgets.capacity(settings.memory_limit, self._decode_room)
        #: Fetches and decodes run at once: the setting, else sized from the quota, the
        #: largest shard's decoded size guessed from its source size (no metadata was
        #: read yet; each decode reserves its own peak, `_decode`).
        self.fetch_concurrency = settings.fetch_concurrency or quotas.fetch_concurrency(
            quota,
            decoded_bytes=quotas.FETCH_MEMORY_FACTOR
            * max((s.size for s in manifest.shards), default=0),
            room=self._decode_room,
        )
        #: What the fetch threads take from, most urgent first; the threads start with
        #: the first shard queued (`_enqueue`).
        self._queue = work_queues.WorkQueue()
        self._workers: list[threading.Thread] = []
        #: Each registered reader's epoch from where it registered or entered it (the
        #: epochs of its `fill_ranks` ranks, one list each).
        self._fill_plans: dict[str, list[list[int]]] = {}
        self._fill_ranks: dict[str, int] = {}
        #: Their fill not queued yet, round robin: (shard, index), in order.
        self._fill_rest: collections.deque[tuple[int, int]] = collections.deque()
        #: Source bytes of `_fill_rest`: whether the rest of the fill fits.
        self._fill_rest_bytes = 0
        self._fill_lock = threading.Lock()
        #: Largest decoded bytes per source byte seen: sizes the fill before a fetch.
        self._expansion_seen: float | None = None
        #: Decoded bytes of every shard decoded so far (kept after an eviction): what a
        #: sample-mode reader's window takes (`window_need`)...
        self._decoded_sizes: dict[int, int] = {}
        #: ...and, for a shard not decoded yet, its source bytes times the least
        #: decoded bytes per source byte seen.
        self._expansion_least: float | None = None
        self._largest_source = max((s.size for s in manifest.shards), default=0)
        self._working = threading.BoundedSemaphore(self.fetch_concurrency)
        self._decoding = self._decode_budget()
        self._warned_small_memory = False
        #: The last error reading each tier's size (`stats`), so it is logged once.
        self._tier_errors_seen: dict[str, str] = {}
        self._closed = False
        #: What the sample-mode readers hold, written for other processes sharing the
        #: memory tier (`window_claims`); a sole writer (the sidecar) has none.
        self._claims = (
            None if settings.memory_sole_writer else window_claims.Claims(settings.memory_dir)
        )
        #: The readers' held shards the claims say; what they were written from.
        self._claimed: dict[str, tuple[int, ...]] = {}
        self._claims_lock = threading.Lock()
        after_fork.register(self)

    def after_fork(self) -> None:
        """In a forked child (a DataLoader worker using the Dataset its parent opened):
        none of the parent's threads exist here, so what they held at the fork would be
        held forever: a lock, fetch slots and decode bytes, attempts in flight that
        nobody finishes (an acquire of one waited forever). The child starts its own,
        empty; what is resident stays, in the tiers both share (and the tiers' lock
        descriptors let go of the parent's locks, `_locks`)."""
        self._lock = threading.Lock()
        self._inflight = {}
        self._acquiring = 0
        self._acquires_ended = 0
        self._queue = work_queues.WorkQueue()
        self._workers = []
        self._fill_lock = threading.Lock()
        self._working = threading.BoundedSemaphore(self.fetch_concurrency)
        self._decoding = self._decode_budget()
        self._claims_lock = threading.Lock()
        self._claimed = {}
        self._events.forked()
        self._orders = epoch_plans.EpochPlans(self.manifest.shard_rows, self.manifest.digest)

    def _decode_budget(self) -> decode_budgets.DecodeBudget:
        capacity, what = self._decode_capacity
        return decode_budgets.DecodeBudget(capacity, what=what)

    # --- readers ----------------------------------------------------------------
    def register_reader(
        self,
        reader_id: str,
        params: plans.PlanParams,
        position: int = 0,
        *,
        fill_ranks: int = 1,
    ) -> None:
        """Read ahead along the reader's plan, and fill the rest of its epoch behind
        every reader's readahead (`_fill`). `fill_ranks` > 1: the fill takes the epochs
        of that many ranks from `params.rank` on (the sidecar's startup plan for the
        ranks it serves, `SHARDCACHE_LOCAL_RANKS`), before their readers register."""
        planned = _Reader.planned(self.manifest, self._orders, params, position)
        with self._lock:
            self._readers[reader_id] = planned
            self._fill_ranks[reader_id] = fill_ranks
        # Only the new reader's window is new: the others' were scheduled when they
        # moved (16 ranks registering at once rescheduled every reader 16 times).
        self._schedule(reader_id)
        self._fill(reader_id)
        self._claim_windows()

    def plan_is_cheap(self, params: plans.PlanParams) -> bool:
        """Whether a reader of `params` gets its plan cheaply enough for the sidecar's
        event loop: another rank's registration made the epoch's order (the plan is a
        slice and a bisection), or making it is one permutation of a small manifest's
        shards and the rank's share of them is a few hundred blocks' runs.

        Why the second: the thread hop is not free when the loop is busy. The thread
        needs the GIL, which a loop with requests queued gives up only at the switch
        interval (CPython's 5 ms then; the sidecar sets 0.5 ms since), so the first rank
        into an epoch can wait that long a turn while its K-1 peers' requests run; made
        on the loop, its plan costs 0.17 ms at 16 ranks and 0.33 ms at 8 of the device's
        48 shards (this machine, median of 10)."""
        if params.sampled:
            return False
        if self._orders.has(params):
            return True
        return len(self.manifest.shards) <= _CHEAP_ORDER_SHARDS and self._orders.blocks(
            params.block_size
        ) <= (_CHEAP_RANK_BLOCKS * max(1, params.world_size))

    def update_reader(self, reader_id: str, *, epoch: int, position: int) -> None:
        new_epoch: plans.PlanParams | None = None
        with self._lock:
            reader = self._readers.get(reader_id)
            if reader is None:
                raise errors.InputError(f"unknown reader {reader_id!r}: register it first")
            if epoch != reader.params.epoch:
                new_epoch = params = reader.params.with_epoch(epoch)
                # Where the plan is cheap enough for the event loop, it is made when
                # first needed: a reader whose every shard is resident needs none
                # until an acquire grants its next shards (the warm path's `notes`
                # never do). Else now, where the caller put this (the thread pool).
                moved = _Reader.planned(
                    self.manifest,
                    self._orders,
                    params,
                    position,
                    lazy=self._still_all_resident() and self.plan_is_cheap(params),
                )
                moved.depth = reader.depth  # a tuned depth outlives the epoch
                self._readers[reader_id] = moved
            else:
                reader.position = position
        # Only this reader's window moved; the others' were scheduled when they moved.
        self._schedule(reader_id)
        if new_epoch is not None:
            self._fill(reader_id)
        self._claim_windows()

    def unregister_reader(self, reader_id: str) -> None:
        with self._lock:
            self._readers.pop(reader_id, None)
            self._fill_ranks.pop(reader_id, None)
        if reader_id in self._fill_plans:
            with self._fill_lock:
                self._fill_plans.pop(reader_id, None)
                self._plan_fill()
        self._claim_windows()

    def reader_ids(self) -> list[str]:
        with self._lock:
            return list(self._readers)

    # --- data -------------------------------------------------------------------
    def check_shards(self, shards: Sequence[int]) -> None:
        """Every one of `shards` is in the manifest; else ShardIndexError naming the first
        that is not. (A `notes` batch carries a dozen or more: its least and its most are
        checked.)"""
        n = len(self.manifest.shards)
        if not shards or (min(shards) >= 0 and max(shards) < n):
            return
        shard = next(s for s in shards if not 0 <= s < n)
        raise errors.ShardIndexError(
            f"shard index {shard} is out of range: the manifest has {n} shards (0..{n - 1})"
        )

    def _check_index(self, shard: int) -> None:
        if not 0 <= shard < len(self.manifest.shards):
            self.check_shards((shard,))

    def acquire(
        self,
        shard: int,
        *,
        timeout: float | None = None,
        beside: Sequence[tiers.Entry] = (),
        count: bool = True,
        missed: bool = False,
    ) -> tiers.Entry:
        """`_acquire`, counted among the readers' acquires in progress when `count`."""
        if not count:
            return self._acquire(shard, timeout=timeout, beside=beside, count=count, missed=missed)
        with self._lock:
            self._acquiring += 1
        try:
            return self._acquire(shard, timeout=timeout, beside=beside, count=count, missed=missed)
        finally:
            with self._lock:
                self._acquiring -= 1
                self._acquires_ended += 1

    def _acquire(
        self,
        shard: int,
        *,
        timeout: float | None,
        beside: Sequence[tiers.Entry],
        count: bool,
        missed: bool,
    ) -> tiers.Entry:
        """Block until `shard` is resident in the memory tier; return a lease on it.

        `timeout`: seconds to wait at most, whatever it waits on (a fetch that never
        returns included), then AcquireTimeoutError saying what that was; None waits
        for good (and fetches in the calling thread).

        `beside`: memory-tier leases the caller keeps holding while it waits. If the
        shard does not fit beside them, RoomHeldError is raised at once: only the
        caller could free that room, so waiting for it would time out.

        `count`: a reader's lookup, counted in the memory tier's statistics: a hit for
        every shard handed over, and a miss when the shard was not resident at first
        (one per acquire, however often it looks again). False for a caller that is
        no reader (the sidecar's warm-up). `missed`: the caller's own `lookup` of the
        shard missed and counted it; this acquire counts no miss of its own.
        """
        self._check_index(shard)
        deadline = None if timeout is None else time.monotonic() + timeout
        key = self.manifest.decoded_key(shard)
        held = sum(e.size for e in beside if e.leased)
        missed = missed or not count
        for _ in range(8):
            entry = self.memory.lookup(key, count=False)
            if entry is not None:
                if count:
                    self._events.hit(self.memory.name)
                return entry
            if not missed:
                missed = True
                self._events.miss(self.memory.name)
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                _, entry = self._materialize(shard, why="acquire", wait=remaining, held=held)
            except _Waited as waited:
                assert timeout is not None  # only a bounded wait ends so
                raise errors.AcquireTimeoutError(
                    self._timed_out(shard, waited.attempt, timeout)
                ) from None
            if entry is not None:
                # Leased from its insert on: between an insert that let go of it and a
                # lookup here, another reader's acquire could evict it (a tight tier then
                # failed with the error below). Counted as the hit the lookup was: memory
                # hits count every shard handed to a reader.
                if count:
                    self._events.hit(self.memory.name)
                return entry
        raise errors.CacheError(
            f"shard {shard} ({self.manifest.shards[shard].path}) was evicted from the memory "
            "tier again and again before it could be leased: the memory limit "
            f"({self.settings.memory_limit} bytes) is too small for the readers on this node"
        )

    def _timed_out(self, shard: int, attempt: _Attempt, timeout: float) -> str:
        """Why an acquire of `shard` gave up after `timeout` seconds: where the attempt
        it waited on is, since when, and what that means."""
        now = time.monotonic()
        stage = attempt.stage
        words = [
            f"shard {shard} ({self.manifest.shards[shard].path}) is not resident after the "
            f"acquire timeout of {timeout:g} s: {STAGES.get(stage, stage)} since "
            f"{utc_text(attempt.stage_wall)} ({now - attempt.stage_at:.1f} s)"
        ]
        if stage == "room":
            limit = self.settings.memory_limit
            words.append(
                f"; the memory tier holds {self.memory.resident_bytes()} of its {limit} "
                f"bytes, {self.memory.leased_bytes()} of them leased by readers (never "
                f"evicted): raise the memory limit ({variables.MEMORY_LIMIT.env}; a "
                "DatasetMount's spec.cache.memory) or lower the prefetch depth"
            )
        elif stage == "fetch":
            words.append(
                f"; the fetch from {uris.redact(self.manifest.root)} has not finished (a "
                "slow store, or one that took the request and never answers)"
            )
        words.append(
            f". The attempt began {now - attempt.started:.1f} s ago, at "
            f"{utc_text(attempt.started_wall)}, for {attempt.why}, and goes on: a later "
            "acquire of the shard waits for it."
        )
        return "".join(words)

    def in_flight(self, shard: int) -> dict[str, object] | None:
        """The attempt in flight to make `shard` resident, as /v1/status shows it (why
        it began, its stage and since when, the acquires waiting on it); None when
        there is none (resident, or nobody is making it so)."""
        with self._lock:
            attempt = self._inflight.get(shard)
        return None if attempt is None else attempt.to_json()

    def lookup(self, shard: int, *, count: bool = True) -> tiers.Entry | None:
        """A lease on `shard` if it is resident in the memory tier, else None; never
        fetches, never waits for room (the sidecar calls it on its event loop).

        A hit or a miss is counted unless `count` is False (a lease granted ahead of
        the reader: counted when the reader takes it, `note_reuse`). After a miss
        counted here, the caller's `acquire` of the shard passes `missed=True`: the
        reader looked once. (The acquire counted the miss itself before, at its own
        lookup, which a readahead finishing in between turned into a hit.)

        The sidecar's sole-writer tier holds the entry in its own memory instead of
        with a lease file's system calls (`Tier.hold`): this is the lookup of every
        acquire and of every shard granted ahead, on the event loop."""
        self._check_index(shard)
        entry = self.memory.hold(self._memory_keys[shard], count=False)
        if count:
            if entry is None:
                self._events.miss(self.memory.name)
            else:
                self._events.hit(self.memory.name)
        return entry

    def note_reuse(self, shards: Sequence[int]) -> None:
        """Count a memory-tier hit for each of `shards`, taken without a lookup here: a
        trainer pinned entries it had been handed before (docs/wire-format.md, the reuse
        fast path), so the statistics still count every shard a reader took. One count
        for the batch: a `notes` request carries a dozen or more. The caller checked
        `shards` (`check_shards`) before acting on the request."""
        if shards:
            self._events.reused(self.memory.name, len(shards))

    def _materialize(
        self,
        shard: int,
        *,
        why: str,
        wait: float | None,
        held: int = 0,
        queued: float | None = None,
    ) -> tuple[str, tiers.Entry | None]:
        """Make `shard` resident once; concurrent callers share one attempt. What came
        of this call's attempt (`_load`), or "shared" when it waited on another's; and
        for an "acquire", a lease on the resident shard where the attempt (its own or
        the one it waited on) inserted it or found it leasable (else None), which the
        caller releases.

        `why`: "acquire" (a reader waits for it: may evict), "readahead" or "fill"
        (never evict; the fill only decodes into room it leaves a wave of readahead).
        `held` (bytes the caller leases in the memory tier) only applies when this call
        makes the attempt: one shared with a readahead that found no room fails quietly,
        and the caller's next try makes its own. `queued`: when it was asked for."""
        acquire = why == "acquire"
        # An acquire with a deadline never runs the attempt itself: a fetch cannot be
        # bounded (a store that accepts the request and never answers, an NFS mount
        # that hangs, a FIFO), and an acquire running its own attempt waited on it for
        # good, whatever its timeout (a reader blocked for hours on one shard). The
        # attempt runs on a thread of its own, and the acquire waits for it as for any
        # other attempt, within its timeout.
        behind = acquire and wait is not None
        with self._lock:
            attempt = self._inflight.get(shard)
            owner = attempt is None
            if attempt is None:
                attempt = self._inflight[shard] = _Attempt(why)
            if acquire and (behind or not owner):
                attempt.wanting += 1
        if owner and behind:
            threading.Thread(
                target=self._attempt_behind,
                args=(shard, attempt),
                kwargs={"held": held, "queued": queued},
                name=f"shardcache-acquire-{shard}",
                daemon=True,
            ).start()
        if not owner or behind:
            return "shared", self._await_attempt(attempt, wait=wait, acquire=acquire)
        outcome, entry = self._attempt(shard, attempt, held=held, queued=queued)
        if entry is not None and not acquire:
            entry.release()
            entry = None
        return outcome, entry

    def _attempt(
        self, shard: int, attempt: _Attempt, *, held: int, queued: float | None
    ) -> tuple[str, tiers.Entry | None]:
        """Run `attempt` (this thread made it): load the shard, leave a lease for each
        acquire waiting on it, and end it. What came of it and the attempt's own lease,
        which the caller releases or hands over."""
        stamps = timelines.start(shard, attempt.why, queued)
        try:
            outcome, entry = self._load(
                shard, why=attempt.why, held=held, stamps=stamps, progress=attempt
            )
        except BaseException as exc:
            stamps.done("failed")
            self._settle(shard, attempt, None)
            # Counted before the waiters learn of it: a reader that got the error
            # finds it counted.
            self._count_failure(shard, attempt)
            attempt.done.set_exception(exc)
            raise
        stamps.done(outcome)
        self._settle(shard, attempt, entry)
        attempt.done.set_result(None)
        return outcome, entry

    def _attempt_behind(
        self, shard: int, attempt: _Attempt, *, held: int, queued: float | None
    ) -> None:
        """`_attempt` for acquires with a deadline, on its own thread (`_materialize`):
        every acquire, the one that began it too, waits for a lease left for it."""
        try:
            _, entry = self._attempt(shard, attempt, held=held, queued=queued)
        except Exception as exc:
            # The acquires waiting on it raise it; logged for when all had given up.
            log.info("making shard %d resident for an acquire failed: %s", shard, exc)
            return
        if entry is not None:
            entry.release()

    def _count_failure(self, shard: int, attempt: _Attempt) -> None:
        """Count the failed fetch of an ended attempt: as a source error when a reader
        waited on it (it was an acquire's or the warm-up's, or an acquire joined it),
        else as the readahead's. Settled, so no acquire joins it any more; one that
        gave up first (its timeout) took itself off `wanting` and got no such error."""
        error = attempt.fetch_error
        if error is None:
            return
        with self._lock:
            waited = attempt.why == "acquire" or attempt.wanting > 0
        try:
            if waited:
                self._events.fetch_failed(shard, error)
            else:
                self._events.readahead_failed(shard, error)
        except Exception:  # a count lost, never the waiters' error (set after this)
            log.exception("counting the failed fetch of shard %d failed", shard)

    def _settle(self, shard: int, attempt: _Attempt, entry: tiers.Entry | None) -> None:
        """End the attempt: no one joins it from now on, and each acquire waiting on it
        gets a lease of its own on `entry` (the attempt's lease: it is resident while
        held, so each lookup finds it)."""
        with self._lock:
            self._inflight.pop(shard, None)
            wanting = attempt.wanting
        leases: list[tiers.Entry] = []
        try:
            while entry is not None and len(leases) < wanting:
                lease = self.memory.lookup(entry.key, count=False)
                if lease is None:
                    break
                leases.append(lease)
        except Exception as exc:
            # The waiters look the shard up themselves, as they did before leases were
            # left for them; the attempt itself succeeded.
            log.warning("shard %d: no lease left for the acquires waiting on it: %s", shard, exc)
        with self._lock:
            # A waiter that gave up meanwhile took itself off `wanting`.
            kept = attempt.leases = leases[: attempt.wanting]
            attempt.settled = True
        for lease in leases[len(kept) :]:
            lease.release()

    def _await_attempt(
        self, attempt: _Attempt, *, wait: float | None, acquire: bool
    ) -> tiers.Entry | None:
        """Wait for an attempt this caller did not run; for an acquire, the lease it
        left for this one (None if it inserted nothing: the acquire looks the shard up
        again). `_Waited` when `wait` seconds passed first."""
        try:
            attempt.done.result(timeout=wait)
        except BaseException as exc:
            if acquire:
                with self._lock:
                    if attempt.settled:
                        lease = attempt.leases.pop() if attempt.leases else None
                    else:
                        attempt.wanting -= 1
                        lease = None
                if lease is not None:
                    lease.release()
            done = attempt.done
            own = done.done() and not done.cancelled() and done.exception() is exc
            if isinstance(exc, concurrent.futures.TimeoutError) and not own:
                # This wait's end, not the attempt's own error (a source's socket
                # timeout is a TimeoutError too).
                raise _Waited(attempt) from None
            raise
        if not acquire:
            return None
        with self._lock:
            return attempt.leases.pop() if attempt.leases else None

    def _load(
        self,
        shard: int,
        *,
        why: str,
        held: int = 0,
        stamps: timelines.Stamps = timelines.OFF,
        progress: _Attempt | None = None,
    ) -> tuple[str, tiers.Entry | None]:
        """Fetch, decode and insert `shard`; what came of it, for the timeline, and a
        lease on what it inserted (or, for an "acquire", found resident), which
        `_materialize` releases or hands over. Each stage is told to `progress`."""
        at = _no_progress if progress is None else progress.at
        mem_key = self.manifest.decoded_key(shard)
        if why == "acquire":
            found = self.memory.lookup(mem_key, count=False)
            if found is not None:
                return "resident", found
        elif self.memory.contains(mem_key):
            return "resident", None
        key = self.manifest.source_key(shard)
        # The decoded shard's bytes stay reserved until it is in the memory tier: with
        # `fetch_concurrency` decodes at once, their total stays within the limit.
        with contextlib.ExitStack() as reserved:
            # Readahead and the acquires' attempts (a thread each, `_materialize`)
            # share the fetch concurrency: a 2-CPU pod with 16 ranks waiting on
            # cold shards decodes two at a time, not sixteen. Only the fetch and the
            # decode count: the insert below may wait for room, which must not hold a
            # slot.
            at("slot")
            with self._working:
                stamps.mark("slot")
                at("disk")
                disk_entry = self._disk_entry(shard, key, at=at, attempt=progress)
                stamps.mark("fetched")
                try:
                    with disk_entry:
                        decoded = self._decode(
                            shard,
                            disk_entry.path,
                            reserved,
                            fill=why == "fill",
                            stamps=stamps,
                            at=at,
                        )
                except decode_budgets.DecodeRoomError:
                    raise  # the bytes are the shard's: kept for a sidecar given more room
                except errors.ShardcacheError:
                    # Bytes that are not the pinned shard (damaged on the way) are not
                    # kept: the next acquire fetches again instead of meeting them from
                    # the disk tier.
                    self.disk.evict(key)
                    raise
                stamps.mark("decoded")
            if decoded is None:
                return "no room", None  # the fill's: the source bytes stay in the disk tier
            self._decoded_sizes[shard] = decoded.size
            size = self.manifest.shards[shard].size
            if size:
                ratio = decoded.size / size
                self._expansion_seen = max(self._expansion_seen or ratio, ratio)
                self._expansion_least = min(self._expansion_least or ratio, ratio)
            faultpoints.reach("cache.decode")
            at("insert")
            inserted = self._insert_decoded(
                shard, mem_key, decoded, prefetch=why != "acquire", held=held, at=at
            )
            stamps.mark("inserted")
            if inserted is None:
                return "no room", None
            # Kept for the acquires waiting on this attempt too (`_settle`).
            return "inserted", inserted

    def _disk_entry(
        self,
        shard: int,
        key: str,
        *,
        at: Callable[[str], None] = lambda _: None,
        attempt: _Attempt | None = None,
    ) -> tiers.Entry:
        """A lease on the shard's source bytes in the disk tier: fetched (and checked on
        fetch) if missing; if found, checked against the manifest's sha256, not the
        entry's own meta file (whoever wrote the entry wrote that too). Where another
        user's file there may not be removed or replaced, the bytes fetched into a
        reservation that is never committed (`_uncached`). A failure is left on
        `attempt` to count when it ends (`_count_failure`); without one, counted now as
        a reader's."""
        entry = self.manifest.shards[shard]
        # A fetch checks the bytes against the manifest's sha256 as they arrive
        # (`source.download`), so that is the entry's sha256: the tier does not read the
        # new entry back to hash it again.
        try:
            try:
                disk_entry, hit = self.disk.get_or_insert(
                    key, entry.size, lambda tmp: self._fetch(shard, tmp, at=at), sha256=entry.sha256
                )
            except tiers.Unremovable as exc:
                # Another user's file holds one of the entry's names (a lock file before
                # the fetch, the data or meta file at its commit).
                return self._uncached(shard, key, str(exc), at=at)
            if not hit or self._intact(shard, disk_entry.path):
                return disk_entry
            disk_entry.release()
            self._events.corrupted(self.disk.name, key)
            if not self.disk.evict(key):
                kept = self.disk.unremovable(key)
                if kept is not None:
                    return self._uncached(shard, key, _BAD_AND_KEPT + kept, at=at)
            disk_entry, hit = self.disk.get_or_insert(
                key, entry.size, lambda tmp: self._fetch(shard, tmp, at=at), sha256=entry.sha256
            )
            if not hit or self._intact(shard, disk_entry.path):
                return disk_entry
            disk_entry.release()
            kept = self.disk.unremovable(key)
            if kept is not None:
                return self._uncached(shard, key, _BAD_AND_KEPT + kept, at=at)
            # Another reader leases the bad entry (its own check fails it too, and
            # releases it): not evicted yet.
            raise errors.ManifestMismatchError(
                f"shard {shard} ({entry.path}) in the disk tier is not the content the "
                f"manifest pinned (sha256 {entry.sha256}) and another process holds a "
                "lease on it; retry once it is released"
            )
        except errors.CacheError:
            # The node's own problem (its disk volume full with nothing left to evict,
            # an entry larger than the tier), not the store's: not a fetch failure.
            raise
        except errors.ShardcacheError as exc:
            if attempt is None:
                self._events.fetch_failed(shard, exc)
            else:
                attempt.fetch_error = exc
            raise

    def _uncached(
        self, shard: int, key: str, why: str, *, at: Callable[[str], None]
    ) -> tiers.Entry:
        """The shard's source bytes fetched (and checked on fetch) into a reservation of
        the disk tier that is never committed (`Tier.uncommitted`), for a key whose
        entry in the disk tier this process may not remove or replace (`why`): served
        correctly, from the memory tier once decoded, instead of failing the reader for
        a file in the way. It is fetched again at each load while that file is there."""
        entry = self.manifest.shards[shard]
        with self._lock:
            first = key not in self._uncached_keys
            self._uncached_keys.add(key)
        if first:
            log.warning(
                "disk tier: shard %d (%s) is served without caching it on disk: %s",
                shard, entry.path, why,
            )  # fmt: skip
        return self.disk.uncommitted(
            key, entry.size, lambda tmp: self._fetch(shard, tmp, at=at), sha256=entry.sha256
        )

    def _insert_decoded(
        self,
        shard: int,
        mem_key: str,
        decoded: formats.Decoded,
        *,
        prefetch: bool,
        held: int,
        at: Callable[[str], None] = lambda _: None,
    ) -> tiers.Entry | None:
        """Write the decoded shard to the memory tier; a lease on it, or None if a
        readahead found no room."""
        entry = self.manifest.shards[shard]
        waiting: Callable[[], None] | None = None
        if not prefetch:
            check = self._window_room_check()
            cycle = self._volume_cycle_check(decoded.size)

            def waiting() -> None:
                at("room")
                check()
                cycle()

        try:
            # Readahead never evicts: an evicted shard would be one a reader needs
            # sooner. Acquires do evict (least recently used, never leased). Not a
            # lookup of a reader's (`acquire` counts those): uncounted.
            mem_entry, _ = self.memory.get_or_insert(
                mem_key,
                decoded.size,
                lambda tmp: decoded.write(str(tmp)),
                evict=not prefetch,
                held=held,
                waiting=waiting,
                count=False,
            )
        except (tiers.RoomHeldError, tiers.EntryTooLargeError) as exc:
            # Kept as their own types, so a caller can tell "does not fit" apart.
            raise exc.about(f"shard {shard} ({entry.path})") from exc
        except tiers.TierFullError:
            if not prefetch:
                raise
            self._warn_small_memory(decoded.size)
            return None
        except errors.CacheError as exc:
            raise errors.CacheError(f"shard {shard} ({entry.path}): {exc}") from exc
        return mem_entry

    def window_need(self) -> windows.Need:
        """What the sample-mode readers' current and next windows take of the memory
        tier at once (`windows.need`; shards not decoded yet estimated, `_decoded_size`)."""
        with self._lock:
            # Named by rank too: what a person reading the error knows them by.
            readers = {
                f"rank {r.params.rank} (reader {reader_id})": (
                    r.plan_windows,
                    r.window_ends,
                    r.position,
                )
                for reader_id, r in self._readers.items()
                if r.params.sampled
            }
        return windows.need(readers, self._decoded_size)

    def _claim_windows(self, *, refresh: bool = False) -> None:
        """Write what this process's sample-mode readers hold (`windows.held_at`) for
        other processes sharing the memory tier, where it changed; `refresh`: also
        when only the shards' sizes may have (a decode made one known)."""
        if self._claims is None:
            return
        with self._lock:
            held = {
                reader_id: windows.held_at(r.plan_windows, r.window_ends, r.position)
                for reader_id, r in self._readers.items()
                if r.params.sampled
            }
        with self._claims_lock:
            if held == self._claimed and not refresh:
                return
            self._claimed = held
            keys = self._memory_keys
            self._claims.publish(
                {
                    reader_id: {keys[s]: self._decoded_size(s) for s in shards}
                    for reader_id, shards in held.items()
                }
            )

    def _claimed_elsewhere(self, own: windows.Need) -> tuple[int, int]:
        """(readers, bytes) that other processes' sample-mode readers hold on this memory
        tier at once (their `window_claims`), each shard once with `own`'s. A shard
        whose size its claim does not know counts what the tier holds of it, if any."""
        if self._claims is None:
            return 0, 0
        self._claim_windows(refresh=True)
        seen = {self._memory_keys[s] for shards in own.readers.values() for s in shards}
        readers = extra = 0
        for claim in self._claims.others().values():
            readers += 1
            for key, size in claim.items():
                if key in seen:
                    continue
                seen.add(key)
                if size is None:
                    size = self.memory.size(key)
                extra += size or 0
        return readers, extra

    def _decoded_size(self, shard: int) -> int | None:
        """`shard`'s decoded bytes: known once it was decoded, else estimated from its
        source bytes by the least expansion seen (shards blocked before their decode,
        waiting for a fetch slot or decode budget that waiting acquires hold, are
        windows' shards too); None before any shard was decoded."""
        known = self._decoded_sizes.get(shard)
        if known is not None:
            return known
        least = self._expansion_least
        return None if least is None else int(self.manifest.shards[shard].size * least)

    def _window_room_check(self) -> Callable[[], None]:
        """What an acquire's insert calls while it waits for room (`Tier.insert`).

        A sample-mode reader leases every shard of its window while it gathers, and of
        the next one from where it crosses into it or plans ahead into it
        (`windows.held_at`), so when the registered readers' windows together take more
        than the memory limit they cannot all be resident: each reader waits for room
        the others hold, and ranks that step together never release it (a deadlock
        until the tier's wait times out, five minutes). Once that has been so for
        `_WINDOW_ROOM_GRACE_S`, the acquire fails with what the windows need and what to
        change."""
        since: list[float] = []

        def check() -> None:
            need = self.window_need()
            elsewhere, extra = self._claimed_elsewhere(need)
            limit = self.settings.memory_limit
            if need.bytes + extra <= limit:
                since.clear()
                return
            now = time.monotonic()
            if not since:
                since.append(now)
            if now - since[0] < _WINDOW_ROOM_GRACE_S:
                return
            words = [need.describe()] if need.readers else []
            if elsewhere:
                words.append(
                    f"{elsewhere} reader(s) of other processes sharing the memory tier: "
                    f"{extra} bytes more"
                )
            # `_insert_decoded` names the shard in front of this.
            raise errors.CacheError(
                "the memory tier cannot hold every sample-mode reader's current and next "
                f"window at once: the windows of {len(need.readers) + elsewhere} reader(s) "
                f"take at least {need.bytes + extra} bytes decoded "
                f"({'; '.join(words)}), the limit is {limit} bytes. A "
                "reader leases every shard of its window while it gathers, and of the next "
                "as it crosses into it, so the readers would wait for each other's room. "
                f"Raise the memory limit ({variables.MEMORY_LIMIT.env}; a DatasetMount's "
                "spec.cache.memory) to hold every local rank's window and the next, or "
                "lower the window (window=, spec.sharding.window)"
            )

        return check

    def _volume_cycle_check(self, size: int) -> Callable[[], None]:
        """What an acquire's insert of `size` bytes also calls while it waits for room:
        fails it once its readers hold the memory volume's missing room themselves,
        waiting in acquires or for those that do (`volume_cycles`), instead of at the
        tier's wait timeout. Only where this process serves every reader of the volume
        (a sole writer: the sidecar); readers of other processes may still be
        progressing."""
        watch = volume_cycles.Watch()

        def check() -> None:
            if not self.settings.memory_sole_writer:
                return
            with self._lock:
                readers, waiting = len(self._readers), self._acquiring
                ended = self._acquires_ended
            found = tiers.volume(self.memory.root)
            need = tiers.needed(size)
            if found is None or found.free >= need or waiting == 0:
                watch.reset()
                return
            resident = self.memory.resident_bytes()
            look = volume_cycles.Look(
                total=found.total,
                free=found.free,
                own=self.memory.used_bytes(),
                evictable=max(0, resident - self.memory.leased_bytes()),
                need=need,
                readers=readers,
                waiting=waiting,
                ended=ended,
            )
            if not watch.lasted(look, time.monotonic()):
                return
            with self._lock:
                largest = max(self._decoded_sizes.values(), default=size)
            message = volume_cycles.describe(
                look,
                root=str(self.memory.root),
                limit=self.settings.memory_limit,
                shard_bytes=max(largest, size),
                setting=variables.MEMORY_LIMIT.env,
            )
            log.error("%s", message)
            self._events.volume_cycle(message)
            # `_insert_decoded` names the shard in front of this.
            raise errors.CacheError(message)

        return check

    def _warn_small_memory(self, size: int) -> None:
        if self._warned_small_memory:
            return
        self._warned_small_memory = True
        log.warning(
            "memory tier limit (%d bytes) is smaller than the readahead wants "
            "(prefetch depth %d, shard ~%d bytes decoded, %d bytes in use): readahead "
            "is reduced to what fits, and a reader waits for each shard it reaches. Raise "
            "the memory limit or lower the prefetch depth.",
            self.settings.memory_limit,
            self.settings.prefetch_depth,
            size,
            self.memory.used_bytes(),
        )

    def _fetch(self, shard: int, tmp: Path, *, at: Callable[[str], None] = lambda _: None) -> None:
        entry = self.manifest.shards[shard]
        at("fetch")
        started = time.monotonic()

        def download(fs: pafs.FileSystem) -> None:
            source.download(
                fs,
                self.manifest.shard_uri_path(shard),
                tmp,
                expected_size=entry.size,
                what=f"fetching shard {shard} ({entry.path}) from {uris.redact(self.manifest.root)}",
                policy=self.settings.retry,
                identity=entry.version,
                sha256=entry.sha256,
            )

        used = self._fs
        try:
            download(used)
        except errors.AccessDeniedError:
            fresh = None if self._renewal is None else self._renewal.renewed(used)
            if fresh is None:
                raise
            self._fs = fresh
            download(fresh)
        faultpoints.reach("cache.fetch")
        self._events.fetched(entry.size, time.monotonic() - started)

    def _intact(self, shard: int, path: Path) -> bool:
        """Whether a disk-tier hit holds the bytes the manifest pinned: hashed and
        compared with the manifest's sha256, never with the entry's meta file (whoever
        wrote a forged entry wrote that too). One read of the shard per hit, beside the
        decode's; the disk tier is read only to fill the memory tier."""
        pinned = self.manifest.shards[shard].sha256
        found = tiers.sha256_file(path)
        if found != pinned:
            log.warning(
                "disk tier: shard %d (%s) has sha256 %s, the manifest pinned %s; not "
                "served, fetching it again",
                shard,
                self.manifest.shards[shard].path,
                found,
                pinned,
            )
            return False
        return True

    def _decode(
        self,
        shard: int,
        path: Path,
        reserved: contextlib.ExitStack,
        *,
        fill: bool = False,
        stamps: timelines.Stamps = timelines.OFF,
        at: Callable[[str], None] = lambda _: None,
    ) -> formats.Decoded | None:
        """Decode a disk-tier shard, bounded before and while decoding; its decoded bytes
        are reserved on `reserved` (the caller's, held until the memory tier has them).
        None for the `fill` when its decoded size does not fit the fill's room."""
        entry = self.manifest.shards[shard]
        limit = self.settings.memory_limit
        what = f"shard {shard} ({entry.path})"
        try:
            with pa.OSFile(str(path), "rb") as f:
                # Bounded before decoding: a decompression bomb never reaches memory.
                size = formats.decoded_size(self.manifest.format, f, limit=limit)
                if size is not None and size > limit:
                    raise tiers.EntryTooLargeError(
                        f"{what} takes over {size} bytes decoded (from its metadata) but "
                        f"the memory tier holds at most {limit} bytes: refused before "
                        "decoding; raise the memory limit (cache.memory) or write smaller "
                        "shards",
                        size=size,
                        limit=limit,
                    )
                # The footer's size is a bound (offsets and validity at their widest: about
                # twice the decoded file for token lists); once shards were decoded, the
                # ratio they showed is the better guess. The insert still never evicts.
                guess = entry.size * self._expansion
                if size is not None and self._expansion_seen is None:
                    guess = size
                if fill and not self._fill_room(guess):
                    return None
                # A format that cannot tell (JSON Lines) is bounded while it decodes, by
                # what its text can decode to (`_TEXT_EXPANSION`) within the limit and
                # within the room a decode's peak has.
                budget = (
                    size
                    if size is not None
                    else min(
                        limit,
                        _TEXT_EXPANSION * entry.size,
                        self._decoding.capacity // quotas.DECODE_PEAK_FACTOR,
                    )
                )
                at("decode_budget")
                # The decode's peak, not its result, is what the cgroup must hold: with
                # the decoded size alone, two decodes of a shard that compresses 40x
                # OOM-killed the sidecar during warm-up (docs/faults.md).
                # The peak is an estimate (DECODE_PEAK_FACTOR is the flat columns' worst;
                # token lists peak near 1.4x what their metadata says): a decode whose
                # estimate exceeds the room runs alone, with all of it. Only a shard whose
                # decoded size alone exceeds the room is refused: it can never fit.
                try:
                    self._decoding.check_fits(budget)
                    peak = min(quotas.decode_peak(budget), self._decoding.capacity)
                    reserved.enter_context(self._decoding.reserve(peak))
                except decode_budgets.DecodeRoomError as exc:
                    raise decode_budgets.DecodeRoomError(
                        f"{what} takes {budget} bytes decoded "
                        f"({'from its metadata' if size is not None else 'at most'}) and {exc}: "
                        "refused before decoding, which would get the sidecar OOM-killed; "
                        "raise the sidecar's memory limit (spec.sidecar.resources.limits."
                        "memory; the webhook adds the memory volume to it) by "
                        f"{exc.size - exc.room} bytes or more, or write smaller shards "
                        '(docs/operator.md, "What a pod gets, per mount")',
                        size=exc.size,
                        room=exc.room,
                    ) from None
                stamps.mark("decode")
                at("decode")
                f.seek(0)
                decoded = formats.decode(
                    self.manifest.format,
                    f,
                    budget=formats.budgets.Budget(bytes=budget, rows=entry.rows),
                    promoted=self.manifest.promoted_schema,
                )
        except formats.budgets.OverBudget as exc:
            # pyarrow's allocator keeps what a thread freed for that thread: without this,
            # each fetch thread that stopped a hostile decode would hold its budget on.
            pa.default_memory_pool().release_unused()
            if exc.what == formats.budgets.ROWS:
                raise errors.ManifestMismatchError(
                    f"{what} has over {exc.found} rows, the manifest pinned {entry.rows}: "
                    "refused while decoding"
                ) from exc
            if exc.what in (formats.budgets.LINE, formats.budgets.FIELDS, formats.budgets.DEPTH):
                raise errors.InputError(f"{what} {exc}: refused while decoding") from exc
            raise tiers.EntryTooLargeError(
                f"{what} decodes to over {exc.found} {exc.what}, expected at most "
                f"{exc.limit} (the memory tier's limit of {limit} bytes, or "
                f"{_TEXT_EXPANSION} x its {entry.size} bytes of text): refused while "
                "decoding; raise the memory limit (cache.memory) or write smaller shards",
                size=exc.found,
                limit=exc.limit,
            ) from exc
        except (ValueError, TypeError, OSError) as exc:
            raise errors.InputError(
                f"{what} cannot be decoded as {self.manifest.format}: {exc}"
            ) from exc
        if decoded.batch.num_rows != entry.rows:
            raise errors.ManifestMismatchError(
                f"{what} has {decoded.batch.num_rows} rows, the manifest pinned {entry.rows}"
            )
        return decoded

    # --- prefetch ---------------------------------------------------------------
    def samples(self, reader_id: str) -> bool:
        """Whether the reader reads in sample mode (plan version 2)."""
        with self._lock:
            reader = self._readers.get(reader_id)
            return reader is not None and reader.params.sampled

    def held_at(self, reader_id: str) -> tuple[int, ...] | None:
        """The shards a sample-mode reader holds at once at its position: its current
        and next windows' (`windows.held_at`); None for a reader of another mode or
        none."""
        with self._lock:
            reader = self._readers.get(reader_id)
            if reader is None or not reader.params.sampled:
                return None
            return windows.held_at(reader.plan_windows, reader.window_ends, reader.position)

    def upcoming(self, reader_id: str, count: int) -> list[int]:
        with self._lock:
            reader = self._readers.get(reader_id)
            if reader is None:
                return []
            return reader.upcoming(count)

    def set_prefetch_depth(self, reader_id: str, depth: int) -> None:
        """Read `depth` shards ahead of reader `reader_id` from now on, instead of the
        settings' depth (the sidecar tunes it, `shardcache_sidecar.prefetch_tuner`);
        shards a deeper depth reaches are scheduled at once. Unknown readers: nothing."""
        if depth < 0:
            raise errors.InputError(f"prefetch depth must be >= 0, found {depth}")
        with self._lock:
            reader = self._readers.get(reader_id)
            if reader is None:
                return
            reader.depth = depth
        self._schedule(reader_id)

    def prefetch_depth(self, reader_id: str) -> int:
        """Shards read ahead of reader `reader_id`: its own depth, else the settings'."""
        with self._lock:
            reader = self._readers.get(reader_id)
        if reader is None or reader.depth is None:
            return self.settings.prefetch_depth
        return reader.depth

    def _every_shard_resident(self) -> bool:
        """Whether every shard of the manifest is in the memory tier: a set lookup each
        in the sidecar's sole-writer tier (elsewhere a stat each: not asked there), and
        none at all while nothing left the tier since every shard last was (its
        `removals`): a 100,000-shard manifest is 100,000 lookups, tens of milliseconds
        on the event loop at every reader's epoch start otherwise."""
        removals = self.memory.removals  # read first: a removal during the walk counts
        if removals is not None and removals == self._all_resident_at:
            return True
        contains = self.memory.contains
        if all(contains(key) for key in self._memory_keys):
            self._all_resident_at = removals
            return True
        return False

    def _ahead(self, reader_id: str) -> list[int]:
        """The reader's current shard and the shards its depth reads ahead."""
        with self._lock:
            reader = self._readers.get(reader_id)
            if reader is None:
                return []
            depth = self.settings.prefetch_depth if reader.depth is None else reader.depth
            return reader.upcoming(depth + 1)

    def _still_all_resident(self) -> bool:
        """Whether every shard of the manifest is known to be in the memory tier without
        looking at any: nothing left the sole-writer tier since a walk
        (`_every_shard_resident`) last found every shard there. False where that is not
        known (another writer, a removal since, no walk yet): a caller then looks."""
        removals = self.memory.removals
        return removals is not None and removals == self._all_resident_at

    def _schedule(self, only: str | None = None) -> None:
        """Prefetch what the readers (or reader `only`) will read next and is missing,
        each shard as urgently as the reader nearest to it needs it."""
        if self._closed or self._still_all_resident():
            # Nothing is missing: no reader's next shards to walk at every request (a
            # set lookup each would find every one resident and queue nothing).
            return
        for reader_id in self.reader_ids() if only is None else [only]:
            for index, shard in enumerate(self._ahead(reader_id)):
                self._enqueue(shard, (index, work_queues.READAHEAD), "readahead")

    def _fill(self, reader_id: str) -> None:
        """Queue the rest of reader `reader_id`'s epoch, from where it is now, behind
        every reader's readahead, round robin with the other readers' fills (each
        reader's i-th shard is needed at about the same time): as far as the memory
        tier's room goes (`_fill_room`; each decode checks again with the shard's exact
        size), topped up as the fetch threads finish. A prefetch depth of 0 turns
        read-ahead off, and the fill with it."""
        if self._closed or self.settings.prefetch_depth == 0:
            return
        if self.settings.memory_sole_writer and self._every_shard_resident():
            # No plan to walk for what is missing, at every reader's epoch start.
            self._fill_warm(reader_id)
            return
        contains, keys = self.memory.contains, self._memory_keys
        count = len(self.manifest.shards)
        with self._lock:
            reader = self._readers.get(reader_id)
            ranks = self._fill_ranks.get(reader_id, 1)
            lists = [] if reader is None else [reader.upcoming(count)]
        # Sample mode and elastic segments: another rank's plan is not this one's slice
        # of the one epoch order, so only the reader's own is filled.
        if (
            reader is not None
            and ranks > 1
            and not reader.params.sampled
            and reader.params.segments is None
        ):
            # The other ranks at the same position: all ranks of a job start together
            # (and resume at the same step), and share one epoch order.
            params = reader.params
            for rank in range(params.rank + 1, params.rank + min(ranks, params.world_size)):
                other = dataclasses.replace(params, rank=rank % params.world_size)
                lists.append(self._orders.rank_spans(other).next(reader.position, count))
        if not any(not contains(keys[shard]) for shards in lists for shard in shards):
            self._fill_warm(reader_id)
            return
        with self._fill_lock:
            self._fill_plans[reader_id] = lists
            self._plan_fill()
        self._top_up()

    def _fill_warm(self, reader_id: str) -> None:
        """The warm case: nothing of reader `reader_id`'s epoch is missing. Unless a fill
        is still queued (rebuilt without this reader's last epoch, as before), there is
        nothing to order: no look at every other reader's plan on the event loop at
        every reader's epoch start."""
        with self._fill_lock:
            self._fill_plans.pop(reader_id, None)
            if not self._fill_rest:
                return
            self._plan_fill()
        self._top_up()

    def _plan_fill(self) -> None:
        """The fill not queued yet, from the readers' plans (holding `_fill_lock`)."""
        order = [
            (shard, index)
            for shard, index in fill_orders.interleaved(
                [plan for lists in self._fill_plans.values() for plan in lists]
            )
            if not self.memory.contains(self._memory_keys[shard])
        ]
        self._fill_rest = collections.deque(order)
        self._fill_rest_bytes = sum(self.manifest.shards[s].size for s, _ in order)

    @property
    def _expansion(self) -> float:
        return _FIRST_EXPANSION if self._expansion_seen is None else self._expansion_seen

    def _top_up(self) -> None:
        """Queue the fill's next shards while the fetch threads have few queued and the
        memory tier has room by the expansion known now; each shard's room is checked
        again when a fetch thread takes it, and with its exact size before it is
        decoded. Called when a fill starts and whenever a fetch thread is done."""
        if not self._fill_rest:
            return
        with self._fill_lock:
            want = _FILL_AHEAD_PER_THREAD * self.fetch_concurrency - len(self._queue)
            used = float(self.memory.resident_bytes())
            while self._fill_rest and want > 0:
                shard, index = self._fill_rest[0]
                source_size = self.manifest.shards[shard].size
                if self.memory.contains(self._memory_keys[shard]):
                    self._fill_rest.popleft()
                    self._fill_rest_bytes -= source_size
                    continue
                size = source_size * self._expansion
                if not self._fill_room(size, used=used):
                    return  # tried again when a fetch thread is done
                self._fill_rest.popleft()
                self._fill_rest_bytes -= source_size
                used += size
                want -= 1
                self._enqueue(shard, (index, work_queues.FILL), "fill")

    def _fill_room(self, size: float, *, used: float | None = None) -> bool:
        """Whether the fill may decode a shard of `size` bytes now, the memory tier
        holding `used` bytes in committed entries (default: what it holds now).

        When the rest of the fill fits too (by the expansion known now), it may take
        the room: it is the readers' own next shards, fetched early. When it does not,
        the fill keeps room for a wave of readahead, `fetch_concurrency` shards of that
        size, so that it never takes the room a reader's next shards need (readahead
        never evicts) for shards read later. What is decoding now (the decode budget
        held) is that wave, or part of it."""
        if used is None:
            # Committed entries only: one being inserted by this process is still in
            # the decode budget's `held` (held until inserted), and would count twice.
            used = self.memory.resident_bytes()
        held = float(self._decoding.held)
        if self._expansion_seen is not None:
            # Decodes reserve their footer's bound; what they will take is the ratio seen.
            with self._lock:
                running = len(self._inflight)
            held = min(held, running * self._largest_source * self._expansion_seen)
        limit = self.settings.memory_limit
        if used + held + self._fill_rest_bytes * self._expansion + size <= limit:
            return True
        return used + max(held, self.fetch_concurrency * size) + size <= limit

    def _enqueue(self, shard: int, priority: work_queues.Priority, why: str) -> None:
        if self.memory.contains(self._memory_keys[shard]):
            return
        with self._lock:
            if shard in self._inflight or self._closed:
                return
            if not self._workers:
                self._workers = [
                    threading.Thread(target=self._work, name=f"shardcache-fetch-{i}", daemon=True)
                    for i in range(self.fetch_concurrency)
                ]
                for worker in self._workers:
                    worker.start()
        self._queue.put(shard, priority, why)

    def _work(self) -> None:
        """A fetch thread: the most urgent shard wanted, one at a time, until closed."""
        while (item := self._queue.get()) is not None:
            shard, (index, _), why, queued = item
            try:
                if self._prefetch(shard, why, queued) == "later":
                    # Tried again with the next top-up, ahead of the rest of the fill:
                    # the room (or what the fill knows of the shards' sizes) changes.
                    # One whose exact size found no room is not: readahead fetches it
                    # (from the disk tier) when a reader comes near it.
                    with self._fill_lock:
                        self._fill_rest.appendleft((shard, index))
                        self._fill_rest_bytes += self.manifest.shards[shard].size
                self._top_up()
            finally:
                self._queue.done()

    def _prefetch(self, shard: int, why: str, queued: float | None = None) -> str:
        """Make `shard` resident for the readahead or the fill; "later" when the fill
        has no room for it by its estimated size, else what came of it."""
        if self._closed or self.memory.contains(self._memory_keys[shard]):
            return "resident"
        if why == "fill" and not self._fill_room(
            self.manifest.shards[shard].size * self._expansion
        ):
            return "later"
        try:
            outcome, _ = self._materialize(shard, why=why, wait=None, queued=queued)
            return outcome
        except Exception as exc:
            # The reader that needs this shard gets the error from its own acquire.
            log.warning("prefetch of shard %d failed: %s", shard, exc)
            return "failed"

    def prefetching(self) -> int:
        """Shards queued for the fetch threads or being made resident by them (0: the
        prefetcher is idle; an acquire may still be fetching for itself)."""
        return self._queue.unfinished

    def warm(self, shards: Sequence[int]) -> None:
        """Make shards resident now (blocking), e.g. a startup plan's first shards."""
        for shard in shards:
            self._check_index(shard)
            _, entry = self._materialize(shard, why="acquire", wait=None)
            if entry is not None:
                entry.release()

    def is_ready(self, first_k: int) -> bool:
        """True when the first `first_k` shards of every registered plan are resident."""
        for reader_id in self.reader_ids():
            for shard in self.upcoming(reader_id, first_k):
                if not self.memory.contains(self.manifest.decoded_key(shard)):
                    return False
        return True

    def stats(self) -> NodeStats:
        """The counts so far and each tier's size now. A tier whose directory fails
        (no permission, gone) is named in `tier_errors`, not raised: the rest of the
        figures are still read, and a metrics scrape still answers."""
        stats = self._events.snapshot()
        stats.disk_resident_bytes = self._resident(self.disk, stats)
        stats.disk_limit_bytes = self._bound(self.disk, stats)
        stats.disk_own_limit_bytes = self.settings.disk_limit
        stats.memory_resident_bytes = self._resident(self.memory, stats)
        stats.memory_limit_bytes = self.settings.memory_limit
        need = self.window_need()
        stats.sample_windows_bytes = need.bytes + self._claimed_elsewhere(need)[1]
        stats.readers = len(self.reader_ids())
        return stats

    def _bound(self, tier: tiers.Tier, stats: NodeStats) -> int:
        if tier.name in stats.tier_errors:
            return tier.limit_bytes  # its directory fails: its own limit is all it knows
        return tier.bound_bytes()

    def _resident(self, tier: tiers.Tier, stats: NodeStats) -> int:
        try:
            found = tier.resident_bytes(timeout=STATS_LOCK_TIMEOUT_S)
        except OSError as exc:  # a LockTimeout too: a stopped process holds the lock
            why = f"{tier.name} tier {tier.root}: {type(exc).__name__}: {exc}"
            stats.tier_errors[tier.name] = why
            if self._tier_errors_seen.get(tier.name) != why:
                # Once per distinct error, not at every scrape.
                self._tier_errors_seen[tier.name] = why
                log.warning("reading the size of the %s", why)
            return 0
        self._tier_errors_seen.pop(tier.name, None)
        return found

    def close(self) -> None:
        self._closed = True
        if self._claims is not None:
            with self._claims_lock:
                self._claims.close()
        self._queue.close()
        with self._lock:
            workers = list(self._workers)
        for worker in workers:
            worker.join()
