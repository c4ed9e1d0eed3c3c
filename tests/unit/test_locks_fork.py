"""A forked child (a DataLoader worker) never holds a lock its parent held at the fork:
its copies of the parent's lock descriptors let go at once (`shardcache.node._locks`)."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

from shardcache.node import _locks, tiers
from tests.support import forks


def test_a_lock_the_parent_let_go_after_a_fork_is_free_though_the_child_runs(
    tmp_path: Path,
) -> None:
    path = tmp_path / "tier.lock"
    held = _locks.acquire(path, _locks.EXCLUSIVE, create=True)
    assert held is not None
    child = forks.child_that_stays()
    try:
        _locks.close(held)
        # Before, the child's copy of the descriptor kept the lock: this was None.
        again = _locks.acquire(path, _locks.EXCLUSIVE | _locks.NONBLOCKING, create=False)
        assert again is not None
        _locks.close(again)
    finally:
        forks.stop(child)


def test_a_shared_lease_the_parent_holds_stays_held_and_goes_when_the_parent_lets_go(
    tmp_path: Path,
) -> None:
    path = tmp_path / "entry.lock"
    lease = _locks.acquire(path, _locks.SHARED, create=True)
    assert lease is not None
    child = forks.child_that_stays()
    try:
        # The parent's lock is untouched by the child's letting go of its copy.
        assert _locks.acquire(path, _locks.EXCLUSIVE | _locks.NONBLOCKING, create=False) is None
        _locks.close(lease)
        evictor = _locks.acquire(path, _locks.EXCLUSIVE | _locks.NONBLOCKING, create=False)
        assert evictor is not None
        _locks.close(evictor)
    finally:
        forks.stop(child)


def test_a_child_closing_its_copy_never_closes_a_file_it_opened_since(tmp_path: Path) -> None:
    """The child's copies stay open (on /dev/null) until their owners close them, so an
    owner's close in the child cannot hit a descriptor the child opened since."""
    held = _locks.acquire(tmp_path / "a.lock", _locks.EXCLUSIVE, create=True)
    assert held is not None
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            mine = os.open(tmp_path / "mine", os.O_RDWR | os.O_CREAT)
            ok = mine != held
            _locks.close(held)  # the parent's lease object, dropped in the child
            os.write(mine, b"still open")
            os.write(write, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(write)
    assert os.read(read, 1) == b"1"
    os.close(read)
    os.waitpid(pid, 0)
    assert (tmp_path / "mine").read_bytes() == b"still open"
    _locks.close(held)


def test_a_lease_collected_while_the_same_thread_opens_a_lock_file_is_closed_without_waiting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The garbage collector runs a dropped lease's finalizer wherever it happens to
    run, in the middle of `open_for_lock` too; with a lock that is not reentrant the
    thread waited on itself (a CI run hung so)."""
    fd = _locks.acquire(tmp_path / "a.lock", _locks.SHARED, create=True)
    assert fd is not None
    dropped = [tiers.Entry(key="a", path=tmp_path / "a", size=0, sha256=None, lease_fd=fd)]
    real_open = os.open

    def open_collecting(*args: Any, **kwargs: Any) -> int:
        dropped.clear()  # the last reference: its finalizer runs here, on this thread
        return real_open(*args, **kwargs)

    monkeypatch.setattr(os, "open", open_collecting)
    opened: list[int | None] = []
    worker = threading.Thread(
        target=lambda: opened.append(
            _locks.acquire(tmp_path / "b.lock", _locks.SHARED, create=True)
        ),
        daemon=True,
    )
    worker.start()
    worker.join(10)
    monkeypatch.undo()
    assert not worker.is_alive(), "the thread waits on itself"
    assert opened and opened[0] is not None
    _locks.close(opened[0])
    # The collected lease let go of its lock.
    evictor = _locks.acquire(
        tmp_path / "a.lock", _locks.EXCLUSIVE | _locks.NONBLOCKING, create=False
    )
    assert evictor is not None
    _locks.close(evictor)
