"""A sidecar stopped (SIGSTOP, a debugger, stuck in D state) while it holds a lock of a
tier directory its node's other sidecars share.

The kernel keeps a flock for as long as its process lives, stopped or not. Every other
sidecar then waited in `flock` forever: each insert, each metrics scrape's size count,
and a new sidecar's start-up check (with nothing in /readyz). Now a wait for the tier
lock or a lease lock is bounded and fails that one operation with `LockTimeout`, naming
the lock file and the holder's pid and state; what needs no lock (a lookup of a resident
entry) is still served, and a fill lock (another process producing the same key) is
waited for at most `wait_timeout`, after which the key is produced here too.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from shardcache_sidecar import tier_checks

from shardcache.node import _locks, tiers
from tests.support import waiting
from tests.support.locks import StoppedHolder

pytestmark = pytest.mark.unit

# Short waits under test; a test that reaches `waiting.GENEROUS_S` has hung.
LOCK_WAIT_S = 0.3


@pytest.fixture
def stopped_holders() -> Iterator[list[StoppedHolder]]:
    made: list[StoppedHolder] = []
    yield made
    for holder in made:
        holder.kill()


def disk_tier(root: Path, *, wait_timeout: float = 300.0) -> tiers.Tier:
    return tiers.Tier(
        root,
        limit_bytes=1000,
        name="disk",
        verify="never",
        wait_timeout=wait_timeout,
        lock_timeout=LOCK_WAIT_S,
    )


def write(body: bytes) -> Callable[[Path], None]:
    def produce(path: Path) -> None:
        path.write_bytes(body)

    return produce


def test_an_insert_fails_naming_the_stopped_holder_of_the_tier_lock_and_lookups_go_on(
    tmp_path: Path, stopped_holders: list[StoppedHolder]
) -> None:
    tier = disk_tier(tmp_path)
    tier.insert("a", 10, write(b"a" * 10)).release()
    holder = StoppedHolder(tmp_path / tiers.TIER_LOCK_NAME)
    stopped_holders.append(holder)

    with pytest.raises(tiers.LockTimeout) as info:
        waiting.finishes(
            "an insert while a stopped process holds the tier lock",
            lambda: tier.insert("b", 10, write(b"b" * 10)),
        )
    message = str(info.value)
    assert str(tmp_path / tiers.TIER_LOCK_NAME) in message
    assert f"pid {holder.pid} (python" in message and "stopped), exclusive" in message
    assert info.value.holders == [f"pid {holder.pid} ({_locks._state(holder.pid)}), exclusive"]
    # An OSError too: a metrics scrape's size count names the tier as failing.
    with pytest.raises(OSError, match="could not lock"):
        waiting.finishes("a size count", lambda: tier.resident_bytes(timeout=LOCK_WAIT_S))
    # What needs no tier lock is still served.
    entry = waiting.finishes("a lookup of a resident entry", lambda: tier.lookup("a"))
    assert entry is not None and Path(entry.path).read_bytes() == b"a" * 10
    entry.release()
    # The failed insert left nothing reserved, and the next one after the holder is
    # gone goes through.
    holder.kill()
    tier.insert("b", 10, write(b"b" * 10)).release()
    assert tier.keys() == ["a", "b"] and tier.used_bytes() == 20


def test_the_start_up_check_says_which_process_holds_the_tier_lock(
    tmp_path: Path, stopped_holders: list[StoppedHolder]
) -> None:
    holder = StoppedHolder(tmp_path / tiers.TIER_LOCK_NAME)
    stopped_holders.append(holder)

    found = waiting.finishes(
        "the start-up check", lambda: tiers.unusable(tmp_path, lock_timeout=LOCK_WAIT_S)
    )
    assert found is not None and isinstance(found.error, tiers.LockTimeout)
    assert found.step == f"locking {tmp_path / tiers.TIER_LOCK_NAME}"
    reason = tier_checks.disk_reason(found, retry_s=2.0)
    assert f"pid {holder.pid} (python" in reason and "Resume or end that process" in reason
    holder.kill()
    assert tiers.unusable(tmp_path, lock_timeout=LOCK_WAIT_S) is None


def test_a_key_whose_producer_is_stopped_is_produced_here_after_wait_timeout(
    tmp_path: Path, stopped_holders: list[StoppedHolder], caplog: pytest.LogCaptureFixture
) -> None:
    tier = disk_tier(tmp_path, wait_timeout=LOCK_WAIT_S)
    fill = tmp_path / f"k{tiers.FILL_LOCK_SUFFIX}"
    holder = StoppedHolder(fill)
    stopped_holders.append(holder)
    stopped_file = os.stat(fill).st_ino

    with caplog.at_level(logging.WARNING, logger="shardcache.node.tiers"):
        entry, hit = waiting.finishes(
            "get_or_insert of a key another process is filling",
            lambda: tier.get_or_insert("k", 10, write(b"k" * 10)),
        )
    assert not hit and Path(entry.path).read_bytes() == b"k" * 10
    entry.release()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith("disk tier: producing k under a new fill lock")
    assert f"held by pid {holder.pid} (python" in said[0]
    # The stopped holder's file was unlinked (every waiter agrees on a new one), and the
    # new one went with the fill.
    assert not fill.exists() or os.stat(fill).st_ino != stopped_file
    assert tier.get_or_insert("k", 10, write(b"?" * 10))[1] is True


def test_a_fill_by_a_thread_of_this_process_is_waited_for_past_wait_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = disk_tier(tmp_path, wait_timeout=LOCK_WAIT_S)
    timeouts: list[_locks.LockTimeout] = []
    real = _locks._flock_within

    def counting(fd: int, operation: int, path: Path, timeout: float) -> None:
        try:
            real(fd, operation, path, timeout)
        except _locks.LockTimeout as exc:
            timeouts.append(exc)
            raise

    monkeypatch.setattr(_locks, "_flock_within", counting)
    producing, finish = threading.Event(), threading.Event()

    def slow(path: Path) -> None:
        producing.set()
        assert finish.wait(waiting.GENEROUS_S)
        path.write_bytes(b"k" * 10)

    first = threading.Thread(target=lambda: tier.get_or_insert("k", 10, slow)[0].release())
    first.start()
    try:
        assert producing.wait(waiting.GENEROUS_S)
        produced_twice: list[bool] = []
        second: list[tuple[tiers.Entry, bool]] = []

        def again(path: Path) -> None:
            produced_twice.append(True)
            path.write_bytes(b"k" * 10)

        waiter = threading.Thread(target=lambda: second.append(tier.get_or_insert("k", 10, again)))
        waiter.start()
        waiting.wait_until("the waiter's wait to time out once", lambda: timeouts)
        finish.set()
        waiter.join(waiting.GENEROUS_S)
        assert not waiter.is_alive()
    finally:
        finish.set()
        first.join(waiting.GENEROUS_S)
    assert timeouts[0].pids == frozenset({os.getpid()})
    assert not produced_twice and second[0][1] is True  # a hit of the first's entry
    second[0][0].release()


def test_holders_are_read_from_proc_locks_waiters_and_other_namespaces_told_apart(
    tmp_path: Path,
) -> None:
    path = tmp_path / "x.lock"
    fd = _locks.acquire(path, _locks.EXCLUSIVE, create=True)
    assert fd is not None
    try:
        st = os.fstat(fd)
        where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        text = (
            f"1: FLOCK  ADVISORY  WRITE 0 {where} 0 EOF\n"
            f"1: -> FLOCK  ADVISORY  WRITE {os.getpid()} {where} 0 EOF\n"
            f"2: FLOCK  ADVISORY  READ {os.getpid()} {where} 0 EOF\n"
            f"3: FLOCK  ADVISORY  WRITE 4242 {where}0 0 EOF\n"
        )
        state = _locks.process_stat(os.getpid())
        assert [words for _, words in _locks.holders_in(text, st)] == [
            "a process of another PID namespace (another pod), exclusive",
            f"pid {os.getpid()} ({state[0]}, state {state[1]}), shared",
        ]
        # This process's own lock, as the kernel lists it, named by a wait that ends.
        with pytest.raises(tiers.LockTimeout) as ended:
            _locks.acquire(path, _locks.SHARED, create=False, timeout=0)
        assert ended.value.holders == [f"pid {os.getpid()} ({state[0]}, state R), exclusive"]
    finally:
        _locks.close(fd)


def test_the_memory_tiers_start_up_check_says_it_waited_for_the_tier_lock_and_who_holds_it(
    tmp_path: Path, stopped_holders: list[StoppedHolder]
) -> None:
    # The memory tier's reason told the user to give it a directory it can write,
    # which a stopped holder of its lock does not need.
    lock = tmp_path / tiers.TIER_LOCK_NAME
    holder = StoppedHolder(lock)
    stopped_holders.append(holder)
    found = waiting.finishes(
        "the start-up check", lambda: tiers.unusable(tmp_path, lock_timeout=LOCK_WAIT_S)
    )
    assert found is not None
    reason = tier_checks.memory_reason(found, retry_s=2.0)
    assert reason.startswith(
        f"the memory tier {tmp_path} is not usable now: this sidecar waited "
        f"{LOCK_WAIT_S:g} s for the tier's lock {lock}, held by pid {holder.pid} (python"
    ), reason
    assert "Resume or end that process" in reason and "--memory-dir" not in reason
