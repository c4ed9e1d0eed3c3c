"""How `shardcache sidecar` runs the agent: a readiness gate, metrics, start and drain.

The server calls `attach` once it listens and `detach` when it stops; the agent runs
on its own thread, so the event loop never waits on the object store.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import prometheus_client as prom

from shardcache_sidecar.checkpoint import agent, agent_config, metrics

#: The /readyz gate that stays closed until the restore at start is done.
GATE_RESTORE = "checkpoint-restore"


class Gates(Protocol):
    """The part of the sidecar's `Readiness` the agent needs."""

    def require(self, name: str, reason: str) -> None: ...

    def waiting(self, name: str, reason: str) -> None: ...

    def open(self, name: str, reason: str = "ok") -> None: ...


def attach(
    settings: agent_config.CheckpointSettings, gates: Gates, registry: prom.CollectorRegistry
) -> agent.Agent:
    """Start the agent; /readyz waits for its restore."""
    wanted = settings.restore
    gates.require(GATE_RESTORE, f"restoring checkpoint {wanted} from {settings.uri}")

    def on_readiness(ready: bool, reason: str) -> None:
        if ready:
            gates.open(GATE_RESTORE, reason)
        else:
            gates.waiting(GATE_RESTORE, reason)

    started = agent.Agent(settings, observer=metrics.Metrics(registry), on_readiness=on_readiness)
    started.start()
    return started


async def detach(running: agent.Agent) -> str | None:
    """Publish what is committed (bounded by the drain timeout, after which the agent
    logs what it did not upload), then stop. None when everything committed went up,
    else what was left (`Agent.cut_off`): the sidecar exits nonzero with it."""
    loop = asyncio.get_running_loop()
    if await loop.run_in_executor(None, running.drain):
        return None
    return running.cut_off()
