"""`server.eager.start`: a coroutine's first step at once, task semantics after."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest
from shardcache_sidecar.server import eager

pytestmark = pytest.mark.unit


def test_a_call_that_never_waits_is_done_before_start_returns() -> None:
    seen: list[str] = []

    async def call() -> None:
        seen.append("ran")

    async def main() -> None:
        assert eager.start(call()) is None
        assert seen == ["ran"]  # no loop turn in between

    asyncio.run(main())


def test_a_call_that_waits_runs_its_first_step_at_once_and_the_rest_in_a_task() -> None:
    seen: list[object] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        first: asyncio.Future[int] = loop.create_future()
        second: asyncio.Future[int] = loop.create_future()

        async def call() -> None:
            seen.append("before")
            seen.append(await first)
            await asyncio.sleep(0)  # a bare yield in between
            seen.append(await second)

        rest = eager.start(call())
        assert rest is not None and seen == ["before"]
        first.set_result(1)
        await asyncio.sleep(0.01)
        assert seen == ["before", 1] and not rest.done()
        second.set_result(2)
        await rest
        assert seen == ["before", 1, 2]

    asyncio.run(main())


Waited = asyncio.Future[int]
Rest = asyncio.Future[None]


def _started(
    call: Callable[[Waited], Coroutine[Any, Any, None]],
    then: Callable[[Waited, Rest], Awaitable[None]],
) -> None:
    """Start `call` on a future of its own, which it waits for; then `then`."""

    async def main() -> None:
        waited: Waited = asyncio.get_running_loop().create_future()
        rest = eager.start(call(waited))
        assert rest is not None
        await then(waited, rest)

    asyncio.run(main())


def test_a_futures_error_is_raised_where_the_call_awaited_it() -> None:
    seen: list[str] = []

    async def call(waited: Waited) -> None:
        try:
            await waited
        except KeyError as exc:
            seen.append(f"caught {exc}")

    async def then(waited: Waited, rest: Rest) -> None:
        waited.set_exception(KeyError("lost"))
        await rest

    _started(call, then)
    assert seen == ["caught 'lost'"]


def test_an_error_the_call_does_not_catch_ends_its_task_with_it() -> None:
    async def call(waited: Waited) -> None:
        await waited

    async def then(waited: Waited, rest: Rest) -> None:
        waited.set_exception(ValueError("bad"))
        with pytest.raises(ValueError, match="bad"):
            await rest

    _started(call, then)


def test_cancelling_the_task_cancels_what_the_call_waits_for_and_the_call_sees_it() -> None:
    seen: list[str] = []

    async def call(waited: Waited) -> None:
        try:
            await waited
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise
        finally:
            seen.append("finally")

    async def then(waited: Waited, rest: Rest) -> None:
        await asyncio.sleep(0)  # the task is waiting on the future
        rest.cancel()
        with pytest.raises(asyncio.CancelledError):
            await rest
        assert waited.cancelled() and rest.cancelled()

    _started(call, then)
    assert seen == ["cancelled", "finally"]


def test_a_cancel_that_arrives_after_the_future_resolved_is_thrown_into_the_call() -> None:
    # The future is done, its wake-up scheduled, when the task is cancelled: a task
    # throws CancelledError into the coroutine instead of handing it the result.
    seen: list[str] = []

    async def call(waited: Waited) -> None:
        try:
            seen.append(f"got {await waited}")
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    async def then(waited: Waited, rest: Rest) -> None:
        await asyncio.sleep(0)
        waited.set_result(7)
        rest.cancel()
        with pytest.raises(asyncio.CancelledError):
            await rest

    _started(call, then)
    assert seen == ["cancelled"]


def test_a_task_cancelled_before_its_first_step_closes_the_call() -> None:
    seen: list[str] = []

    async def call(waited: Waited) -> None:
        try:
            await waited
        finally:
            seen.append("finally")

    async def then(waited: Waited, rest: Rest) -> None:
        rest.cancel()  # before the loop ran it once
        with pytest.raises(asyncio.CancelledError):
            await rest
        await asyncio.sleep(0)  # the task's done callbacks
        assert seen == ["finally"]  # now, not whenever the task is collected

    _started(call, then)
