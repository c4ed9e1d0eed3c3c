"""Inserts beside the caller's own leases: "does not fit" is told at once, not waited for."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from shardcache import contract, errors
from shardcache.node import tiers
from tests.support import waiting

pytestmark = pytest.mark.unit

KIB = 1024
# Far longer than any of these tests may take: a test that waits for it has failed.
WAIT_TIMEOUT_S = 120.0


def writer(size: int) -> Callable[[Path], None]:
    def produce(path: Path) -> None:
        path.write_bytes(b"x" * size)

    return produce


def memory_tier(root: Path, limit: int) -> tiers.Tier:
    return tiers.Tier(
        root,
        limit_bytes=limit,
        name="memory",
        fsync=False,
        verify="never",
        wait_timeout=WAIT_TIMEOUT_S,
    )


def test_an_entry_that_does_not_fit_beside_the_callers_leases_fails_at_once(
    tmp_path: Path,
) -> None:
    t = memory_tier(tmp_path, 30 * KIB)
    a = t.insert("a", 10 * KIB, writer(10 * KIB))
    b = t.insert("b", 10 * KIB, writer(10 * KIB))
    with pytest.raises(tiers.RoomHeldError) as info:
        waiting.finishes(
            "an insert that cannot fit beside the caller's own leases",
            lambda: t.insert("c", 15 * KIB, writer(15 * KIB), held=a.size + b.size),
            timeout=WAIT_TIMEOUT_S / 2,
        )
    err = info.value
    assert (err.size, err.held, err.limit) == (15 * KIB, 20 * KIB, 30 * KIB)
    assert isinstance(err, errors.CacheError) and isinstance(err, tiers.TierFullError)
    assert "20480 bytes its caller holds" in str(err) and contract.ENV_MEMORY_LIMIT in str(err)
    assert t.keys() == ["a", "b"] and t.used_bytes() == 20 * KIB  # nothing reserved
    shard = err.about("shard 3 (part-00003.parquet)")
    assert str(shard).startswith("shard 3 (part-00003.parquet): entry c (15360 bytes)")
    assert (shard.size, shard.held, shard.limit) == (err.size, err.held, err.limit)
    a.release()
    b.release()


def test_an_entry_that_fits_beside_the_held_bytes_still_evicts_unleased_ones(
    tmp_path: Path,
) -> None:
    t = memory_tier(tmp_path, 30 * KIB)
    a = t.insert("a", 10 * KIB, writer(10 * KIB))
    t.insert("old", 15 * KIB, writer(15 * KIB)).release()
    c = t.get_or_insert("c", 20 * KIB, writer(20 * KIB), held=a.size)[0]
    assert t.keys() == ["a", "c"]
    a.release()
    c.release()


def test_an_entry_larger_than_the_whole_tier_is_too_large_whatever_is_held(
    tmp_path: Path,
) -> None:
    t = memory_tier(tmp_path, 8 * KIB)
    a = t.insert("a", 4 * KIB, writer(4 * KIB))
    with pytest.raises(tiers.EntryTooLargeError) as info:
        t.insert("big", 9 * KIB, writer(9 * KIB), held=a.size)
    assert not isinstance(info.value, tiers.RoomHeldError)
    assert (info.value.size, info.value.limit) == (9 * KIB, 8 * KIB)
    assert "holds at most 8192 bytes" in str(info.value.about("shard 0 (p)"))
    a.release()


def test_what_the_waiting_hook_raises_ends_an_insert_waiting_for_room_with_nothing_reserved(
    tmp_path: Path,
) -> None:
    t = memory_tier(tmp_path, 30 * KIB)
    a = t.insert("a", 10 * KIB, writer(10 * KIB))
    b = t.insert("b", 15 * KIB, writer(15 * KIB))
    calls: list[int] = []

    def waiting_hook() -> None:
        calls.append(len(calls))
        if len(calls) == 3:
            raise errors.CacheError("the room will not come")

    # Fits beside nothing the caller holds (held=0), so it would wait for a or b.
    with pytest.raises(errors.CacheError, match="the room will not come"):
        waiting.finishes(
            "an insert whose waiting hook gives up",
            lambda: t.insert("c", 10 * KIB, writer(10 * KIB), waiting=waiting_hook),
            timeout=WAIT_TIMEOUT_S / 2,
        )
    assert calls == [0, 1, 2]  # once before each wait, until it raised
    assert t.keys() == ["a", "b"] and t.used_bytes() == 25 * KIB  # nothing reserved
    a.release()
    c = t.insert("c", 10 * KIB, writer(10 * KIB), waiting=waiting_hook)
    assert len(calls) == 3, "an insert that found room at once never called the hook"
    c.release()
    b.release()


def test_an_entrys_size_is_its_data_files_and_none_without_one(tmp_path: Path) -> None:
    tier = memory_tier(tmp_path, 8 * KIB)
    tier.insert("k", 3 * KIB, writer(3 * KIB)).release()
    assert tier.size("k") == 3 * KIB
    assert tier.size("missing") is None
    assert tier.evict("k") and tier.size("k") is None
