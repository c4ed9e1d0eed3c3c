"""Run a coroutine's first step at once, a task only for what is left: Python 3.12's
eager tasks (`asyncio.Task(..., eager_start=True)`), for the Python 3.11 of the
sidecar's image.

Why: most control requests never wait (a warm acquire, `notes`, `pinned`, a probe). A
task started the usual way runs its first step on the loop's next turn, so every such
request paid a second turn of the loop (a `select` and the loop's own bookkeeping)
before its answer was written. Started here, a call that does not wait is answered
inside the callback that read it.

What a call that does wait gets is the task semantics it would have had: the rest of
the coroutine runs in a task (`_rest`) that waits for each future the coroutine waits
for and then resumes it, so the coroutine sees the future's result, exception or
cancellation exactly where it awaited it, and cancelling the task cancels the future
it waits for, as cancelling a task does.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Coroutine
from typing import Any


def start(coro: Coroutine[Any, Any, None]) -> asyncio.Future[None] | None:
    """Run `coro` until it first waits: None if it finished without waiting, else the
    task that runs the rest of it (on the running loop)."""
    loop = asyncio.get_running_loop()
    if sys.version_info >= (3, 12):
        task = asyncio.Task(coro, loop=loop, eager_start=True)
        return None if task.done() else task
    try:
        waits_for = coro.send(None)
    except StopIteration:
        return None
    # Cancelled before its first step, the task never runs `_rest`, and the coroutine
    # is closed when `_rest` is (its `finally` blocks run at the await it stopped at).
    return loop.create_task(_rest(coro, waits_for))


async def _rest(coro: Coroutine[Any, Any, None], waits_for: object) -> None:
    """Drive `coro`, suspended on `waits_for`, to its end (what `Task.__step` does)."""
    while True:
        thrown: BaseException | None = None
        if waits_for is not None and not asyncio.isfuture(waits_for):
            coro.close()
            raise RuntimeError(f"the coroutine yielded {waits_for!r}, not a future")
        try:
            if waits_for is None:
                await asyncio.sleep(0)  # a bare yield: one turn of the loop
            else:
                waits_for._asyncio_future_blocking = False
                # Only to wait: the coroutine reads the outcome where it awaited it.
                await waits_for
        except asyncio.CancelledError as exc:
            # This task was cancelled. Where the future it waited for was cancelled
            # with it, the coroutine sees that; else it is thrown in, as a task would.
            if waits_for is None or not waits_for.cancelled():
                thrown = exc
        except Exception:  # the future's own error: the coroutine sees it where it awaited
            pass
        try:
            waits_for = coro.throw(thrown) if thrown is not None else coro.send(None)
        except StopIteration:
            return
