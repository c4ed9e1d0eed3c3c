"""Forked children for tests of what a fork leaves (DataLoader workers fork)."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable


def child_that_stays(action: Callable[[], None] | None = None) -> int:
    """Fork a child that runs `action`, says so, then waits to be killed (`stop`); its
    pid, once it has said so."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            if action is not None:
                action()
            os.write(write, b"x")
            signal.pause()
        finally:
            os._exit(1)
    os.close(write)
    try:
        assert os.read(read, 1) == b"x", "the child did not get as far as saying so"
    finally:
        os.close(read)
    return pid


def stop(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
