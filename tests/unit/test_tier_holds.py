"""A sole writer's holds kept in its own memory (`Tier.hold`): no lease file's system
calls, and an entry held so is never evicted, exactly as one leased on disk."""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from shardcache.node import _locks, tiers

pytestmark = pytest.mark.unit

SIZE = 100


def writer(content: bytes) -> Callable[[Path], None]:
    def produce(path: Path) -> None:
        path.write_bytes(content)

    return produce


def put(tier: tiers.Tier, key: str, content: bytes = b"x" * SIZE) -> None:
    tier.insert(key, len(content), writer(content)).release()


def sole(root: Path, limit: int = 1 << 20) -> tiers.Tier:
    return tiers.Tier(
        root,
        limit_bytes=limit,
        name="memory",
        fsync=False,
        verify="never",
        hashed=False,
        sole_writer=True,
    )


@pytest.fixture
def lease_files(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every lock file the tiers open from now on (`_locks.open_for_lock`)."""
    opened: list[str] = []
    real = _locks.open_for_lock

    def counted(path: Path, flags: int, mode: int = 0o644) -> int:
        opened.append(os.fspath(path))
        return real(path, flags, mode)

    monkeypatch.setattr(_locks, "open_for_lock", counted)
    return opened


def test_a_sole_writers_hold_opens_no_lease_file_once_a_lookup_read_the_meta(
    tmp_path: Path, lease_files: list[str]
) -> None:
    tier = sole(tmp_path)
    put(tier, "k")
    first = tier.hold("k")  # no meta read since the commit: a lookup, with its lease
    assert first is not None
    first.release()
    lease_files.clear()
    held = tier.hold("k")
    assert held is not None and held.size == SIZE and held.path.read_bytes() == b"x" * SIZE
    assert held.key == "k" and held.leased
    assert lease_files == []
    held.release()
    assert not held.leased
    assert tier.hold("absent") is None and lease_files == []


def test_an_entry_held_in_memory_is_never_evicted_until_released(tmp_path: Path) -> None:
    tier = sole(tmp_path, limit=2 * SIZE)
    put(tier, "a")
    put(tier, "b")
    tier.hold("a").release()  # type: ignore[union-attr]  (reads the meta)
    held = tier.hold("a")
    assert held is not None
    assert not tier.evict("a")
    assert tier.leased_bytes() == SIZE
    # Making room takes the unheld entry, never the held one.
    put(tier, "c")
    assert tier.contains("a") and not tier.contains("b") and tier.contains("c")
    assert held.path.read_bytes() == b"x" * SIZE
    held.release()
    assert tier.leased_bytes() == 0
    assert tier.evict("a") and not tier.contains("a")


def test_two_holds_of_one_entry_keep_it_until_both_are_released(tmp_path: Path) -> None:
    tier = sole(tmp_path)
    put(tier, "a")
    tier.hold("a").release()  # type: ignore[union-attr]
    one, two = tier.hold("a"), tier.hold("a")
    assert one is not None and two is not None
    one.release()
    one.release()  # idempotent: the other hold still counts
    assert not tier.evict("a")
    two.release()
    assert tier.evict("a")


def test_a_hold_dropped_without_release_lets_go_when_collected(tmp_path: Path) -> None:
    tier = sole(tmp_path)
    put(tier, "a")
    tier.hold("a").release()  # type: ignore[union-attr]
    held = tier.hold("a")
    assert held is not None and not tier.evict("a")
    del held
    gc.collect()
    assert tier.evict("a")


def test_a_hold_of_an_entry_truncated_behind_the_writers_back_is_a_lookup_that_removes_it(
    tmp_path: Path,
) -> None:
    tier = sole(tmp_path)
    put(tier, "a")
    tier.hold("a").release()  # type: ignore[union-attr]
    (tmp_path / "a").write_bytes(b"short")
    assert tier.hold("a") is None
    assert not tier.contains("a") and not (tmp_path / "a").exists()
    # Evicted and made again: the next hold reads the new commit's meta.
    put(tier, "a", b"y" * (2 * SIZE))
    held = tier.hold("a")
    assert held is not None and held.size == 2 * SIZE
    held.release()


def test_a_hold_of_an_entry_removed_behind_the_writers_back_is_a_miss_and_forgotten(
    tmp_path: Path,
) -> None:
    tier = sole(tmp_path)
    put(tier, "a")
    tier.hold("a").release()  # type: ignore[union-attr]
    os.unlink(tmp_path / "a")
    os.unlink(tmp_path / "a.meta.json")
    assert tier.hold("a") is None
    assert not tier.contains("a")


def test_a_shared_tiers_hold_is_a_lookup_with_its_lease(
    tmp_path: Path, lease_files: list[str]
) -> None:
    tier = tiers.Tier(
        tmp_path, limit_bytes=1 << 20, name="memory", fsync=False, verify="never", hashed=False
    )
    put(tier, "a")
    tier.hold("a").release()  # type: ignore[union-attr]
    lease_files.clear()
    held = tier.hold("a")
    assert held is not None
    assert lease_files == [os.fspath(tmp_path / "a.lock")]
    held.release()


def test_an_entry_needs_exactly_one_way_to_be_let_go() -> None:
    with pytest.raises(ValueError):
        tiers.Entry(key="a", path=Path("a"), size=1, sha256=None)
    with pytest.raises(ValueError):
        tiers.Entry(key="a", path=Path("a"), size=1, sha256=None, lease_fd=3, unpin=lambda: None)
