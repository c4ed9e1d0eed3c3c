"""Embedded mode: the node cache runs inside the trainer process.

For laptops, notebooks, tests and `make demo`: the same CacheNode the sidecar runs,
without a sidecar.
"""

from __future__ import annotations

import uuid

from shardcache import manifest as manifest_mod
from shardcache import plan
from shardcache.node import cache as cache_mod
from shardcache.node import tier as tier_mod


class EmbeddedProvider:
    def __init__(self, node: cache_mod.CacheNode) -> None:
        self.node = node

    @property
    def manifest(self) -> manifest_mod.Manifest:
        return self.node.manifest

    def open_reader(self, params: plan.PlanParams, *, position: int) -> str:
        reader_id = f"embedded-{params.rank}-{uuid.uuid4().hex[:8]}"
        self.node.register_reader(reader_id, params, position)
        return reader_id

    def acquire(self, reader_id: str, shard: int, *, epoch: int, position: int) -> tier_mod.Entry:
        self.node.update_reader(reader_id, epoch=epoch, position=position)
        return self.node.acquire(shard)

    def close_reader(self, reader_id: str) -> None:
        self.node.unregister_reader(reader_id)

    def close(self) -> None:
        self.node.close()
