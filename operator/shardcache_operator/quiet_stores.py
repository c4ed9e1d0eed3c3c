"""Stores that hang, left alone for a while per namespace (`Quiet`), so that they do not
hold the operator's shared read processes (docs/security.md, "Starve other namespaces
through the operator's reads").

A read of a tenant's store runs in a process the operator caps across namespaces: its
read workers (`read_workers`, source checks and applied skips) and its resolve children
(`resolve_children`). A store that hangs holds one for the read's whole timeout, or for
the worker's own retries, at each mount's timer or retry: two namespaces with such a
store held both default read workers all the time, and every other namespace's checks
got none. So after a read of a store held its process `QUIET_AFTER` seconds or more and
failed (its timeout, or the store unreachable through the retries), the namespace's
further reads of the same store fail at once (`Unanswered`, a `SourceError`: the mount is
`Degraded`/`SourceUnreachable`, its message saying when the store is read again) for
`QUIET_SECONDS`, doubled at each such failure in a row up to `QUIET_MAX_SECONDS`, and
forgotten at its first answer.

A store is the endpoint the mount's Secret names (if any) and the URI's scheme, bucket
(or host) and query; it is a namespace's own: one namespace's hanging store never keeps
another namespace's reads from the same store.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import urllib.parse
from collections.abc import Mapping

from shardcache import errors
from shardcache_operator import endpoint_policy

#: Seconds a failed read must have held its process before the failure counts against
#: the store: one refused at once held none for long, and one whose caller left it less
#: time says little of the store.
QUIET_AFTER = 10.0
#: Seconds a namespace's store is left alone after a read of it failed slowly: one
#: source check interval (`sourceCheckSeconds`' default), so a mount whose store hangs
#: is read every other check, and its namespace's other mounts of it not meanwhile.
QUIET_SECONDS = 300.0
#: The longest it is left alone (timeouts in a row double it): how late, at most, a
#: store that answers again is seen to (the message of each mount says when).
QUIET_MAX_SECONDS = 900.0


class Unanswered(errors.SourceError):
    """A read not made: a read of the same store for the same namespace failed slowly
    a short while ago (`Quiet`); `left`: seconds until the store is read again."""

    def __init__(self, message: str, *, left: float = 0.0) -> None:
        super().__init__(message)
        self.left = left


@dataclasses.dataclass
class _Silence:
    """A store of one namespace whose read failed slowly: not read before `until`
    (monotonic); `hold` seconds, doubled at the next such failure in a row."""

    hold: float
    until: float
    #: What the read that failed found ("did not answer within 60 s").
    found: str
    since: float


class Quiet:
    """Which stores, per namespace, are left alone after a read of them failed slowly
    (`key`). Called from any thread."""

    def __init__(
        self,
        *,
        after: float = QUIET_AFTER,
        hold: float = QUIET_SECONDS,
        most: float = QUIET_MAX_SECONDS,
    ) -> None:
        self.after, self.hold, self.most = after, hold, most
        self._silences: dict[tuple[str, ...], _Silence] = {}
        self._lock = threading.Lock()

    @staticmethod
    def key(namespace: str, uri: str, options: Mapping[str, str] | None) -> tuple[str, ...]:
        """`namespace`'s store that `uri` read with `options` (what the operator reads
        it with: `sources.storage_options`) is in: never shown, so a query's tokens may
        stay in it."""
        parts = urllib.parse.urlsplit(uri)
        named = options or {}
        endpoint = next((named[k] for k in endpoint_policy.ENDPOINT_KEYS if named.get(k)), "")
        return (namespace, endpoint, parts.scheme.lower(), parts.netloc, parts.query)

    def check(self, key: tuple[str, ...], what: str) -> None:
        """`Unanswered` while `key`'s store is left alone."""
        now = time.monotonic()
        with self._lock:
            silence = self._silences.get(key)
            if silence is None or now >= silence.until:
                return
        left = silence.until - now
        raise Unanswered(
            f"{what}: not read now: a read of the same store by this namespace "
            f"{silence.found}, {now - silence.since:.0f} s ago; the "
            f"operator reads it again in {left:.0f} s (a store that hangs "
            "would hold one of the operator's read processes, shared by every namespace, "
            "at each of its mounts' reads)",
            left=left,
        )

    def failed(self, key: tuple[str, ...], held: float, found: str) -> None:
        """A read of `key`'s store held its process `held` seconds and failed, as `found`
        says; one that failed sooner than `after` held none for long: nothing is kept."""
        if held < self.after:
            return
        now = time.monotonic()
        with self._lock:
            # Entries of stores read no more (a deleted mount) go once long expired.
            for old in [k for k, v in self._silences.items() if now - v.until > self.most]:
                del self._silences[old]
            before = self._silences.get(key)
            hold = self.hold if before is None else min(self.most, before.hold * 2)
            self._silences[key] = _Silence(hold, now + hold, found, now)

    def answered(self, key: tuple[str, ...]) -> None:
        """A read of `key`'s store got its answer: the store is read as before."""
        with self._lock:
            self._silences.pop(key, None)
