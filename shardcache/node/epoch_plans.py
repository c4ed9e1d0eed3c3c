"""Every rank's plan from one global order per epoch, kept per node.

A reader's plan (`plans.rank_runs`) is its slice of the epoch's global order
(`plans.global_runs`), and that order depends only on the manifest, the seed, the
epoch, whether to shuffle and the block size: the same for every rank of a job. Made
whole from scratch it is a permutation of the shards and one of each shard's blocks,
in pure Python: 5-15 ms for 48 shards of 42 blocks, held under the GIL. When eight or
sixteen ranks on a node open (or enter the next epoch) at the same instant, the
sidecar made that same order once per rank, while their requests waited behind it. An
`EpochPlans` keeps one `plans.EpochOrder` per epoch: the shard order, and each shard's
runs once some rank's range covered it. A rank's plan is then a bisection and its own
shards' runs, made once per node, and exactly `plans.rank_runs`'s result.

The node itself only needs which shard a reader reads where (`rank_spans`: what it reads
ahead and grants), which the shard order gives without any shard's runs.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence

from shardcache import plans

#: Global orders kept: ranks of one job read the same epoch, or at most two while the
#: fast ones are in the next; more is for several jobs (seeds) on one sidecar.
KEPT = 8

_Key = tuple[bool, int, int, int]


class EpochPlans:
    """`rank_runs(params)` for one manifest (its shards' rows and its digest), sharing
    each epoch's order between ranks."""

    def __init__(self, shard_rows: Sequence[int], digest: str) -> None:
        self._rows = list(shard_rows)
        self._digest = digest
        self._total = sum(self._rows)
        #: Epoch orders, most recently used last.
        self._orders: collections.OrderedDict[_Key, plans.EpochOrder] = collections.OrderedDict()
        #: `blocks()` by block size.
        self._blocks: dict[int, int] = {}
        # Readers register from the event loop and the thread pool alike.
        self._lock = threading.Lock()

    def rank_runs(self, params: plans.PlanParams) -> list[plans.Run]:
        """What `plans.rank_runs(shard_rows, digest, params)` returns (block mode)."""
        ranges = plans.stream_ranges(self._total, params)
        if not ranges:
            return []
        return self._order(params).slice(ranges)

    def rank_spans(self, params: plans.PlanParams) -> plans.ShardSpans:
        """`plans.ShardSpans` of `rank_runs(params)` (block mode), from the epoch's shard
        order alone: what the node reads ahead and grants along, without permuting any
        shard's blocks (the first rank into an epoch made its shards' runs before)."""
        ranges = plans.stream_ranges(self._total, params)
        if not ranges:
            return plans.ShardSpans([], [])
        return self._order(params).spans(ranges)

    def blocks(self, block_size: int) -> int:
        """Blocks of `block_size` rows in the whole manifest (each shard's last one may
        be short): what making the runs of every shard costs, in units of one block."""
        with self._lock:
            found = self._blocks.get(block_size)
            if found is None:
                found = self._blocks[block_size] = sum(-(-r // block_size) for r in self._rows)
            return found

    def has(self, params: plans.PlanParams) -> bool:
        """Whether the epoch order `rank_runs(params)` slices is started already (another
        rank of the job made it): a rank's plan is then its own shards' runs at most."""
        with self._lock:
            return _key(params) in self._orders

    def _order(self, params: plans.PlanParams) -> plans.EpochOrder:
        key = _key(params)
        with self._lock:
            order = self._orders.get(key)
            if order is None:
                order = plans.EpochOrder(self._rows, self._digest, params)
                self._orders[key] = order
                while len(self._orders) > KEPT:
                    self._orders.popitem(last=False)
            else:
                self._orders.move_to_end(key)
            return order


def _key(params: plans.PlanParams) -> _Key:
    # Exactly what `plans.global_runs` reads of the params.
    return (params.shuffle, params.seed, params.epoch, params.block_size)
