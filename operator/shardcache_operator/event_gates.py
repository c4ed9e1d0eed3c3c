"""At most one webhook Event per DatasetMount and cause in a while, with a count.

The webhook posts a Warning Event on a DatasetMount for what it skipped in a pod (no
metrics port left: `admission.REASON_NO_METRICS_PORT`). Every pod of a Deployment or
Job meets the same cause, so one Event per pod made 500 Events for 500 pods, each an API
write before the pod is answered. The reconcile's Events are deduplicated by the status
they change (`reconcile._events`); the webhook writes no status, so the gate is kept in
memory: the first pod's Event is posted, the next pods' are counted, and the first one
after `interval_seconds` is posted with the count of those held back. A restart forgets
the gate and posts once more: the cost of never writing status from the webhook.
"""

from __future__ import annotations

import dataclasses

#: Seconds between two Events for the same mount and cause: about as often as kopf
#: repeats a failing handler's Event (`handlers.hold_for_crd`).
INTERVAL_SECONDS = 300.0
#: Causes remembered; beyond it the oldest is forgotten (and may post once more).
MAX_KEYS = 4096

#: (namespace, name, uid, reason, message) of a DatasetMount's Event.
Key = tuple[str, str, str, str, str]


@dataclasses.dataclass
class _Seen:
    posted_at: float
    held: int = 0


@dataclasses.dataclass
class Gate:
    interval_seconds: float = INTERVAL_SECONDS
    max_keys: int = MAX_KEYS
    _seen: dict[Key, _Seen] = dataclasses.field(default_factory=dict)

    def admit(self, key: Key, *, now: float) -> int | None:
        """None: hold this Event back (it is counted). Else post it: the number of
        Events held back for `key` since the last one posted (0 for the first)."""
        seen = self._seen.get(key)
        if seen is not None and now - seen.posted_at < self.interval_seconds:
            seen.held += 1
            return None
        held = 0 if seen is None else seen.held
        self._seen.pop(key, None)
        while len(self._seen) >= self.max_keys:
            del self._seen[next(iter(self._seen))]
        # Re-inserted last: the dict's order is the order of posting, oldest first.
        self._seen[key] = _Seen(posted_at=now)
        return held


def with_count(message: str, held: int) -> str:
    """The Event's message, saying how many like it were held back before it."""
    if not held:
        return message
    pods = "pod" if held == 1 else "pods"
    return f"{message} (and {held} more {pods} since the last such Event)"
