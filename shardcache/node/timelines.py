"""Per-shard timelines of the cold path: when each shard waited, fetched, decoded.

A cold epoch is bound by how well the fetch slots are kept busy, not by any one stage
(docs/benchmarks.md, "One node, many ranks"), and the figures that say so are when each
shard was queued, took a slot, was fetched, was decoded and was inserted, per slot.
`CacheNode` stamps them here; one DEBUG line per shard on the `shardcache.node.timeline`
logger carries them (the sidecar's log, JSON fields with `SHARDCACHE_LOG_FORMAT=json`),
and `bench.node_timeline` turns a run's lines into slot occupancy over time.

Off unless that logger is enabled for DEBUG: then a stamp is a no-op on a shared null
object, so the cold path pays one `isEnabledFor` call per shard.

Times are `time.monotonic()`, the machine-wide monotonic clock on Linux, so a
benchmark in another process can place them against its own.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Final

log = logging.getLogger("shardcache.node.timeline")

#: The stages, in the order a shard passes them. `queued`: asked for (readahead
#: scheduled it, or an acquire found it missing); `slot`: took a fetch slot;
#: `fetched`: its source bytes are in the disk tier (fetched, or found there);
#: `decode`: its decoded size is reserved and decoding starts; `decoded`: decoded,
#: the slot is let go; `inserted`: written to the memory tier (or not, see `outcome`).
STAGES: Final = ("queued", "slot", "fetched", "decode", "decoded", "inserted")
#: The message of every timeline line; the bench finds them by it.
MESSAGE: Final = "shard timeline"


class Stamps:
    """One shard's pass through the cold path (one attempt: a shard evicted and fetched
    again gets another line)."""

    __slots__ = ("shard", "thread", "times", "why")

    def __init__(self, shard: int, why: str, queued: float) -> None:
        self.shard = shard
        #: "readahead", "fill" (beyond every reader's depth) or "acquire".
        self.why = why
        self.times: dict[str, float] = {"queued": queued}
        self.thread = ""

    def mark(self, stage: str) -> None:
        self.times[stage] = time.monotonic()
        if stage == "slot":
            self.thread = threading.current_thread().name

    def done(self, outcome: str) -> None:
        """Log the line: `outcome` is "inserted", "resident" (another process or an
        earlier attempt made it resident first), "no room" or "failed"."""
        fields: dict[str, Any] = {
            "shard": self.shard,
            "why": self.why,
            "worker": self.thread,
            "outcome": outcome,
            **{f"t_{stage}": round(t, 6) for stage, t in self.times.items()},
        }
        log.debug(MESSAGE, extra=fields)


class _Off(Stamps):
    """What `start` returns when nobody listens: every call does nothing."""

    def __init__(self) -> None:
        super().__init__(-1, "", 0.0)

    def mark(self, stage: str) -> None:
        pass

    def done(self, outcome: str) -> None:
        pass


OFF: Final[Stamps] = _Off()


def enabled() -> bool:
    return log.isEnabledFor(logging.DEBUG)


def start(shard: int, why: str, queued: float | None = None) -> Stamps:
    """Stamps for `shard` from `queued` (default now), or `OFF` when not logged."""
    if not log.isEnabledFor(logging.DEBUG):
        return OFF
    return Stamps(shard, why, time.monotonic() if queued is None else queued)
