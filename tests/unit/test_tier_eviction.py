"""The eviction order: least recently used first, ties broken by key, leased entries kept."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shardcache.node.tiers import _eviction

pytestmark = pytest.mark.unit


def entries(root: Path, spec: dict[str, tuple[int, int]]) -> dict[str, os.stat_result]:
    """Real files `key` of `size` bytes last used at `mtime_ns`, as a listing has them."""
    found = {}
    for key, (size, mtime_ns) in spec.items():
        path = root / key
        path.write_bytes(b"x" * size)
        os.utime(path, ns=(mtime_ns, mtime_ns))
        found[key] = os.stat(path)
    return found


def test_least_recently_used_comes_first_and_equal_times_go_by_key(tmp_path: Path) -> None:
    data = entries(tmp_path, {"b": (1, 2_000), "a": (1, 2_000), "c": (1, 1_000)})
    assert [key for key, _ in _eviction.least_recently_used(data)] == ["c", "a", "b"]


def test_evicts_oldest_only_until_the_new_entry_fits(tmp_path: Path) -> None:
    data = entries(tmp_path, {"old": (10, 1_000), "mid": (10, 2_000), "new": (10, 3_000)})
    removed: list[str] = []

    def remove(key: str, nbytes: int) -> bool:
        removed.append(key)
        return True

    used, leased = _eviction.evict_for(data, used=30, size=15, limit=35, remove=remove)
    assert removed == ["old"]
    assert (used, leased) == (20, 0)


def test_a_leased_entry_is_skipped_and_counted_as_held(tmp_path: Path) -> None:
    data = entries(tmp_path, {"pinned": (10, 1_000), "free": (10, 2_000), "hot": (10, 3_000)})

    def remove(key: str, nbytes: int) -> bool:
        return key != "pinned"

    used, leased = _eviction.evict_for(data, used=30, size=10, limit=30, remove=remove)
    assert (used, leased) == (20, 10)


def test_nothing_is_evicted_when_the_entry_already_fits(tmp_path: Path) -> None:
    data = entries(tmp_path, {"a": (10, 1_000)})

    def remove(key: str, nbytes: int) -> bool:
        raise AssertionError(f"evicted {key} although there was room")

    assert _eviction.evict_for(data, used=10, size=5, limit=20, remove=remove) == (10, 0)
