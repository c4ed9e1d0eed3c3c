"""Which failed fetches the node counts as a reader's (`fetch_failures`, the sidecar's
`shardcache_source_errors_total{op="fetch"}`) and which as the readahead's
(`readahead_failures`): decided when the attempt ends, by whether a reader waited on it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardcache import errors
from shardcache.node import caches
from tests.support import nodes, waiting

pytestmark = pytest.mark.integration

SHARDS = [120, 80, 100, 60, 90]


@pytest.fixture
def node(tmp_path: Path) -> Iterator[caches.CacheNode]:
    yield from nodes.quiet_node(tmp_path, SHARDS)


def failing_fetch(node: caches.CacheNode, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Every fetch waits for the event returned, then fails as a lost object does."""
    go = threading.Event()

    def fetch(shard: int, tmp: Path, **_: object) -> None:
        go.wait(30)
        raise errors.SourceError(f"fetching shard {shard}: gone")

    monkeypatch.setattr(node, "_fetch", fetch)
    return go


def counts(node: caches.CacheNode) -> tuple[int, int]:
    stats = node.stats()
    return stats.fetch_failures, stats.readahead_failures


def test_a_readahead_failure_nobody_waited_on_counts_apart(
    node: caches.CacheNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    failing_fetch(node, monkeypatch).set()
    assert node._prefetch(2, "readahead") == "failed"
    assert node._prefetch(2, "fill") == "failed"
    assert counts(node) == (0, 2)
    failure = node.stats().last_fetch_error
    assert failure is not None and failure.shard == 2
    with pytest.raises(errors.SourceError):
        node.acquire(2, timeout=30)
    assert counts(node) == (1, 2)


def test_a_readahead_an_acquire_joined_counts_once_as_the_readers(
    node: caches.CacheNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    go = failing_fetch(node, monkeypatch)
    ahead = threading.Thread(target=node._prefetch, args=(2, "readahead"), daemon=True)
    ahead.start()
    waiting.wait_until("the readahead's attempt", lambda: node.in_flight(2))
    got: list[BaseException] = []

    def acquire() -> None:
        try:
            node.acquire(2, timeout=30)
        except errors.ShardcacheError as exc:
            got.append(exc)

    reader = threading.Thread(target=acquire, daemon=True)
    reader.start()
    waiting.wait_until(
        "the acquire to join it",
        lambda: (node.in_flight(2) or {}).get("waiting_acquires") == 1,
    )
    go.set()
    reader.join(30)
    ahead.join(30)
    assert len(got) == 1 and "gone" in str(got[0])
    # The reader saw that failed fetch: one source error, not a readahead failure too.
    assert counts(node) == (1, 0)
