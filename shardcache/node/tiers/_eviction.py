"""Which entries make room for a new one, and in which order: least recently used first.

The policy is a pure function over a listing; removing an entry is passed in, because
only the tier knows whether a lease holds it (then it stays, and its bytes count as
held).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping


def least_recently_used(data: Mapping[str, os.stat_result]) -> list[tuple[str, os.stat_result]]:
    """Entries oldest first by their data file's mtime; the key breaks ties, so the
    order is the same in every process looking at the same directory."""
    return sorted(data.items(), key=lambda kv: (kv[1].st_mtime_ns, kv[0]))


def evict_for(
    data: Mapping[str, os.stat_result],
    *,
    used: int,
    size: int,
    limit: int,
    remove: Callable[[str, int], bool],
) -> tuple[int, int]:
    """Evict until `size` more bytes fit under `limit`; return (bytes used, bytes leased).

    `remove(key, nbytes)` evicts one entry unless a lease holds it, and says whether it
    did. Bytes leased counts the entries looked at that a lease kept.
    """
    leased = 0
    for victim, st in least_recently_used(data):
        if used + size <= limit:
            break
        if remove(victim, st.st_size):
            used -= st.st_size
        else:
            leased += st.st_size
    return used, leased
