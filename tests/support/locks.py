"""Probing the flock leases of the cache tiers from a test."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


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
