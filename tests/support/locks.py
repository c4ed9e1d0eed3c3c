"""Probing the flock leases of the cache tiers from a test."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
from pathlib import Path

from shardcache.node import _locks
from tests.support import waiting


def exclusively_lockable(lock: Path) -> bool:
    """Whether an evictor could take the entry now (nobody holds a lease on it)."""
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


# Takes an exclusive lock on argv[1], says so, and stops itself while holding it.
_HOLDER = r"""
import os, signal, sys
from pathlib import Path
from shardcache.node import _locks
fd = _locks.acquire(Path(sys.argv[1]), _locks.EXCLUSIVE, create=True)
print("held", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
"""
_REPO = Path(__file__).resolve().parents[2]


def process_state(pid: int) -> str:
    """The state letter of /proc/<pid>/stat ("T": stopped)."""
    return _locks.process_stat(pid)[1]


class StoppedHolder:
    """A process that holds an exclusive flock on `path` and is stopped (SIGSTOP), as a
    sidecar frozen by a debugger or the freezer cgroup holds its locks. `kill` ends it
    (SIGKILL ends a stopped process too), which lets the lock go."""

    def __init__(self, path: Path) -> None:
        env = {**os.environ, "PYTHONPATH": f"{_REPO}:{_REPO / 'sidecar'}"}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _HOLDER, str(path)], stdout=subprocess.PIPE, env=env, text=True
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line == "held\n", f"the lock holder did not start: {line!r}"
        self.pid = self.proc.pid
        waiting.wait_until(
            f"pid {self.pid} stopped",
            lambda: process_state(self.pid) == "T",
            describe=lambda: f"state {process_state(self.pid)}",
        )

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
