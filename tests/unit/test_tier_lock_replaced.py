"""A lock file of a tier directory replaced by someone else sharing the directory, so
that two processes might lock different files and both believe they hold the lock.

Every acquisition checks, once locked, that the name still holds the very file it
locked. That check followed a symbolic link: a link put at the name (between the open
and the flock) leading to the locked file passed it, and the next process, which never
opens through a link, removed the link and locked a new file: two holders. A file
renamed over a held lock cannot be prevented by anyone who may write the directory,
but the holder says so when it lets go.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
from pathlib import Path

import pytest

from shardcache.node import _locks, tiers

pytestmark = pytest.mark.unit


def test_a_lock_file_swapped_for_a_link_while_locking_is_locked_again_not_shared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / tiers.TIER_LOCK_NAME
    path.touch()
    real_flock = fcntl.flock
    swapped: list[bool] = []

    def flock_after_a_swap(fd: int, operation: int) -> None:
        # Between this process's open and its flock, another moves the lock file away
        # and puts a link to it at its name.
        if not swapped:
            swapped.append(True)
            os.rename(path, tmp_path / "elsewhere")
            os.symlink("elsewhere", path)
        real_flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", flock_after_a_swap)
    fd = _locks.acquire(path, _locks.EXCLUSIVE, create=True)
    monkeypatch.undo()
    assert fd is not None and swapped
    try:
        other = _locks.acquire(path, _locks.EXCLUSIVE | _locks.NONBLOCKING, create=True)
        if other is not None:
            _locks.close(other)
        assert other is None, "a second acquisition took the lock as well: two holders"
        at_name = os.lstat(path)
        assert stat.S_ISREG(at_name.st_mode)
        assert (at_name.st_dev, at_name.st_ino) == (os.fstat(fd).st_dev, os.fstat(fd).st_ino)
    finally:
        _locks.close(fd)


def test_a_tier_lock_renamed_over_while_held_is_reported_at_release(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / tiers.TIER_LOCK_NAME
    with caplog.at_level(logging.ERROR, logger="shardcache.node._locks"):
        with _locks.held(path, _locks.EXCLUSIVE):
            (tmp_path / "theirs").touch()
            os.rename(tmp_path / "theirs", path)
            # Anyone now locks the new file while this process holds the old one.
            other = _locks.acquire(path, _locks.EXCLUSIVE | _locks.NONBLOCKING, create=True)
            assert other is not None
            _locks.close(other)
        with _locks.held(path, _locks.EXCLUSIVE):
            pass  # unchanged: nothing said
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [
        f"{path} was replaced or removed while this process held it: a process that locked "
        "it since may have run at the same time (is another program writing the cache "
        "directory?)"
    ]
