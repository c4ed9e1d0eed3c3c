"""A sole-writer tier answers membership from memory, and stays exact (`tiers._membership`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from shardcache.node import tiers

pytestmark = pytest.mark.unit


def writer(content: bytes) -> Callable[[Path], None]:
    def produce(path: Path) -> None:
        path.write_bytes(content)

    return produce


def put(tier: tiers.Tier, key: str, content: bytes) -> None:
    tier.insert(key, len(content), writer(content)).release()


@pytest.fixture
def stats(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every `os.stat` (and so `os.path.exists`) made while the test runs, by path."""
    seen: list[str] = []
    real = os.stat

    def counted(path: object, *args: object, **kwargs: object) -> os.stat_result:
        seen.append(os.fsdecode(path))  # type: ignore[arg-type]
        return real(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "stat", counted)
    yield seen


def test_a_sole_writer_answers_contains_and_a_miss_without_a_stat(
    tmp_path: Path, stats: list[str]
) -> None:
    tier = tiers.Tier(tmp_path, limit_bytes=1 << 20, name="memory", fsync=False, sole_writer=True)
    put(tier, "present", b"x" * 100)
    stats.clear()
    assert tier.contains("present")
    assert not tier.contains("absent")
    assert tier.lookup("absent") is None
    assert stats == []
    # A hit still checks its files: the lease and the sizes are what make it exact.
    entry = tier.lookup("present")
    assert entry is not None and entry.path.read_bytes() == b"x" * 100
    entry.release()
    assert stats


def test_a_shared_tier_still_asks_the_files(tmp_path: Path, stats: list[str]) -> None:
    tier = tiers.Tier(tmp_path, limit_bytes=1 << 20, name="disk", fsync=False)
    put(tier, "present", b"x")
    # Another writer's entry is seen at once.
    put(tiers.Tier(tmp_path, limit_bytes=1 << 20, name="disk", fsync=False), "theirs", b"y")
    stats.clear()
    assert tier.contains("present") and tier.contains("theirs")
    assert stats


def test_a_sole_writer_starts_from_the_entries_already_in_its_directory(tmp_path: Path) -> None:
    # A restarted sidecar: the volume keeps the entries, the new process lists them.
    put(tiers.Tier(tmp_path, limit_bytes=1 << 20, name="memory", fsync=False), "kept", b"k")
    tier = tiers.Tier(tmp_path, limit_bytes=1 << 20, name="memory", fsync=False, sole_writer=True)
    assert tier.contains("kept")
    entry = tier.lookup("kept")
    assert entry is not None
    entry.release()


def test_a_sole_writer_forgets_what_it_evicts_and_what_it_finds_corrupted(tmp_path: Path) -> None:
    # Room for two entries of 100 bytes: the third insert evicts the least recently used.
    tier = tiers.Tier(tmp_path, limit_bytes=250, name="memory", fsync=False, sole_writer=True)
    put(tier, "a", b"a" * 100)
    put(tier, "b", b"b" * 100)
    put(tier, "c", b"c" * 100)
    assert [k for k in "abc" if tier.contains(k)] == ["b", "c"] == tier.keys()
    assert tier.evict("b")
    assert not tier.contains("b")
    # Damaged in place: the lookup finds the size wrong, removes it, and forgets it.
    (tmp_path / "c").write_bytes(b"c" * 10)
    assert tier.lookup("c") is None
    assert not tier.contains("c") and tier.keys() == []
    put(tier, "c", b"c" * 100)
    assert tier.contains("c")


def test_an_entry_removed_behind_a_sole_writers_back_is_a_miss_and_then_made_again(
    tmp_path: Path,
) -> None:
    tier = tiers.Tier(tmp_path, limit_bytes=1 << 20, name="memory", fsync=False, sole_writer=True)
    put(tier, "a", b"a" * 100)
    # The promise broken: another writer evicts it. Never a wrong hit...
    assert tiers.Tier(tmp_path, limit_bytes=1 << 20, name="memory", fsync=False).evict("a")
    assert tier.contains("a")  # stale until looked up, as documented
    assert tier.lookup("a") is None
    # ...and the miss is remembered, so the next producer makes it again.
    assert not tier.contains("a")
    entry, hit = tier.get_or_insert("a", 100, writer(b"a" * 100))
    assert not hit and entry.path.read_bytes() == b"a" * 100
    entry.release()
    assert tier.contains("a")


def test_a_listing_under_the_tier_lock_shows_a_sole_writer_what_others_changed(
    tmp_path: Path,
) -> None:
    tier = tiers.Tier(tmp_path, limit_bytes=1 << 20, name="memory", fsync=False, sole_writer=True)
    other = tiers.Tier(tmp_path, limit_bytes=1 << 20, name="memory", fsync=False)
    put(tier, "a", b"a" * 100)
    assert other.evict("a")
    put(other, "b", b"b" * 10)
    assert tier.contains("a") and not tier.contains("b")  # stale, as documented
    # A metrics scrape (`CacheNode.stats`) lists the tier: the set is the files again.
    assert tier.resident_bytes() == 10
    assert not tier.contains("a") and tier.contains("b")


def test_removals_change_with_every_way_a_key_leaves_the_set_and_never_with_a_commit(
    tmp_path: Path,
) -> None:
    tier = tiers.Tier(tmp_path, limit_bytes=250, name="memory", fsync=False, sole_writer=True)
    seen = [tier.removals]
    assert seen == [0]

    def changed() -> bool:
        seen.append(tier.removals)
        return seen[-1] != seen[-2]

    put(tier, "a", b"a" * 100)
    put(tier, "b", b"b" * 100)
    assert not changed()  # commits only add
    put(tier, "c", b"c" * 100)  # room for two: "a" is evicted
    assert changed()
    assert tier.evict("b")
    assert changed()
    assert tier.resident_bytes() == 100  # a listing that lost nothing
    assert not changed()
    (tmp_path / "c").write_bytes(b"c" * 10)  # damaged: the lookup removes it
    assert tier.lookup("c") is None
    assert changed()
    put(tier, "d", b"d" * 100)
    other = tiers.Tier(tmp_path, limit_bytes=1 << 20, name="memory", fsync=False)
    assert other.evict("d")  # behind its back: seen at the next lookup...
    assert not changed()
    assert tier.lookup("d") is None
    assert changed()
    put(tier, "e", b"e" * 100)
    assert other.evict("e")  # ...or at the next listing
    assert tier.resident_bytes() == 0
    assert changed()
    # A tier that is not the sole writer knows nothing without looking.
    assert other.removals is None
