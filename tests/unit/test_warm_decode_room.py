"""A startup shard whose decode can never fit the sidecar's decode room
(`DecodeRoomError`) keeps the warm gate closed, said once with the reason. The warm-up
retried it like a failing source, every 1 s up to every 30 s, a WARNING each time,
although neither the shard's decoded size nor the room changes while the sidecar runs."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
from shardcache_sidecar import configuration
from shardcache_sidecar.server import lifecycle

from shardcache.node import decode_budgets

pytestmark = pytest.mark.unit

REFUSAL = (
    "shard 1 (part-00001.parquet) takes 900 bytes decoded (from its metadata) and that is "
    "more than the decode budget of 500 bytes (...): refused before decoding"
)


class Node:
    def upcoming(self, _reader: str, k: int) -> list[int]:
        return list(range(k))


class Entry:
    def __init__(self) -> None:
        self.released = False

    def release(self) -> None:
        self.released = True


async def test_a_shard_that_never_fits_the_decode_room_is_not_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    settings = configuration.from_env(
        {},
        overrides={
            "source_uri": "file:///data",
            "run_dir": str(tmp_path / "run"),
            "ready_shards": 2,
        },
    )
    sidecar = lifecycle.Sidecar(settings)
    sidecar.readiness.require(lifecycle.GATE_WARM, "warming")
    tries: list[int] = []
    first = Entry()

    async def acquire(_node: Any, shard: int, _timeout: float, **_: Any) -> Entry:
        tries.append(shard)
        if shard == 0:
            return first
        raise decode_budgets.DecodeRoomError(REFUSAL, size=900, room=500)

    monkeypatch.setattr(sidecar, "acquire", acquire)
    with caplog.at_level(logging.WARNING):
        # The retry waited 1 s, then 2, 4, ... 30: well past this.
        await asyncio.wait_for(sidecar._warm(Node()), 3.0)  # type: ignore[arg-type]
    assert tries == [0, 1]
    assert first.released
    report = sidecar.readiness.report()
    assert report["ready"] is False
    (gate,) = [g for g in report["checks"] if g["name"] == lifecycle.GATE_WARM]
    assert gate["reason"].startswith(
        "shard 1 of the first 2 startup shards cannot be decoded here: shard 1 "
    ), gate
    assert "Not retried" in gate["reason"] and "retrying" not in gate["reason"]
    (record,) = [r for r in caplog.records if "decode budget" in r.getMessage()]
    assert record.levelno == logging.ERROR
    sidecar.executor.shutdown(wait=False)
