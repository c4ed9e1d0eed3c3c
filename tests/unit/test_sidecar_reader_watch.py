"""The sidecar's watch for readers whose process died: it runs only while readers
with a lock are registered, so an idle sidecar's event loop is not woken for nothing."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
from shardcache_sidecar import configuration
from shardcache_sidecar.server import lifecycle

from shardcache import plans
from shardcache.node import reader_locks

pytestmark = pytest.mark.unit


def sidecar(tmp_path: Path) -> lifecycle.Sidecar:
    settings = configuration.from_env(
        {}, overrides={"source_uri": "file:///data", "run_dir": str(tmp_path / "run")}
    )
    return lifecycle.Sidecar(settings)


def test_the_dead_reader_check_sleeps_while_no_reader_with_a_lock_is_registered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lifecycle, "READER_CHECK_S", 0.01)
    made = sidecar(tmp_path)
    checks: list[list[str]] = []
    check = made.drop_dead_readers

    def counted() -> list[str]:
        dropped = check()
        checks.append(dropped)
        return dropped

    monkeypatch.setattr(made, "drop_dead_readers", counted)
    made.settings.memory_dir.mkdir(parents=True, exist_ok=True)

    async def scenario() -> None:
        watch = asyncio.create_task(made._watch_readers())
        try:
            await asyncio.sleep(0.3)
            # Idle (no reader at all): not one check, where a 10 ms period gave ~30.
            assert checks == []
            # A reader without a lock the sidecar sees is never checked either.
            made.registry.register("unlocked", plans.PlanParams(seed=1), 0)
            await asyncio.sleep(0.1)
            assert checks == []
            # A reader with a lock arms the check, which runs until it drops it.
            lock = reader_locks.hold(made.settings.memory_dir, "r1")
            assert made.reader_lock_seen("r1")
            made.registry.register("r1", plans.PlanParams(seed=1), 0, locked=True)
            await asyncio.sleep(0.1)
            assert len(checks) >= 2 and not any(checks)
            lock.release()  # as its process's exit does
            for _ in range(100):
                if ["r1"] in checks:
                    break
                await asyncio.sleep(0.01)
            assert ["r1"] in checks
            assert made.registry.get("r1") is None
            # Nothing left to check: asleep again.
            await asyncio.sleep(0.05)
            seen = len(checks)
            await asyncio.sleep(0.2)
            assert len(checks) == seen
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch

    try:
        asyncio.run(scenario())
    finally:
        made.executor.shutdown(wait=False)
