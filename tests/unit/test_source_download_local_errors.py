"""`source.download`: a failure writing the local copy is the local volume's, never the
store's.

The destination used to be written inside the retried operation, so a full disk tier
(ENOSPC writing its temp file) was retried as a flaky store for the whole retry budget
and then raised as a SourceError (kind=source): the store and `fetch_failures` were
blamed for a full local disk, and the disk tier never got to evict its own entries
(tests/integration/test_disk_volume_full.py does it on a real tmpfs). Now only reading
the store is retried; writing fails at once, a full volume as its own OSError (for the
tier to make room), anything else as a CacheError.
"""

from __future__ import annotations

import errno
import hashlib
import os
import time
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest

from shardcache import errors, source
from shardcache.node import tiers
from shardcache.node.tiers import _no_space

pytestmark = pytest.mark.unit

#: A budget the old code spent in full before it raised: the tests below end at once.
POLICY = source.RetryPolicy(initial_delay=0.05, max_delay=0.05, budget_seconds=2.0)
#: Larger than a buffered writer's buffer: written straight through at the first write.
BIG = 1 << 20


def shard(tmp_path: Path, size: int) -> tuple[pafs.FileSystem, str, str]:
    data = os.urandom(size)
    path = tmp_path / "part-00000.parquet"
    path.write_bytes(data)
    return pafs.LocalFileSystem(), str(path), hashlib.sha256(data).hexdigest()


def fetch(fs: Any, path: str, dest: Path, size: int, sha256: str | None = None) -> None:
    source.download(
        fs, path, dest, expected_size=size, what="fetching shard 0", policy=POLICY, sha256=sha256
    )


@pytest.mark.parametrize("size", [BIG, 100], ids=["on-write", "on-close"])
def test_a_full_local_volume_is_raised_at_once_as_its_enospc_not_retried_as_the_store(
    tmp_path: Path, size: int, caplog: pytest.LogCaptureFixture
) -> None:
    # /dev/full answers every write with ENOSPC; a small copy meets it only when the
    # buffered tail is written at close.
    fs, path, sha = shard(tmp_path, size)
    started = time.monotonic()
    with pytest.raises(OSError) as raised:
        fetch(fs, path, Path("/dev/full"), size, sha)
    assert time.monotonic() - started < 1.0
    assert raised.value.errno == errno.ENOSPC
    assert not isinstance(raised.value, errors.ShardcacheError)
    assert "retrying" not in caplog.text


def test_a_spent_quota_is_raised_as_its_edquot_for_the_tier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fs, path, sha = shard(tmp_path, BIG)
    real_open = open

    class QuotaFile:
        def __init__(self, dest: Path) -> None:
            self._f = real_open(dest, "wb")

        def write(self, data: memoryview) -> int:
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

        def close(self) -> None:
            self._f.close()

    monkeypatch.setattr(source, "open", lambda dest, mode: QuotaFile(dest), raising=False)
    with pytest.raises(OSError) as raised:
        fetch(fs, path, tmp_path / "dest", BIG, sha)
    assert raised.value.errno == errno.EDQUOT
    assert not isinstance(raised.value, errors.ShardcacheError)


def test_another_local_write_error_is_a_cache_error_naming_the_file_not_a_source_error(
    tmp_path: Path,
) -> None:
    fs, path, sha = shard(tmp_path, BIG)
    dest = tmp_path / "no-such-dir" / "tmp"  # opening it for writing fails: ENOENT
    started = time.monotonic()
    with pytest.raises(errors.CacheError) as raised:
        fetch(fs, path, dest, BIG, sha)
    assert time.monotonic() - started < 1.0
    text = str(raised.value)
    assert str(dest) in text and "not the store's" in text, text
    assert not isinstance(raised.value, errors.SourceError | errors.InputError)


class FlakyStore:
    """A store whose reads fail with `errno_` (whatever it is) `fails` times."""

    def __init__(self, fs: pafs.FileSystem, errno_: int, fails: int) -> None:
        self.fs, self.errno, self.fails, self.opened = fs, errno_, fails, 0

    def open_input_stream(self, path: str) -> Any:
        self.opened += 1
        if self.opened <= self.fails:
            raise OSError(self.errno, f"store said: {os.strerror(self.errno)}")
        return self.fs.open_input_stream(path)


