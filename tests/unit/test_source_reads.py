"""`source_reads.Gate`: a namespace's blocking source reads hold its slots until their
threads return, not until their callers stop waiting (docs/security.md, "Starve other
namespaces through the operator's reads")."""

from __future__ import annotations

import asyncio
import threading

import pytest
from shardcache_operator import source_reads

pytestmark = pytest.mark.unit


class Store:
    """A store that answers nothing until `release`; counts the reads that reached it."""

    def __init__(self) -> None:
        self.released = threading.Event()
        self.entered = 0
        self._lock = threading.Lock()

    def read(self) -> str:
        with self._lock:
            self.entered += 1
        self.released.wait()
        return "late"


async def test_a_namespace_whose_store_never_answers_holds_at_most_its_slots() -> None:
    gate = source_reads.Gate(per_namespace=2)
    store = Store()
    try:
        outcomes = await asyncio.gather(
            *(gate.run("a", store.read, timeout=0.3, what=f"read {i}") for i in range(5)),
            return_exceptions=True,
        )
        assert store.entered == 2
        assert gate.running("a") == 2  # timed out, still reading
        assert sum(isinstance(o, TimeoutError) for o in outcomes) == 2
        busy = [o for o in outcomes if isinstance(o, source_reads.Busy)]
        assert len(busy) == 3
        assert "namespace a already has 2 reads of its sources running" in str(busy[0])
        assert "at most 2 at once" in str(busy[0])
        # Another namespace is not counted against it.
        assert await gate.run("b", lambda: "b answers", timeout=5, what="read b") == "b answers"
    finally:
        store.released.set()
    # The slots come back as the hung threads return (the read waits for one). The
    # other hung thread may hand its slot back after this read returns: wait for it.
    assert await gate.run("a", lambda: "a again", timeout=30, what="read a") == "a again"
    assert store.entered == 2
    assert await slots_all_back(gate, "a")


async def slots_all_back(gate: source_reads.Gate, namespace: str) -> bool:
    """Whether every thread of `namespace` handed its slot back within 30 s."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while gate.running(namespace) and loop.time() < deadline:
        await asyncio.sleep(0.01)
    return gate.running(namespace) == 0


async def test_a_read_waiting_for_a_slot_gets_it_when_the_hung_read_returns() -> None:
    gate = source_reads.Gate(per_namespace=1)
    store = Store()
    try:
        with pytest.raises(TimeoutError):
            await gate.run("a", store.read, timeout=0.1, what="first")
        waiting = asyncio.ensure_future(gate.run("a", lambda: "second", timeout=30, what="second"))
        await asyncio.sleep(0)
        assert not waiting.done()
    finally:
        store.released.set()
    assert await waiting == "second"
    assert gate.running("a") == 0


async def test_a_reads_error_reaches_its_caller_and_frees_its_slot() -> None:
    gate = source_reads.Gate(per_namespace=1)

    def refused() -> None:
        raise PermissionError("access denied")

    with pytest.raises(PermissionError, match="access denied"):
        await gate.run("a", refused, timeout=30, what="refused")
    assert await gate.run("a", lambda: 7, timeout=30, what="next") == 7


def test_a_gate_without_slots_is_refused() -> None:
    with pytest.raises(ValueError, match="expected at least 1 read per namespace, found 0"):
        source_reads.Gate(per_namespace=0)


async def test_a_read_on_a_gate_thread_knows_when_its_caller_stops_waiting() -> None:
    """What a read that can be stopped (a resolve's child process) stops at."""
    gate = source_reads.Gate()
    left = await gate.run("a", source_reads.remaining, timeout=30, what="read")
    assert left is not None and 0 < left <= 30
    assert source_reads.remaining() is None  # not a gate thread
