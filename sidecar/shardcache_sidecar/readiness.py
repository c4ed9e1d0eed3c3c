"""Readiness: named gates that must all be open before /readyz answers 200.

The sidecar opens its own gates (manifest resolved and matching the pinned digest; the
first shards of the startup plan resident). Other parts of the sidecar add theirs, e.g.
the checkpoint agent's "restore done", so a native sidecar's startup probe holds the
trainer back until everything it needs is in place:

    gate = sidecar.readiness.require("checkpoint-restore", "restoring step 1200")
    ...
    sidecar.readiness.open("checkpoint-restore")

Gates only ever open once they have: readiness is about start-up, and a trainer that
is running must not be marked unready because its reader moved past the first shards.
Thread-safe: agents may run in their own threads.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any


@dataclasses.dataclass
class Gate:
    name: str
    ok: bool
    reason: str


class Readiness:
    def __init__(self) -> None:
        self._gates: dict[str, Gate] = {}
        self._lock = threading.Lock()

    def require(self, name: str, reason: str) -> None:
        """Add a closed gate (or close an existing one) saying what it waits for."""
        with self._lock:
            self._gates[name] = Gate(name, False, reason)

    def waiting(self, name: str, reason: str) -> None:
        """Update why a closed gate is still closed (no-op once it is open)."""
        with self._lock:
            gate = self._gates.get(name)
            if gate is not None and not gate.ok:
                gate.reason = reason

    def open(self, name: str, reason: str = "ok") -> None:
        with self._lock:
            self._gates[name] = Gate(name, True, reason)

    def is_open(self, name: str) -> bool:
        with self._lock:
            gate = self._gates.get(name)
            return gate is not None and gate.ok

    def is_ready(self) -> bool:
        with self._lock:
            return all(g.ok for g in self._gates.values())

    def report(self) -> dict[str, Any]:
        """The /readyz body: overall verdict and every gate with its reason."""
        with self._lock:
            gates = [dataclasses.asdict(g) for g in self._gates.values()]
        return {"ready": all(g["ok"] for g in gates), "checks": gates}
