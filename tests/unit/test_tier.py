"""The storage tier in one process: round trip, LRU, leases, limits, corruption, format."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from shardcache import contract, errors
from shardcache.node import names, tiers
from tests.support import waiting

pytestmark = pytest.mark.unit

KIB = 1024


class RecordingObserver:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, object]] = []

    def hit(self, tier: str) -> None:
        self.events.append(("hit", tier, None))

    def miss(self, tier: str) -> None:
        self.events.append(("miss", tier, None))

    def evicted(self, tier: str, nbytes: int) -> None:
        self.events.append(("evicted", tier, nbytes))

    def corrupted(self, tier: str, key: str) -> None:
        self.events.append(("corrupted", tier, key))

    def kinds(self) -> list[str]:
        return [kind for kind, _, _ in self.events]


def payload(key: str, size: int) -> bytes:
    """Deterministic, key-specific bytes, so a mix-up between entries shows."""
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def writer(key: str, size: int) -> Callable[[Path], None]:
    def produce(path: Path) -> None:
        with open(path, "wb") as f:
            f.write(payload(key, size))

    return produce


def make_tier(
    tmp_path: Path, limit: int = 64 * KIB, **kwargs: object
) -> tuple[tiers.Tier, RecordingObserver]:
    observer = RecordingObserver()
    t = tiers.Tier(
        tmp_path / "tier",
        limit_bytes=limit,
        name="disk",
        observer=observer,
        wait_timeout=kwargs.pop("wait_timeout", 5.0),  # type: ignore[arg-type]
        **kwargs,  # type: ignore[arg-type]
    )
    return t, observer


def put(t: tiers.Tier, key: str, size: int) -> None:
    t.insert(key, size, writer(key, size)).release()


def flip_one_bit(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x01]))


def test_inserted_entry_is_looked_up_with_its_bytes_and_checksum(tmp_path: Path) -> None:
    t, observer = make_tier(tmp_path)
    inserted = t.insert("a1", 10 * KIB, writer("a1", 10 * KIB))
    assert inserted.path.read_bytes() == payload("a1", 10 * KIB)
    assert inserted.sha256 == hashlib.sha256(payload("a1", 10 * KIB)).hexdigest()
    inserted.release()

    found = t.lookup("a1")
    assert found is not None
    with found:
        assert (found.key, found.size, found.sha256) == ("a1", 10 * KIB, inserted.sha256)
        assert found.path.read_bytes() == payload("a1", 10 * KIB)
    assert not found.leased
    assert t.contains("a1")
    assert t.keys() == ["a1"]
    assert t.resident_bytes() == 10 * KIB
    assert observer.kinds() == ["hit"]


def test_lookup_of_absent_key_is_a_miss_and_creates_no_files(tmp_path: Path) -> None:
    t, observer = make_tier(tmp_path)
    assert t.lookup("absent") is None
    assert not t.contains("absent")
    assert observer.kinds() == ["miss"]
    assert list(t.root.iterdir()) == []


def test_eviction_takes_least_recently_used_first(tmp_path: Path) -> None:
    t, observer = make_tier(tmp_path, limit=30 * KIB)
    for key in ("old", "mid", "new"):
        put(t, key, 10 * KIB)
    used = t.lookup("old")  # now "mid" is the least recently used
    assert used is not None
    used.release()

    put(t, "next", 10 * KIB)
    assert t.keys() == ["new", "next", "old"]
    put(t, "last", 10 * KIB)
    assert t.keys() == ["last", "next", "old"]
    assert [e for e in observer.events if e[0] == "evicted"] == [
        ("evicted", "disk", 10 * KIB),
        ("evicted", "disk", 10 * KIB),
    ]
    assert t.resident_bytes() <= 30 * KIB


def test_leased_entry_is_never_evicted_even_under_pressure(tmp_path: Path) -> None:
    t, _ = make_tier(tmp_path, limit=30 * KIB)
    pinned = t.insert("pinned", 10 * KIB, writer("pinned", 10 * KIB))
    for i in range(10):
        put(t, f"k{i}", 10 * KIB)
        assert t.contains("pinned")
    assert t.leased_bytes() == 10 * KIB
    assert pinned.path.read_bytes() == payload("pinned", 10 * KIB)
    pinned.release()
    assert t.leased_bytes() == 0
    put(t, "after", 20 * KIB)
    assert not t.contains("pinned")


def test_insert_waits_for_leases_then_fails_naming_the_limit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    t, _ = make_tier(tmp_path, limit=20 * KIB, wait_timeout=0.3)
    leases = [t.insert(k, 10 * KIB, writer(k, 10 * KIB)) for k in ("a", "b")]
    produced: list[Path] = []
    with caplog.at_level(logging.WARNING), pytest.raises(errors.CacheError) as info:
        t.insert("c", 10 * KIB, produced.append)
    assert produced == []
    message = str(info.value)
    assert "within 0.3 s" in message  # it waited its wait_timeout, then gave up
    assert "limit 20480 bytes" in message
    assert "20480 bytes held by leases" in message
    assert contract.ENV_DISK_LIMIT in message
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, "one warning per wait, not one per poll"
    assert "disk tier is full" in warnings[0].getMessage()
    assert "20480 bytes leased" in warnings[0].getMessage()
    assert t.keys() == ["a", "b"]
    for lease in leases:
        lease.release()
    assert t.used_bytes() == 20 * KIB


def test_waiting_insert_proceeds_once_a_lease_is_released(tmp_path: Path) -> None:
    t, _ = make_tier(tmp_path, limit=20 * KIB, wait_timeout=10.0)
    first = t.insert("a", 10 * KIB, writer("a", 10 * KIB))
    second = t.insert("b", 10 * KIB, writer("b", 10 * KIB))
    releaser = threading.Timer(0.2, first.release)
    releaser.start()
    try:
        with t.insert("c", 10 * KIB, writer("c", 10 * KIB)) as third:
            assert third.path.read_bytes() == payload("c", 10 * KIB)
    finally:
        releaser.join()
        second.release()
    assert t.keys() == ["b", "c"]


def test_entry_larger_than_the_limit_is_a_clear_error(tmp_path: Path) -> None:
    t, _ = make_tier(tmp_path, limit=8 * KIB)
    with pytest.raises(errors.CacheError) as info:
        t.insert("big", 9 * KIB, writer("big", 9 * KIB))
    message = str(info.value)
    assert "9216 bytes" in message and "8192 bytes" in message
    assert contract.ENV_DISK_LIMIT in message
    memory = tiers.Tier(tmp_path / "mem", limit_bytes=8, name="memory", fsync=False)
    with pytest.raises(errors.CacheError, match=contract.ENV_MEMORY_LIMIT):
        memory.insert("big", 9, writer("big", 9))
    assert t.used_bytes() == 0


def test_bit_flip_is_detected_removed_and_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    t, observer = make_tier(tmp_path)
    put(t, "flip", 40 * KIB)
    flip_one_bit(t.root / "flip", 33 * KIB)
    with caplog.at_level(logging.WARNING):
        assert t.lookup("flip") is None
    assert not t.contains("flip")
    assert not (t.root / "flip").exists()
    assert ("corrupted", "disk", "flip") in observer.events
    assert observer.kinds()[-1] == "miss"
    text = caplog.text
    assert "flip" in text and "sha256" in text and "expected" in text
    # It is produced again on the next get_or_insert.
    entry, hit = t.get_or_insert("flip", 40 * KIB, writer("flip", 40 * KIB))
    assert not hit
    assert entry.path.read_bytes() == payload("flip", 40 * KIB)
    entry.release()


@pytest.mark.parametrize("verify", ["always", "never"])
def test_truncated_entry_is_detected_and_never_served(
    tmp_path: Path, verify: str, caplog: pytest.LogCaptureFixture
) -> None:
    t, observer = make_tier(tmp_path, verify=verify)
    put(t, "short", 10 * KIB)
    os.truncate(t.root / "short", 4 * KIB)
    with caplog.at_level(logging.WARNING):
        assert t.lookup("short") is None
    assert not t.contains("short")
    assert ("corrupted", "disk", "short") in observer.events
    assert "size 4096 bytes, expected 10240" in caplog.text


def test_bit_flip_goes_unnoticed_only_when_verification_is_off(tmp_path: Path) -> None:
    t, _ = make_tier(tmp_path, verify="never")
    put(t, "flip", 10 * KIB)
    flip_one_bit(t.root / "flip", 5)
    entry = t.lookup("flip")
    assert entry is not None
    entry.release()
    checking = tiers.Tier(t.root, limit_bytes=t.limit_bytes, name="disk", verify="always")
    assert checking.scan().corrupted == 1
    assert t.keys() == []


def test_failed_produce_leaves_no_entry_and_no_reservation(tmp_path: Path) -> None:
    t, _ = make_tier(tmp_path)

    def fail(path: Path) -> None:
        path.write_bytes(b"partial")
        raise OSError("source went away")

    with pytest.raises(OSError, match="source went away"):
        t.insert("k", 10 * KIB, fail)
    assert t.used_bytes() == 0
    assert not t.contains("k")
    assert [p.name for p in t.root.iterdir() if p.name.startswith(names.TMP_PREFIX)] == []


def test_produce_writing_another_size_than_declared_is_rejected(tmp_path: Path) -> None:
    t, _ = make_tier(tmp_path)
    with pytest.raises(errors.CacheError, match="wrote 100 bytes, expected the declared size 200"):
        t.insert("k", 200, writer("k", 100))
    assert not t.contains("k")
    assert t.used_bytes() == 0


def test_produce_writing_less_in_place_is_rejected(tmp_path: Path) -> None:
    t, _ = make_tier(tmp_path)

    def short_in_place(path: Path) -> None:
        with open(path, "r+b") as f:
            f.write(b"x" * 100)

    with pytest.raises(errors.CacheError, match="wrote 100 bytes, expected the declared size 200"):
        t.insert("k", 200, short_in_place)


def test_reservation_counts_against_the_limit_while_producing(tmp_path: Path) -> None:
    t, _ = make_tier(tmp_path, limit=30 * KIB)
    seen: list[int] = []

    def produce(path: Path) -> None:
        with open(path, "wb") as f:
            f.write(b"x")
            f.flush()
            seen.append(t.used_bytes())
            f.write(b"x" * (20 * KIB - 1))

    t.insert("k", 20 * KIB, produce).release()
    assert seen == [20 * KIB]


def test_meta_format_version_mismatch_is_reported_clearly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    t, observer = make_tier(tmp_path)
    put(t, "future", 1 * KIB)
    meta_path = t.root / ("future" + names.META_SUFFIX)
    doc = json.loads(meta_path.read_text())
    assert doc["format_version"] == 1  # an entry with a sha256 (test_tier_format_versions)
    doc["format_version"] = 99
    meta_path.write_text(json.dumps(doc))

    with pytest.raises(tiers.IncompatibleFormatError) as info:
        tiers.read_meta(meta_path, "future")
    assert "format_version 99, expected 1 or 2" in str(info.value)
    with caplog.at_level(logging.WARNING):
        assert t.lookup("future") is None
    assert "format_version 99, expected 1 or 2" in caplog.text
    assert not (t.root / "future").exists()
    assert ("corrupted", "disk", "future") not in observer.events

    put(t, "future", 1 * KIB)
    doc["format_version"] = 99
    meta_path.write_text(json.dumps(doc))
    report = t.scan()
    assert (report.incompatible, report.entries) == (1, 0)


def test_malformed_meta_is_removed_not_served(tmp_path: Path) -> None:
    t, _ = make_tier(tmp_path)
    put(t, "k", 1 * KIB)
    (t.root / ("k" + names.META_SUFFIX)).write_text("{not json")
    assert t.lookup("k") is None
    assert not (t.root / "k").exists()


@pytest.mark.parametrize("key", ["", "../x", "a/b", ".hidden", "a.lock", "k\x00", "é", "x" * 201])
def test_keys_that_are_not_safe_file_names_are_rejected(tmp_path: Path, key: str) -> None:
    t, _ = make_tier(tmp_path)
    with pytest.raises(errors.InputError, match="cache key"):
        t.insert(key, 1, writer("k", 1))
    with pytest.raises(errors.InputError):
        t.lookup(key)


def test_scan_removes_stale_temp_files_and_incomplete_entries(tmp_path: Path) -> None:
    t, _ = make_tier(tmp_path)
    put(t, "good", 2 * KIB)
    put(t, "nometa", 2 * KIB)
    (t.root / ("nometa" + names.META_SUFFIX)).unlink()
    put(t, "nodata", 2 * KIB)
    (t.root / "nodata").unlink()
    stale = t.root / f"{names.TMP_PREFIX}999999-deadbeef-4096-lost"
    stale.write_bytes(b"\0" * 4096)
    (t.root / (stale.name + names.META_SUFFIX)).write_text("{}")
    assert t.used_bytes() == 2 * KIB + 2 * KIB + 4096  # orphans still take room

    report = t.scan()
    assert report == tiers.ScanReport(
        entries=1,
        bytes=2 * KIB,
        verified=1,
        removed_tmp=1,
        removed_incomplete=2,
        corrupted=0,
        incompatible=0,
    )
    # `.limits/` holds the limit the inserting process declared (`tiers._limits`).
    assert sorted(p.name for p in t.root.iterdir()) == sorted(
        [tiers.TIER_LOCK_NAME, ".limits", "good", "good.lock", "good" + names.META_SUFFIX]
    )


def test_leases_in_one_process_are_independent(tmp_path: Path) -> None:
    t, _ = make_tier(tmp_path)
    put(t, "k", 1 * KIB)
    first, second = t.lookup("k"), t.lookup("k")
    assert first is not None and second is not None
    first.release()
    first.release()  # idempotent
    assert not t.evict("k"), "the second lease still pins the entry"
    second.release()
    assert t.evict("k")
    assert not t.contains("k")
    assert not t.evict("k")


def test_get_or_insert_from_many_threads_produces_once(tmp_path: Path) -> None:
    t, _ = make_tier(tmp_path)
    calls: list[int] = []
    results: list[tuple[str, bool]] = []
    barrier = threading.Barrier(6)

    def produce(path: Path) -> None:
        calls.append(1)
        time.sleep(0.1)
        writer("k", 4 * KIB)(path)

    def worker() -> None:
        barrier.wait()
        entry, hit = t.get_or_insert("k", 4 * KIB, produce)
        with entry:
            results.append((entry.sha256, hit))

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert len(calls) == 1
    assert len(results) == 6
    assert len({sha for sha, _ in results}) == 1
    assert sorted(hit for _, hit in results) == [False] + [True] * 5
    assert not (t.root / ("k" + tiers.FILL_LOCK_SUFFIX)).exists()


def test_settings_out_of_range_are_input_errors(tmp_path: Path) -> None:
    with pytest.raises(errors.InputError, match="limit"):
        tiers.Tier(tmp_path, limit_bytes=-1, name="disk")
    with pytest.raises(errors.InputError, match="verify"):
        tiers.Tier(tmp_path, limit_bytes=1, name="disk", verify="sometimes")  # type: ignore[arg-type]
    t, _ = make_tier(tmp_path)
    with pytest.raises(errors.InputError, match="size"):
        t.insert("k", -1, writer("k", 0))


def test_empty_entry_is_legal(tmp_path: Path) -> None:
    t, _ = make_tier(tmp_path)
    put(t, "empty", 0)
    entry = t.lookup("empty")
    assert entry is not None
    assert entry.size == 0
    assert entry.sha256 == hashlib.sha256(b"").hexdigest()
    entry.release()


def test_leased_entries_stay_intact_under_concurrent_churn(tmp_path: Path) -> None:
    """Threads insert, look up and evict a few keys in a tier that holds three of them;
    every lease must see its own entry's bytes until released, and the limit holds."""
    size = 8 * KIB
    t, _ = make_tier(tmp_path, limit=3 * size, wait_timeout=20.0)
    keys = [f"key{i}" for i in range(6)]
    failures: list[BaseException] = []
    peak = [0]

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(60):
                key = rng.choice(keys)
                if rng.random() < 0.2:
                    t.evict(key)
                    continue
                entry, _ = t.get_or_insert(key, size, writer(key, size))
                with entry:
                    time.sleep(rng.random() * 0.002)
                    assert entry.path.read_bytes() == payload(key, size), key
                    peak[0] = max(peak[0], t.used_bytes())
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert failures == []
    assert 0 < peak[0] <= 3 * size
    assert t.leased_bytes() == 0


