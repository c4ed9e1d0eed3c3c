"""Blocking reads of tenants' sources (resolve, probe, applied skips): each on a thread
of its own, at most `PER_NAMESPACE` of one namespace at once, counted until the thread
ends.

Why: these calls read a store the tenant chooses (its bucket, or an endpoint its
Secret's `AWS_ENDPOINT_URL` names), and a thread blocked in a read cannot be stopped:
`asyncio.wait_for` stops waiting at the resolve timeout, the thread reads on. They ran
on the event loop's default executor (min(32, CPUs + 4) threads), which every API read
of the operator shares with the webhook (Secrets, a namespace's UID, a DatasetMount the
watch has not delivered yet, Events). A store that trickles its answer (a byte every
few seconds passes every socket timeout) left a thread there at each retry of a resolve
and each source check, until none was free: every namespace's resolves and API reads
then queued behind one tenant's mounts, and the webhook's reads outlasted its 10 s
timeout (failurePolicy Fail: labelled pods refused in every namespace).

Here a namespace's reads run beside the executor, never in it, and each holds one of its
namespace's `PER_NAMESPACE` slots until its thread returns, not until its caller stops
waiting. A namespace whose store never answers therefore holds at most that many
threads (and each resolve's own `manifests._INSPECT_CONCURRENCY`) and waits on itself
alone; a read waiting for a slot longer than its timeout fails with `Busy`, which says
so. Other namespaces' reads are not counted against it.

A resolve runs in a child process (`resolve_children`), and a source check or a read of
applied skips in a worker process (`read_workers`), that its thread kills when the
caller stops waiting (`remaining`): its slot then comes back at the timeout, and a slot
bounds a process, not a thread left reading. The processes of all namespaces together
are capped as well (`resolve_slots`, shared by `namespace`), within the same timeout.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
from collections.abc import Callable
from typing import TypeVar, cast

from shardcache import errors

T = TypeVar("T")

#: Reads of one namespace's sources running at once. A resolve reads with 8 threads of
#: its own, in its child process (`resolve_children`), so one namespace holds at most 4
#: threads of the operator and 4 children, whatever its stores do.
PER_NAMESPACE = 4

_local = threading.local()


def remaining() -> float | None:
    """Seconds until the caller of the read running on this thread stops waiting for
    it (`Gate.run`'s timeout); None off a gate thread. A read that can be stopped (a
    child process: `resolve_children`) stops then, and its slot comes back with it."""
    deadline: float | None = getattr(_local, "deadline", None)
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def namespace() -> str | None:
    """The namespace whose read runs on this thread (`Gate.run`); None off a gate
    thread. What the operator's resolve slots are shared by (`resolve_slots`)."""
    found: str | None = getattr(_local, "namespace", None)
    return found


class Busy(errors.SourceError):
    """Every slot of the namespace stayed taken for the whole timeout: its earlier reads
    are still running (possibly past their own timeouts, on a store that does not
    answer). A SourceError: status says it, and the reconcile is retried."""


class Gate:
    """Slots per namespace for blocking source reads; one per operator process
    (`context.Context.source_reads`), used from its event loop only."""

    def __init__(self, per_namespace: int = PER_NAMESPACE) -> None:
        if per_namespace < 1:
            raise ValueError(f"expected at least 1 read per namespace, found {per_namespace}")
        self.per_namespace = per_namespace
        self._running: dict[str, int] = {}
        self._waiting: dict[str, collections.deque[asyncio.Future[None]]] = {}

    def running(self, namespace: str) -> int:
        """Threads of `namespace`'s reads that have not returned yet."""
        return self._running.get(namespace, 0)

    async def run(self, namespace: str, call: Callable[[], T], *, timeout: float, what: str) -> T:
        """`call()` on a thread of its own once `namespace` has a free slot, within
        `timeout` seconds for the two together. Raises `Busy` when no slot came free in
        time, TimeoutError when the call did not return in time (its thread runs on,
        holding its slot, unless `call` stops at `remaining()`), and whatever `call`
        raised. `what` names the read in `Busy`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        await self._acquire(namespace, timeout=timeout, what=what)
        result: asyncio.Future[T] = loop.create_future()
        # The loop's clock need not be time.monotonic's: the thread gets its own.
        stop_at = time.monotonic() + max(0.0, deadline - loop.time())
        thread = threading.Thread(
            target=self._body,
            args=(loop, namespace, call, result, stop_at),
            name=f"source-read-{namespace}",
            daemon=True,
        )
        try:
            thread.start()
        except BaseException:
            self._release(namespace)
            raise
        return await asyncio.wait_for(result, max(0.0, deadline - loop.time()))

    async def _acquire(self, namespace: str, *, timeout: float, what: str) -> None:
        waiting = self._waiting.get(namespace)
        if self.running(namespace) < self.per_namespace and not waiting:
            self._running[namespace] = self.running(namespace) + 1
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(namespace, collections.deque()).append(turn)
        try:
            await asyncio.wait_for(turn, timeout)
        except BaseException as exc:
            if turn.done() and not turn.cancelled():
                self._release(namespace)  # handed a slot just as the wait ended
            if isinstance(exc, TimeoutError):
                raise Busy(
                    f"{what}: namespace {namespace} already has {self.running(namespace)} "
                    f"reads of its sources running (at most {self.per_namespace} at once; "
                    "a read of a store that does not answer runs on after its timeout), "
                    f"and none finished within {timeout:g} s"
                ) from None
            raise
        finally:
            self._forget(namespace, turn)

    def _body(
        self,
        loop: asyncio.AbstractEventLoop,
        namespace: str,
        call: Callable[[], T],
        result: asyncio.Future[T],
        stop_at: float,
    ) -> None:
        """The thread: the call, then its outcome and the slot back to the loop."""
        value: T | None = None
        error: BaseException | None = None
        _local.deadline = stop_at
        _local.namespace = namespace
        try:
            value = call()
        except BaseException as exc:  # handed to the caller, whatever it is
            error = exc
        finally:
            # A closed loop (the operator stopping) has nobody waiting and no slots.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._finished, namespace, result, value, error)

    def _finished(
        self,
        namespace: str,
        result: asyncio.Future[T],
        value: T | None,
        error: BaseException | None,
    ) -> None:
        if not result.done():  # done: its caller stopped waiting (timeout, cancel)
            if error is not None:
                result.set_exception(error)
            else:
                result.set_result(cast(T, value))
        self._release(namespace)

    def _release(self, namespace: str) -> None:
        """A slot back: to the namespace's first waiter still waiting, else free."""
        waiting = self._waiting.get(namespace)
        while waiting:
            turn = waiting.popleft()
            if not turn.done():
                turn.set_result(None)  # the slot passes on: the count stays
                return
        left = self.running(namespace) - 1
        if left > 0:
            self._running[namespace] = left
        else:
            self._running.pop(namespace, None)

    def _forget(self, namespace: str, turn: asyncio.Future[None]) -> None:
        waiting = self._waiting.get(namespace)
        if waiting is None:
            return
        with contextlib.suppress(ValueError):
            waiting.remove(turn)
        if not waiting:
            del self._waiting[namespace]
