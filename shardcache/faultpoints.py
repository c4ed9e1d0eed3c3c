"""Named crash points, for the crash-matrix tests: the process SIGKILLs itself there.

Code that must survive a crash at an exact step calls `reach("name")` at that step.
`SHARDCACHE_TEST_FAULT=name[:n]` (tests only) kills the process the n-th time (default:
the first) it reaches that point, so a harness kills at a chosen step rather than at a
random time, then restarts the process and checks what it left behind.

Zero cost when the variable is unset: it is read once, at import, and `reach` is then
a function that returns at once. Nothing else in the library reads it; a production
pod never sets it (the operator writes no such variable).

`POINTS` names every point and where it is; tests/integration/test_crash_matrix.py
checks each one is reached and survived (docs/faults.md has the results).
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Final

ENV_TEST_FAULT: Final = "SHARDCACHE_TEST_FAULT"

#: Every crash point, and the step it interrupts.
POINTS: Final[dict[str, str]] = {
    # The checkpoint agent (shardcache_sidecar.checkpoint).
    "checkpoint.upload.file": "one file of a checkpoint uploaded, others not yet",
    "checkpoint.upload.manifest": "every file uploaded, the step's manifest not written",
    "checkpoint.latest": "the manifest written, the `latest` pointer not moved",
    "checkpoint.status": "the pointer moved, the node's status not yet 'uploaded'",
    "checkpoint.retention": "retention deleting an old step: its manifest gone, data left",
    "checkpoint.restore.fetch": "a restore with some byte ranges downloaded",
    "checkpoint.restore.assemble": "a restore verified in staging, not moved into place",
    "checkpoint.answer": "a requested step restored, the trainer's request not answered",
    # The node cache (shardcache.node).
    "cache.fetch": "a shard downloaded into the disk tier's temp file, not committed",
    "cache.decode": "a shard decoded, its memory-tier entry not yet written",
    "cache.insert": "a tier entry's data renamed into place, its meta not yet",
    "cache.evict": "an evicted entry's meta removed, its data file not yet",
}


def _parse(value: str | None) -> tuple[str, int] | None:
    if not value:
        return None
    name, _, count = value.partition(":")
    if name not in POINTS:
        raise ValueError(
            f"{ENV_TEST_FAULT}={value!r}: unknown point; expected one of {sorted(POINTS)}"
        )
    times = int(count) if count else 1
    if times < 1:
        raise ValueError(f"{ENV_TEST_FAULT}={value!r}: the count must be >= 1")
    return name, times


_ARMED: Final = _parse(os.environ.get(ENV_TEST_FAULT))
_lock = threading.Lock()
_reached = 0


def _off(point: str) -> None:
    """Unarmed: nothing to do."""


def _armed(point: str) -> None:
    global _reached
    assert _ARMED is not None
    name, times = _ARMED
    if point != name:
        return
    with _lock:
        _reached += 1
        if _reached == times:
            # No cleanup, no flush: exactly what the kernel's OOM killer or a node loss does.
            os.kill(os.getpid(), signal.SIGKILL)


#: Call at a named step: `faultpoints.reach("cache.insert")`.
reach = _off if _ARMED is None else _armed
