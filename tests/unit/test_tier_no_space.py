"""A volume out of space below the tier's limit, where evicting frees nothing: a reader
still maps the evicted files (their pages stay until it unmaps them).

The old ENOSPC path evicted one more entry at every retry, each one mapped too, until
the tier was empty, then logged a WARNING at every poll. Now it evicts only while that
brings room back (or until the evicted files still mapped would cover it), logs once
per insert naming what holds the room, and takes the room the moment it comes back.
The volume is simulated here (`_no_space.volume`); tests/integration/
test_memory_volume_full.py does it on real tmpfs mounts.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path

import pytest

from shardcache import errors
from shardcache.node import tiers
from shardcache.node.tiers import _no_space
from tests.support import waiting

pytestmark = pytest.mark.unit

KIB = 1024
ENTRY = 64 * KIB


class FullVolume:
    """A volume with no free byte, whatever is evicted, until `unmap()`: what a reader
    that maps every evicted file does to a tmpfs."""

    def __init__(self) -> None:
        self.free = 0
        self.looks = 0

    def volume(self, root: Path) -> _no_space.Volume:
        self.looks += 1
        return _no_space.Volume(total=1 << 20, free=self.free)

    def unmap(self) -> None:
        self.free = 1 << 20

    def produce(self, path: Path) -> None:
        if self.free < _no_space.needed(ENTRY):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        path.write_bytes(b"x" * ENTRY)


def test_evicting_entries_that_free_nothing_stops_and_waits_for_the_reader_to_unmap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    tier = tiers.Tier(tmp_path / "mem", limit_bytes=1 << 20, name="memory", wait_timeout=30)
    for key in "abcdef":
        tier.insert(key, ENTRY, lambda p: p.write_bytes(b"x" * ENTRY)).release()
    full = FullVolume()
    monkeypatch.setattr(_no_space, "volume", full.volume)
    timer = threading.Timer(0.6, full.unmap)  # the reader moves on
    timer.start()
    try:
        with caplog.at_level(logging.INFO, logger="shardcache.node.tiers"):
            tier.insert("new", ENTRY, full.produce).release()
    finally:
        timer.cancel()
    # The entries whose evictions cover what was missing (two: an entry and its meta
    # file's room) went; the other four stayed.
    covering = -(-_no_space.needed(ENTRY) // ENTRY)
    assert covering == 2
    assert len(set("abcdef") - set(tier.keys())) == covering, tier.keys()
    assert tier.keys().count("new") == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, "one WARNING per insert, not one per poll"
    assert (
        f"{2 * ENTRY} are entries evicted to make this room that a reader still maps"
        in (warnings[0])
    )


def test_entries_still_mapped_after_the_grace_are_taken_to_stay_and_one_more_goes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader that keeps old batches never unmaps: after `UNMAP_GRACE_S` the insert
    evicts again (an entry no one maps frees its room), at most what is missing."""
    tier = tiers.Tier(tmp_path / "mem", limit_bytes=1 << 20, name="memory", wait_timeout=30)
    for key in "abc":
        tier.insert(key, ENTRY, lambda p: p.write_bytes(b"x" * ENTRY)).release()
    full = FullVolume()
    real_remove = tier._remove_unleased

    def remove(key: str, size: int) -> bool:
        removed = real_remove(key, size)
        if removed and key == "b":  # nobody maps b: its room comes back
            full.unmap()
        return removed

    monkeypatch.setattr(tier, "_remove_unleased", remove)
    monkeypatch.setattr(_no_space, "volume", full.volume)
    monkeypatch.setattr(_no_space, "UNMAP_GRACE_S", 0.2)
    tier.insert("new", ENTRY, full.produce).release()
    assert sorted(tier.keys()) == ["c", "new"]


def test_the_room_arithmetic() -> None:
    room = _no_space.NoSpace()
    need = _no_space.needed(10_000)
    assert need == 12_288 + 8192  # three pages and the meta file's room
    room.evicted(8192, before=0, after=0)  # mapped: nothing came back
    room.evicted(8192, before=0, after=8192)  # freed
    assert room.unfreed == 8192
    assert not room.waiting_is_enough(need, free=8192, now=0.0)  # 8192 < 20480 - 8192
    room.evicted(8192, before=8192, after=8192)
    assert room.unfreed == 16_384
    assert room.waiting_is_enough(need, free=8192, now=0.0)
    assert not room.waiting_is_enough(need, free=8192, now=_no_space.UNMAP_GRACE_S)
    assert room.unfreed == 0  # taken to stay mapped
    room.unfreed = 16_384
    room.saw(12_288)  # 4096 bytes came back: unmapped
    assert room.unfreed == 12_288


def test_what_holds_the_room_in_words() -> None:
    text = _no_space.holders(_no_space.Volume(total=100, free=10), own=50, unfreed=30)
    assert text.startswith("10 of the volume's 100 bytes are free; the tier's files take 50; 30 ")
    assert "10 are other files" in text


def test_a_volume_that_says_it_has_room_but_refuses_writes_is_not_retried_at_once_for_good(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No inode left (or a quota): ENOSPC although statvfs shows free bytes. Each try
    after such a refusal waits first, and the insert ends at `wait_timeout`."""
    tier = tiers.Tier(tmp_path / "mem", limit_bytes=1 << 20, name="memory", wait_timeout=0.5)
    tries = []

    def refused(path: Path) -> None:
        tries.append(path)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(_no_space, "volume", lambda root: _no_space.Volume(1 << 30, 1 << 29))
    with pytest.raises(errors.CacheError, match="stayed out of space"):
        waiting.finishes(
            "an insert into a volume refusing writes", lambda: tier.insert("k", ENTRY, refused)
        )
    assert 1 < len(tries) < 100
