"""Whatever someone puts at a tier file's name (a FIFO, a link, a directory) costs at
most that entry: a miss or a bad entry removed, then the key is served again. It never
blocks the process, never reads through a link, and never poisons the key for good.

Anyone sharing a directory can do it: a co-tenant of a namespace's node disk tier, any
process of the pod on its memory volume, any process sharing an embedded `cache_dir`.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from shardcache import errors
from shardcache.node import _locks, leases, names, regular_files, tiers
from shardcache.node.tiers import _entries
from tests.support import waiting

pytestmark = pytest.mark.unit

KIB = 1024
#: What a hung open would take: far longer than any of these calls needs.
BOUND_S = 20.0


def make_tier(root: Path, name: str = "disk") -> tiers.Tier:
    return tiers.Tier(root, limit_bytes=1 << 20, name=name, verify="never", wait_timeout=1.0)


def put(t: tiers.Tier, key: str, size: int = KIB) -> None:
    t.insert(key, size, lambda p: p.write_bytes(bytes([len(key)]) * size)).release()


def hit(t: tiers.Tier, key: str) -> bool:
    entry = t.lookup(key)
    if entry is None:
        return False
    entry.release()
    return True


def bounded(what: str, call: object) -> object:
    return waiting.finishes(what, call, timeout=BOUND_S)  # type: ignore[arg-type]


# --- lock files (issue: one FIFO froze every cache operation of the process) ---------


def test_a_lease_lock_file_that_is_a_fifo_is_a_miss_and_other_keys_and_tiers_are_unaffected(
    tmp_path: Path,
) -> None:
    disk = make_tier(tmp_path / "disk")
    memory = make_tier(tmp_path / "mem", name="memory")
    for key in ("poisoned", "other"):
        put(disk, key)
    put(memory, "decoded")
    lock = disk.root / ("poisoned" + names.LOCK_SUFFIX)
    lock.unlink()
    os.mkfifo(lock)
    # Each in a thread with a bound: the old code blocked in open() for good, holding a
    # process-wide lock, so every one of these hung.
    assert (
        bounded("a lookup of the key whose lock is a FIFO", lambda: hit(disk, "poisoned")) is False
    )
    assert bounded("a lookup of another disk key", lambda: hit(disk, "other")) is True
    assert bounded("a lookup in another tier", lambda: hit(memory, "decoded")) is True
    bounded("an insert in another tier", lambda: put(memory, "new"))
    # The FIFO is gone, and the key is served again once inserted.
    assert not lock.is_fifo()
    bounded("an insert of the key", lambda: put(disk, "poisoned"))
    assert hit(disk, "poisoned")


def test_a_lease_lock_file_that_is_a_symlink_is_never_followed(tmp_path: Path) -> None:
    disk = make_tier(tmp_path / "disk")
    put(disk, "k")
    target = tmp_path / "elsewhere"
    target.write_bytes(b"not the tier's")
    lock = disk.root / ("k" + names.LOCK_SUFFIX)
    lock.unlink()
    lock.symlink_to(target)
    assert not hit(disk, "k")
    assert not lock.is_symlink()
    assert target.read_bytes() == b"not the tier's"  # untouched, never locked through
    put(disk, "k")
    assert hit(disk, "k")


@pytest.mark.parametrize("kind", ["fifo", "link-to-fifo", "directory"])
def test_a_tier_lock_that_is_not_a_regular_file_is_replaced_and_inserts_go_on(
    tmp_path: Path, kind: str
) -> None:
    t = make_tier(tmp_path / "disk")
    put(t, "before")
    tier_lock = t.root / tiers.TIER_LOCK_NAME
    tier_lock.unlink()
    if kind == "fifo":
        os.mkfifo(tier_lock)
    elif kind == "directory":
        tier_lock.mkdir()
        (tier_lock / "inside").write_bytes(b"x")
    else:
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        tier_lock.symlink_to(fifo)
    bounded("an insert with a bad tier lock", lambda: put(t, "after"))
    assert hit(t, "before") and hit(t, "after")
    assert tier_lock.is_file() and not tier_lock.is_symlink()


def test_taking_a_lock_never_waits_behind_an_open_of_a_fifo_in_another_thread(
    tmp_path: Path,
) -> None:
    fifo = tmp_path / "a.lock"
    os.mkfifo(fifo)
    other = tmp_path / "b.lock"
    started = threading.Event()

    def take_fifo() -> None:
        started.set()
        fd = _locks.acquire(fifo, _locks.SHARED, create=False)
        assert fd is None  # removed: nothing left to lock without create

    thread = threading.Thread(target=take_fifo, daemon=True)
    thread.start()
    started.wait()
    fd = bounded(
        "a lock on another file", lambda: _locks.acquire(other, _locks.EXCLUSIVE, create=True)
    )
    assert isinstance(fd, int)
    _locks.close(fd)
    thread.join(BOUND_S)
    assert not thread.is_alive()
    assert not os.path.lexists(fifo)


def test_a_trainers_pin_on_a_lock_file_that_is_a_fifo_fails_naming_it_instead_of_waiting(
    tmp_path: Path,
) -> None:
    memory = make_tier(tmp_path / "mem", name="memory")
    put(memory, "k")
    lock = memory.root / ("k" + names.LOCK_SUFFIX)
    lock.unlink()
    os.mkfifo(lock)
    with pytest.raises(errors.CacheError, match="is a FIFO, expected a regular file"):
        bounded("a pin", lambda: leases.pin(memory.root / "k", lock, KIB))
    assert lock.is_fifo()  # a trainer never removes the tier's files


def test_a_data_file_that_is_a_symlink_is_never_pinned(tmp_path: Path) -> None:
    memory = make_tier(tmp_path / "mem", name="memory")
    put(memory, "k")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(b"y" * KIB)  # the entry's size, but not the entry
    data = memory.root / "k"
    data.unlink()
    data.symlink_to(elsewhere)
    assert leases.pin(data, memory.root / ("k" + names.LOCK_SUFFIX), KIB) is None


# --- meta and data files --------------------------------------------------------------


def test_a_meta_file_that_is_a_fifo_is_a_bad_entry_removed_and_the_key_served_again(
    tmp_path: Path,
) -> None:
    t = make_tier(tmp_path / "disk")
    put(t, "k")
    meta = t.root / ("k" + names.META_SUFFIX)
    meta.unlink()
    os.mkfifo(meta)
    assert bounded("a lookup with a FIFO for a meta file", lambda: hit(t, "k")) is False
    assert not os.path.lexists(meta)
    put(t, "k")
    assert hit(t, "k")


def test_a_meta_file_that_is_a_symlink_is_not_read_through(tmp_path: Path) -> None:
    """Even to a valid meta file: a link could as well lead to a 300 MiB file (read
    whole) or /dev/zero (read until the OOM killer came)."""
    t = make_tier(tmp_path / "disk")
    put(t, "k")
    meta = t.root / ("k" + names.META_SUFFIX)
    elsewhere = tmp_path / "elsewhere.meta.json"
    os.replace(meta, elsewhere)
    meta.symlink_to(elsewhere)
    assert bounded("a lookup with a linked meta file", lambda: hit(t, "k")) is False
    assert not os.path.lexists(meta) and elsewhere.exists()
    put(t, "k")
    assert hit(t, "k")


def test_a_meta_file_over_the_cap_is_refused_without_reading_it_whole(tmp_path: Path) -> None:
    path = tmp_path / ("k" + names.META_SUFFIX)
    with open(path, "wb") as f:
        f.truncate(1 << 30)
    with pytest.raises(errors.CacheError, match=f"expected at most {_entries.META_MAX_BYTES}"):
        tiers.read_meta(path, "k")


@pytest.mark.parametrize("which", ["data", "meta"])
def test_a_directory_in_an_entrys_place_is_a_miss_and_the_key_is_served_again(
    tmp_path: Path, which: str
) -> None:
    t = make_tier(tmp_path / "disk")
    put(t, "k")
    path = t.root / ("k" if which == "data" else "k" + names.META_SUFFIX)
    path.unlink()
    path.mkdir()
    (path / "inside").write_bytes(b"x")
    # The old code raised IsADirectoryError here, and on every insert of the key after.
    assert [hit(t, "k") for _ in range(2)] == [False, False]
    put(t, "k")
    assert hit(t, "k")
    assert path.is_file()


def test_a_data_file_that_is_a_symlink_of_the_right_size_is_not_served(tmp_path: Path) -> None:
    t = make_tier(tmp_path / "disk")
    put(t, "k")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(b"z" * KIB)
    data = t.root / "k"
    data.unlink()
    data.symlink_to(elsewhere)
    assert not hit(t, "k")
    assert elsewhere.read_bytes() == b"z" * KIB
    put(t, "k")
    assert hit(t, "k")


def test_a_data_file_that_is_a_fifo_is_never_opened_by_a_verifying_lookup(tmp_path: Path) -> None:
    t = tiers.Tier(tmp_path / "disk", limit_bytes=1 << 20, name="disk", wait_timeout=1.0)
    t.insert("k", 0, lambda p: None).release()  # an entry of 0 bytes, as a FIFO's size
    data = t.root / "k"
    data.unlink()
    os.mkfifo(data)
    assert bounded("a verifying lookup of a FIFO", lambda: hit(t, "k")) is False
    assert not os.path.lexists(data)


def test_open_regular_names_what_it_found(tmp_path: Path) -> None:
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    link = tmp_path / "l"
    link.symlink_to(tmp_path / "nowhere")
    for path, what in ((fifo, "a FIFO"), (link, "a symbolic link"), (tmp_path, "a directory")):
        with pytest.raises(regular_files.NotRegularFile) as caught:
            regular_files.open_regular(path, os.O_RDONLY)
        assert str(caught.value) == f"{path} is {what}, expected a regular file"
