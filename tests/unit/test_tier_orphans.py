"""What a tier removes to make room, and what it never touches.

* An orphan (a data file left without its meta file by a process killed between a
  commit's two renames, or an eviction's two unlinks) is the tier's own: it counted
  against the limit for good, since eviction takes only committed entries and nothing
  called `scan`. It is reclaimed when the tier is full and when a node cache starts.
* A file the tier did not make, though named like a key (NCCL's `nccl-XXXXXX` in
  /dev/shm, a neighbour's file in a shared directory), is never removed, not even when
  the volume is out of space, and does not count against the tier's limit.
"""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from shardcache import errors
from shardcache.node import names, tiers
from shardcache.node.tiers import _no_space

pytestmark = pytest.mark.unit

KIB = 1024


def make_tier(tmp_path: Path, limit: int, **kwargs: object) -> tiers.Tier:
    return tiers.Tier(
        tmp_path / "tier",
        limit_bytes=limit,
        name="disk",
        fsync=False,
        wait_timeout=kwargs.pop("wait_timeout", 2.0),  # type: ignore[arg-type]
        **kwargs,  # type: ignore[arg-type]
    )


def writer(size: int) -> Callable[[Path], None]:
    def produce(path: Path) -> None:
        path.write_bytes(b"x" * size)

    return produce


def put(t: tiers.Tier, key: str, size: int) -> None:
    t.insert(key, size, writer(size)).release()


def orphan(t: tiers.Tier, key: str, size: int) -> Path:
    """What a kill between a commit's two renames leaves: `<key>` and `<key>.lock`."""
    t.root.mkdir(parents=True, exist_ok=True)
    (t.root / (key + names.LOCK_SUFFIX)).touch()
    data = t.root / key
    data.write_bytes(b"o" * size)
    return data


def test_an_orphan_is_reclaimed_when_the_tier_is_full(tmp_path: Path) -> None:
    t = make_tier(tmp_path, limit=20 * KIB, wait_timeout=0.5)
    left = orphan(t, "crashed", 16 * KIB)
    assert t.used_bytes() == 16 * KIB  # counted: it takes the volume's room
    # The old code waited for leases nobody held, then failed: the orphan never went.
    put(t, "next", 16 * KIB)
    assert not left.exists() and not (t.root / ("crashed" + names.LOCK_SUFFIX)).exists()
    assert t.keys() == ["next"]
    assert t.used_bytes() == 16 * KIB


def test_reclaim_removes_orphans_and_dead_writers_temp_files_and_nothing_else(
    tmp_path: Path,
) -> None:
    t = make_tier(tmp_path, limit=64 * KIB)
    put(t, "kept", 4 * KIB)
    orphan(t, "crashed", 8 * KIB)
    foreign = t.root / "precious"
    foreign.write_bytes(b"y" * (2 * KIB))
    dead = t.root / f"{names.TMP_PREFIX}1-abcd0123-{3 * KIB}-gone"
    dead.write_bytes(b"t" * KIB)
    assert t.reclaim() == (2, 8 * KIB + 3 * KIB)
    assert sorted(p.name for p in t.root.iterdir() if not p.name.startswith(".")) == [
        "kept",
        "kept" + names.LOCK_SUFFIX,
        "kept" + names.META_SUFFIX,
        "precious",
    ]
    assert foreign.read_bytes() == b"y" * (2 * KIB)


def test_an_orphan_whose_lease_is_held_is_left_for_later(tmp_path: Path) -> None:
    t = make_tier(tmp_path, limit=64 * KIB)
    data = orphan(t, "busy", 4 * KIB)
    fd = os.open(t.root / ("busy" + names.LOCK_SUFFIX), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # a lookup removing it as a bad entry holds it
        assert t.reclaim() == (0, 0)
        assert data.exists()
    finally:
        os.close(fd)
    assert t.reclaim() == (1, 4 * KIB)


def test_scan_leaves_a_file_named_like_a_key_that_the_tier_did_not_make(tmp_path: Path) -> None:
    t = make_tier(tmp_path, limit=64 * KIB)
    put(t, "kept", KIB)
    foreign = t.root / "nccl-abc123"
    foreign.write_bytes(b"n" * KIB)
    report = t.scan()
    assert foreign.read_bytes() == b"n" * KIB
    assert report.removed_incomplete == 0 and report.entries == 1


def test_a_file_the_tier_did_not_make_does_not_count_against_its_limit(tmp_path: Path) -> None:
    t = make_tier(tmp_path, limit=16 * KIB, wait_timeout=0.3)
    foreign = t.root / "precious"
    foreign.write_bytes(b"y" * (12 * KIB))
    put(t, "k", 12 * KIB)  # would not fit beside it, were it counted
    assert t.used_bytes() == 12 * KIB
    assert foreign.exists()


def test_enospc_never_deletes_a_file_the_tier_did_not_create(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/security.md: eviction deletes only entries the tier committed, also when the
    volume runs out of space below the tier's limit (the old ENOSPC path evicted every
    file named like a key, NCCL's in /dev/shm among them)."""
    t = make_tier(tmp_path, limit=1 << 20, wait_timeout=0.5)
    put(t, "old", 4 * KIB)
    precious = t.root / "precious"
    precious.write_bytes(b"y" * (300 * KIB))
    os.utime(precious, ns=(0, 0))  # the least recently used file of the directory
    # A volume that stays full whatever is evicted.
    monkeypatch.setattr(_no_space, "volume", lambda root: _no_space.Volume(1 << 20, 0))

    def no_space(path: Path) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    with pytest.raises(errors.CacheError, match="stayed out of space"):
        t.insert("new", 8 * KIB, no_space)
    assert precious.read_bytes() == b"y" * (300 * KIB)
    assert t.keys() == []  # its own entry went, as room for the new one
