"""RFC 3339 times as the API server and the operator write them ("2026-11-28T15:30:00Z").

Read in one place: job pins compare pods' creationTimestamp with status.resolvedAt, and
the sidecar check reads a container's state.running.startedAt. A time missing or not
readable is no time (None), never an exception: each caller has a safe answer for it.
"""

from __future__ import annotations

import datetime


def parse(text: object) -> datetime.datetime | None:
    """`text` as an aware datetime (UTC where it names no offset); None for None, an
    empty string, anything not a string, or a string that is not such a time."""
    if not isinstance(text, str) or not text:
        return None
    try:
        when = datetime.datetime.fromisoformat(text)
    except ValueError:
        return None
    return when if when.tzinfo is not None else when.replace(tzinfo=datetime.UTC)
