"""RFC 3339 times as the API server and the operator write them ("2026-11-28T15:30:00Z").

Read in one place (`parse`): job pins compare pods' creationTimestamp with
status.resolvedAt, and the sidecar check reads a container's state.running.startedAt.
Written in one place (`format`, `now`): status.resolvedAt and the conditions'
lastTransitionTime, so what is written is what `parse` reads back. A time missing or not
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


def format(when: datetime.datetime) -> str:
    """`when` as the operator writes times ("2026-11-28T15:30:00Z"): UTC, whole seconds,
    the form `parse` reads back. A naive datetime is refused: which zone it meant is
    unknown, and taking it as local time or UTC would each be wrong somewhere."""
    if when.tzinfo is None or when.utcoffset() is None:
        raise ValueError(
            f"rfc3339.format needs an aware datetime (with a tzinfo), got the naive {when!r}"
        )
    return when.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now() -> str:
    """The current time as `format` writes it."""
    return format(datetime.datetime.now(datetime.UTC))
