"""The sidecar's prefetch-depth tuner: feeds the controller (`prefetch_depths`) per reader,
and applies, logs and exports what it decides.

Inputs, gathered on the event loop as requests arrive: each reader's acquires that found
their shard not resident (`missed`, with the seconds they waited), the largest decoded
shard seen (`sized`: the room one more shard ahead takes), and each stall report
(`reported`, from a reader's notes, about once a second), which is when a decision is
made. The depth is applied to the cache node (`CacheNode.set_prefetch_depth`), which
schedules the shards a deeper depth reaches at once. Every change is one log line
(reader, rank, old, new, reason) and one count of `shardcache_prefetch_depth_changes_total`
by direction and reason; `shardcache_prefetch_depth{reader,rank}` is read from the node
at scrape time (`Metrics.watch_depths`).

Not thread-safe: the control server calls it from the event loop only.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Protocol

from shardcache.contract import protocol
from shardcache.node import caches
from shardcache_sidecar import configuration, prefetch_depths, readers

log = logging.getLogger(__name__)


class Changes(Protocol):
    """Where the tuner counts each change (the sidecar's `Metrics`)."""

    def depth_changed(self, direction: str, reason: str) -> None: ...


@dataclasses.dataclass
class _Reader:
    """What one reader did since its last stall report, and its controller state."""

    misses: int = 0
    waited_seconds: float = 0.0
    state: prefetch_depths.State | None = None


def policy_for(settings: configuration.Settings) -> prefetch_depths.Policy | None:
    """The controller's bounds from the sidecar's settings; None when it does not tune:
    adaptive is off, or read-ahead is (depth 0, an explicit choice it keeps)."""
    if not settings.prefetch_adaptive or settings.prefetch_depth == 0:
        return None
    return prefetch_depths.Policy(
        floor=settings.prefetch_depth, ceiling=settings.prefetch_max_depth
    )


class Tuner:
    def __init__(
        self,
        policy: prefetch_depths.Policy | None,
        *,
        memory_limit: int,
        reserved_shards: int,
        changes: Changes,
    ) -> None:
        self.policy = policy
        self._memory_limit = memory_limit
        #: Shards kept besides every reader's window: the startup shards a restarted
        #: sidecar warms (the room `control._grant_ahead` keeps too).
        self._reserved_shards = reserved_shards
        self._changes = changes
        self._readers: dict[str, _Reader] = {}
        #: Bytes of the largest decoded shard an acquire returned; 0 before the first.
        self.shard_bytes = 0

    @classmethod
    def for_settings(cls, settings: configuration.Settings, changes: Changes) -> Tuner:
        return cls(
            policy_for(settings),
            memory_limit=settings.memory_limit,
            reserved_shards=settings.ready_shards,
            changes=changes,
        )

    @property
    def enabled(self) -> bool:
        return self.policy is not None

    def sized(self, nbytes: int) -> None:
        """An acquire returned a decoded shard of `nbytes`."""
        self.shard_bytes = max(self.shard_bytes, nbytes)

    def missed(self, reader_id: str, seconds: float) -> None:
        """An acquire of reader `reader_id` found its shard not resident and waited."""
        if self.policy is None:
            return
        seen = self._readers.setdefault(reader_id, _Reader())
        seen.misses += 1
        seen.waited_seconds += seconds

    def forget(self, reader_id: str) -> None:
        """Reader `reader_id` unregistered: drop what was kept for it."""
        self._readers.pop(reader_id, None)

    def reported(
        self,
        reader: readers.Reader,
        stalls: protocol.Stalls,
        *,
        node: caches.CacheNode,
        registered: list[readers.Reader],
    ) -> prefetch_depths.Decision | None:
        """Decide reader `reader`'s depth after its stall report, and apply a change.

        `registered`: every reader of the sidecar (their windows are kept in the room).
        None when not tuning, or before any shard's size is known."""
        policy = self.policy
        if policy is None:
            return None
        # Readers gone without unregistering (a sidecar that lost track) leave too.
        ids = {r.reader_id for r in registered}
        for gone in [r for r in self._readers if r not in ids]:
            del self._readers[gone]
        seen = self._readers.setdefault(reader.reader_id, _Reader())
        signal = prefetch_depths.Signal(
            stall_fraction=stalls.recent_fraction,
            misses=seen.misses,
            waited_seconds=seen.waited_seconds,
        )
        seen.misses, seen.waited_seconds = 0, 0.0
        if self.shard_bytes == 0:
            return None
        # The node's depth is the truth: a reader whose plan was replaced starts over
        # at the configured depth there.
        old = node.prefetch_depth(reader.reader_id)
        state = (
            prefetch_depths.State(depth=old)
            if seen.state is None
            else dataclasses.replace(seen.state, depth=old)
        )
        space = prefetch_depths.room(
            self._memory_limit,
            depths=[node.prefetch_depth(r.reader_id) for r in registered],
            shard_bytes=self.shard_bytes,
            reserved_shards=self._reserved_shards,
        )
        decision = prefetch_depths.decide(policy, state, signal, space)
        seen.state = decision.state
        if decision.reason is not None:
            new = decision.state.depth
            node.set_prefetch_depth(reader.reader_id, new)
            direction = "up" if new > old else "down"
            self._changes.depth_changed(direction, decision.reason.value)
            log.info(
                "prefetch depth of reader %s: %d -> %d (%s)",
                reader.reader_id,
                old,
                new,
                decision.reason.value,
                extra={
                    "event": "prefetch_depth",
                    "reader": reader.reader_id,
                    "rank": reader.params.rank,
                    "old": old,
                    "new": new,
                    "reason": decision.reason.value,
                    "stall_fraction": round(signal.stall_fraction, 4),
                    "misses": signal.misses,
                    "waited_s": round(signal.waited_seconds, 3),
                    "free_bytes": space.free_bytes,
                    "shard_bytes": space.shard_bytes,
                },
            )
        return decision