def test_insert_without_eviction_fails_fast_when_full_and_keeps_entries(tmp_path: Path) -> None:
    # An hour's wait: returning at all shows evict=False did not wait for room.
    t, observer = make_tier(tmp_path, limit=20 * KIB, wait_timeout=3600.0)
    put(t, "a", 10 * KIB)
    put(t, "b", 8 * KIB)
    with pytest.raises(tiers.TierFullError, match="2048 of 20480 bytes free"):
        waiting.finishes(
            "get_or_insert(evict=False) on a full tier",
            lambda: t.get_or_insert("c", 4 * KIB, writer("c", 4 * KIB), evict=False),
        )
    assert t.keys() == ["a", "b"]
    assert "evicted" not in observer.kinds()
    entry, hit = t.get_or_insert("c", 2 * KIB, writer("c", 2 * KIB), evict=False)
    assert not hit
    entry.release()
    assert t.keys() == ["a", "b", "c"]


def test_scan_leaves_an_entry_alone_while_its_lease_is_held(tmp_path: Path) -> None:
    """Data without meta is what a writer between its two commit renames looks like; it
    holds the key's lease then, so scan must not take the data away."""
    t, _ = make_tier(tmp_path)
    (t.root / "committing").write_bytes(b"x" * 100)
    fd = os.open(t.root / ("committing" + names.LOCK_SUFFIX), os.O_RDONLY | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        assert t.scan().removed_incomplete == 0
        assert (t.root / "committing").exists()
        assert not t.evict("committing")
    finally:
        os.close(fd)
    assert t.scan().removed_incomplete == 1
    assert not (t.root / "committing").exists()


def test_eviction_never_deletes_a_file_the_tier_did_not_create(tmp_path: Path) -> None:
    """Issue 13, row 6: a file already in the (shared, node-wide) directory, named like
    an entry but never committed by the tier, survives eviction."""
    t, _ = make_tier(tmp_path, limit=32 * KIB)
    t.root.mkdir(parents=True, exist_ok=True)
    foreign = t.root / "precious"
    foreign.write_bytes(b"y" * (8 * KIB))
    for i in range(4):
        put(t, f"k{i}", 8 * KIB)
    assert foreign.read_bytes() == b"y" * (8 * KIB)
    assert len(t.keys()) >= 2


def test_lookups_of_a_resident_entry_read_its_meta_file_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardcache.node.tiers import _entries

    t, _ = make_tier(tmp_path, verify="never")
    put(t, "k", 1 * KIB)
    reads: list[Path] = []
    real = _entries.read_meta_file

    def counting(path: Path, key: str) -> tuple[tiers.EntryMeta, os.stat_result]:
        reads.append(path)
        return real(path, key)

    monkeypatch.setattr(_entries, "read_meta_file", counting)
    for _ in range(5):
        found = t.lookup("k")
        assert found is not None and found.size == 1 * KIB
        found.release()
    assert len(reads) == 1


def test_a_meta_file_replaced_after_a_lookup_is_read_again(tmp_path: Path) -> None:
    t, observer = make_tier(tmp_path, verify="never")
    put(t, "k", 1 * KIB)
    found = t.lookup("k")
    assert found is not None
    found.release()
    # Replaced the way the tier writes it (a new file renamed over it), now claiming
    # another size than the data file has: the next lookup must see that.
    meta_path = t.root / ("k" + names.META_SUFFIX)
    doc = json.loads(meta_path.read_text())
    doc["size"] = 2 * KIB
    replacement = tmp_path / "meta.json"
    replacement.write_text(json.dumps(doc))
    os.replace(replacement, meta_path)
    assert t.lookup("k") is None
    assert ("corrupted", "disk", "k") in observer.events
    assert not (t.root / "k").exists()
    put(t, "k", 1 * KIB)  # committed again: found again
    found = t.lookup("k")
    assert found is not None and found.size == 1 * KIB
    found.release()


def _no_space(path: Path) -> None:
    """A producer on a volume with no room left (ENOSPC on its write)."""
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def _volume(total: int, free: int) -> Callable[[object], os.statvfs_result]:
    """`os.statvfs` of a volume of `total` bytes with `free` free (1 KiB blocks)."""

    def statvfs(path: object) -> os.statvfs_result:
        blocks, avail = total // KIB, free // KIB
        return os.statvfs_result((KIB, KIB, blocks, avail, avail, 0, 0, 0, 0, 255))

    return statvfs


def test_a_disk_tier_under_its_limit_on_a_volume_others_filled_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = tiers.Tier(
        tmp_path / "ns-b", limit_bytes=64 * KIB, name="disk", fsync=False, wait_timeout=0
    )
    leased = tier.insert("own", 4 * KIB, writer("own", 4 * KIB))  # a reader holds it
    monkeypatch.setattr(os, "statvfs", _volume(total=1024 * KIB, free=2 * KIB))
    with pytest.raises(errors.CacheError) as caught:
        tier.insert("next", 16 * KIB, _no_space)
    leased.release()
    message = str(caught.value)
    assert "holds only 4096 of its 65536 bytes" in message, message
    assert f"{1018 * KIB} of the volume's {1024 * KIB} bytes ({2 * KIB} free)" in message
    assert "other namespaces' disk tiers" in message and "policy.maxCacheDisk," in message


def test_a_disk_tier_whose_volume_is_smaller_than_its_limit_names_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = tiers.Tier(
        tmp_path / "ns-b", limit_bytes=64 * KIB, name="disk", fsync=False, wait_timeout=0
    )
    # Nothing but this tier on a volume too small for it: not the neighbours' doing.
    monkeypatch.setattr(os, "statvfs", _volume(total=8 * KIB, free=8 * KIB))
    with pytest.raises(errors.CacheError, match=contract.ENV_DISK_LIMIT) as caught:
        tier.insert("next", 16 * KIB, _no_space)
    assert "namespaces" not in str(caught.value)


def test_a_memory_tier_out_of_space_never_blames_other_namespaces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = tiers.Tier(
        tmp_path / "mem",
        limit_bytes=64 * KIB,
        name="memory",
        fsync=False,
        verify="never",
        hashed=False,
        wait_timeout=0,
    )
    monkeypatch.setattr(os, "statvfs", _volume(total=1024 * KIB, free=0))
    with pytest.raises(errors.CacheError, match=contract.ENV_MEMORY_LIMIT) as caught:
        tier.insert("next", 16 * KIB, _no_space)
    assert "namespaces" not in str(caught.value)