@pytest.mark.parametrize("errno_", [errno.ECONNRESET, errno.ENOSPC], ids=["reset", "enospc"])
def test_reading_the_store_is_still_retried_whatever_its_errno(tmp_path: Path, errno_: int) -> None:
    # The split is by side (reading the store, writing the copy), not by errno: a
    # store that says ENOSPC is a store failure, retried, then a SourceError.
    fs, path, sha = shard(tmp_path, 1000)
    store = FlakyStore(fs, errno_, fails=2)
    dest = tmp_path / "dest"
    fetch(store, path, dest, 1000, sha)
    assert store.opened == 3
    assert hashlib.sha256(dest.read_bytes()).hexdigest() == sha
    down = FlakyStore(fs, errno_, fails=10**6)
    with pytest.raises(errors.SourceError):
        fetch(down, path, dest, 1000, sha)


class SmallVolume:
    """The tier's volume with room for `room` bytes of files, whatever the disk has:
    statvfs (`_no_space.volume`) and a download's writes (`/dev/full` once full) agree."""

    def __init__(self, tier_root: Path, room: int) -> None:
        self.root, self.room = tier_root, room

    def volume(self, root: Path) -> _no_space.Volume:
        used = sum(f.stat().st_size for f in self.root.iterdir() if f.is_file())
        return _no_space.Volume(total=1 << 30, free=max(0, self.room - used))

    def open(self, dest: Path, mode: str, need: int) -> Any:
        full = self.volume(self.root).free < _no_space.needed(need)
        return open("/dev/full" if full else dest, mode)


def test_a_fetch_into_a_full_disk_tier_evicts_the_tiers_own_lru_entries_and_fits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The disk tier's insert sees the download's ENOSPC as "no room yet": it evicts its
    # least recently used unleased entry and fetches again, where the old download
    # retried the store for its whole budget and raised a SourceError.
    size = 64 << 10
    fs, path, sha = shard(tmp_path, size)
    tier = tiers.Tier(tmp_path / "disk", limit_bytes=1 << 30, name="disk", wait_timeout=5)
    for key in ("old", "newer"):
        tier.insert(key, size, lambda p: p.write_bytes(b"x" * size)).release()
    os.utime(tier.root / "old", (1, 1))  # least recently used
    small = SmallVolume(tier.root, room=2 * size + size // 2)
    monkeypatch.setattr(_no_space, "volume", small.volume)
    monkeypatch.setattr(
        source, "open", lambda dest, mode: small.open(dest, mode, size), raising=False
    )
    tier.insert("new", size, lambda tmp: fetch(fs, path, tmp, size, sha), sha256=sha).release()
    assert sorted(tier.keys()) == ["new", "newer"]


def test_a_disk_tier_that_stays_full_raises_a_cache_error_naming_the_volume_and_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    size = 64 << 10
    fs, path, sha = shard(tmp_path, size)
    tier = tiers.Tier(tmp_path / "disk", limit_bytes=1 << 30, name="disk", wait_timeout=0.5)
    monkeypatch.setattr(
        _no_space, "volume", lambda root: _no_space.Volume(total=1 << 20, free=4096)
    )
    with pytest.raises(errors.CacheError) as raised:
        tier.insert("new", size, lambda tmp: fetch(fs, path, Path("/dev/full"), size, sha))
    text = str(raised.value)
    assert not isinstance(raised.value, errors.SourceError)
    assert f"disk volume {tier.root}" in text or f"disk volume of {tier.root}" in text, text
    assert "4096" in text and "SHARDCACHE_DISK_LIMIT_BYTES" in text, text


def test_a_limit_larger_than_its_volume_is_clamped_to_the_volumes_size(tmp_path: Path) -> None:
    found = _no_space.Volume(total=100 << 20, free=40 << 20)
    assert _no_space.limit_within(50 << 30, found) == 100 << 20
    assert _no_space.limit_within(10 << 20, found) == 10 << 20
    assert _no_space.limit_within(50 << 30, None) == 50 << 30
    # A tier directory not made yet lies on the volume of the directory above it.
    below = _no_space.volume_under(tmp_path / "not" / "made")
    assert below is not None and below == _no_space.volume(tmp_path)
