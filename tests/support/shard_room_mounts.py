"""DatasetMounts and fake manifests for the ShardTooLargeToDecode tests (the pin's
Event, tests/unit/test_shard_room.py; the condition, test_shard_room_condition.py):
the reconcile core driven with a resolver that serves a manifest of given shard sizes."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from shardcache_operator import reconcile

DIGEST = "sha256:" + "cd" * 32
OTHER_DIGEST = "sha256:" + "ef" * 32
MiB = 1 << 20
#: A mixture's further source (`with_further_source`).
FURTHER_URI = "s3://bucket/web/"


@dataclasses.dataclass(frozen=True)
class Shard:
    path: str
    size: int


@dataclasses.dataclass(frozen=True)
class Manifest:
    shards: tuple[Shard, ...]
    format: str = "parquet"
    digest: str = DIGEST
    total_rows: int = 10

    @property
    def total_bytes(self) -> int:
        return sum(s.size for s in self.shards)

    @property
    def shard_count(self) -> int:
        return len(self.shards)

    @property
    def largest_shard(self) -> Shard | None:
        return max(self.shards, key=lambda s: s.size, default=None)


#: The largest, 900Mi, is over the default 1Gi limit's 768Mi room by 132Mi.
SHARDS = (Shard("part-0.parquet", 300 * MiB), Shard("part-1.parquet", 900 * MiB))


async def no_secret(namespace: str, name: str) -> Mapping[str, str] | None:
    return None


def answers(
    uri: str, options: Mapping[str, str] | None, *, shard: reconcile.PinnedShard | None = None
) -> None:
    return None


def serves(manifest: Manifest) -> reconcile.Resolver:
    """A resolver serving `manifest` for every source, in the format asked for."""

    def resolve(uri: str, fmt: str, options: Mapping[str, str] | None) -> Manifest:
        return dataclasses.replace(manifest, format=fmt)

    return resolve


def not_listed(uri: str, fmt: str, options: Mapping[str, str] | None) -> Manifest:
    raise AssertionError(f"a kept pin is not listed again, but {uri} was")


def mount(fmt: str = "parquet", memory: str | None = None) -> dict[str, Any]:
    """A DatasetMount of one source; `memory`: spec.sidecar.resources.limits.memory
    (None: the default, 1Gi)."""
    spec: dict[str, Any] = {"source": {"uri": "s3://bucket/tokens/", "format": fmt}}
    if memory is not None:
        spec["sidecar"] = {"resources": {"limits": {"memory": memory}}}
    return {"metadata": {"name": "tokens", "namespace": "ml", "generation": 1}, "spec": spec}


def with_further_source(obj: dict[str, Any], name: str = "web") -> dict[str, Any]:
    """`obj` with a mixture of one further source, `name` at `FURTHER_URI`."""
    obj["spec"]["mixture"] = {
        "name": "tokens",
        "weight": 1,
        "sources": [{"name": name, "weight": 1, "uri": FURTHER_URI}],
    }
    return obj


def serves_mixture(source: Manifest, further: Manifest) -> reconcile.Resolver:
    """A resolver serving `further` at `FURTHER_URI`, `source` elsewhere."""

    def resolve(uri: str, fmt: str, options: Mapping[str, str] | None) -> Manifest:
        return further if uri == FURTHER_URI else source

    return resolve


def respecified(obj: dict[str, Any], memory: str) -> None:
    """A spec edit (kubectl apply) of the sidecar's memory limit only."""
    obj["spec"]["sidecar"] = {"resources": {"limits": {"memory": memory}}}
    obj["metadata"]["generation"] += 1
