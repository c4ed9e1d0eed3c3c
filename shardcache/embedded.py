"""Embedded mode: the node cache runs inside the trainer process.

For laptops, notebooks, tests and `make demo`: the same CacheNode the sidecar runs,
without a sidecar.
"""

from __future__ import annotations

import uuid

from shardcache import manifests, plans
from shardcache.node import caches, tiers


class EmbeddedProvider:
    def __init__(self, node: caches.CacheNode) -> None:
        self.node = node

    @property
    def manifest(self) -> manifests.Manifest:
        return self.node.manifest

    def open_reader(self, params: plans.PlanParams, *, position: int) -> str:
        reader_id = f"embedded-{params.rank}-{uuid.uuid4().hex[:8]}"
        self.node.register_reader(reader_id, params, position)
        return reader_id

    def acquire(self, reader_id: str, shard: int, *, epoch: int, position: int) -> tiers.Entry:
        self.node.update_reader(reader_id, epoch=epoch, position=position)
        return self.node.acquire(shard)

    def close_reader(self, reader_id: str) -> None:
        self.node.unregister_reader(reader_id)

    def close(self) -> None:
        self.node.close()
