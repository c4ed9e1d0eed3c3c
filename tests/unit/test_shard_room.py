"""A pinned shard the sidecar cannot decode in its memory limit is said when the
manifest is pinned (a Warning Event naming the shard, its size and the limit it needs),
not first when a pod reads it (`shard_room`; docs/operator.md, "Status, phases and
conditions"); a limit lowered on a kept pin says it too (test_shard_room_condition)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
from shardcache_operator import reconcile, shard_room

from tests.support.shard_room_mounts import (
    OTHER_DIGEST,
    SHARDS,
    Manifest,
    MiB,
    Shard,
    answers,
    mount,
    no_secret,
    not_listed,
    serves,
    serves_mixture,
    with_further_source,
)

pytestmark = pytest.mark.unit


async def pinned(obj: Mapping[str, Any], manifest: Manifest) -> list[reconcile.Event]:
    """The ShardTooLargeToDecode Events of `obj`'s first reconcile, pinning `manifest`."""
    result = await reconcile.reconcile(
        obj, read_secret=no_secret, resolve=serves(manifest), probe=answers, now="t"
    )
    assert result.status["phase"] == "Ready"
    return [e for e in result.events if e.reason == shard_room.REASON]


async def test_a_shard_over_the_default_limits_decode_room_is_a_warning_at_the_pin() -> None:
    (event,) = await pinned(mount(), Manifest(SHARDS))
    assert event.type == "Warning"
    message = event.message
    # The shard, its size, the room and the limit it comes from, and what to set.
    assert message.startswith("spec.source: shard 'part-1.parquet' is 900Mi at the source")
    assert "over the 768Mi the sidecar can decode a shard in" in message
    assert "spec.sidecar.resources.limits.memory 1Gi less 256Mi" in message
    assert "Set spec.sidecar.resources.limits.memory to at least 1156Mi" in message


async def test_a_mixtures_further_source_with_such_a_shard_is_named_in_the_warning() -> None:
    obj = with_further_source(mount())
    big = Manifest((Shard("big.parquet", 2 << 30),), digest=OTHER_DIGEST)
    result = await reconcile.reconcile(
        obj,
        read_secret=no_secret,
        resolve=serves_mixture(Manifest(SHARDS[:1]), big),
        probe=answers,
        now="t",
    )
    assert result.status["phase"] == "Ready"
    (event,) = [e for e in result.events if e.reason == shard_room.REASON]
    assert event.message.startswith(
        "spec.mixture.sources[0] (web): shard 'big.parquet' is 2Gi at the source"
    )


async def test_a_limit_with_room_for_the_largest_shard_says_nothing() -> None:
    raised = mount(memory="1156Mi")
    assert await pinned(raised, Manifest(SHARDS)) == []
    assert await pinned(mount(), Manifest(SHARDS[:1])) == []


async def test_json_lines_text_larger_than_the_room_says_nothing() -> None:
    """JSON Lines decodes smaller than its text: its stored size tells nothing."""
    jsonl = (Shard("a.jsonl", 900 * MiB),)
    assert await pinned(mount("jsonl"), Manifest(jsonl, format="jsonl")) == []


async def test_a_sidecar_without_a_memory_limit_says_nothing() -> None:
    unlimited = mount()
    unlimited["spec"]["sidecar"] = {"resources": {"limits": {"cpu": "2"}}}
    assert await pinned(unlimited, Manifest(SHARDS)) == []


async def test_a_kept_pin_is_not_listed_again_so_says_nothing_more() -> None:
    """One Event as the condition becomes True; none while it stays so, as each reconcile
    judges it again (test_shard_room_condition)."""
    obj = mount()
    first = await reconcile.reconcile(
        obj, read_secret=no_secret, resolve=serves(Manifest(SHARDS)), probe=answers, now="t"
    )
    obj["status"] = first.status
    again = await reconcile.reconcile(
        obj, read_secret=no_secret, resolve=not_listed, probe=answers, now="t2"
    )
    assert [e.reason for e in first.events].count(shard_room.REASON) == 1
    assert [e.reason for e in again.events].count(shard_room.REASON) == 0


def test_the_limit_needed_is_the_shard_and_the_process_base_in_whole_mib() -> None:
    assert shard_room.needed_limit(900 * MiB) == 1156 * MiB
    assert shard_room.needed_limit(900 * MiB + 1) == 1157 * MiB
