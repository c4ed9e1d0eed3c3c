"""A reader stuck on a shard, seen from outside the trainer: /v1/status says which shard
it waits on since when and where the fetch is, /metrics reads it as stalled, its acquire
ends at the sidecar's acquire timeout with an error that says what it waited on, and a
fetch that failed is in the status with its shard, reason and time.

Before, the stuck reader's status entry was its position alone, its stall fraction kept
the low value of its last report, and (in two runs of three) its acquire never ended:
it had begun the fetch itself and waited on it past any timeout.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest

import shardcache
from shardcache import errors, plans, sidecar_client
from tests.support import datasets, waiting
from tests.support.hung_shards import HungShard
from tests.support.sidecar import SidecarProcess

pytestmark = pytest.mark.integration

SHARDS = [40, 40, 40, 40]
HUNG = 2
#: The sidecar's --acquire-timeout: long enough to look at the stuck reader first.
TIMEOUT_S = 6
ISO = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"
ARGS = [
    "--no-shuffle",
    "--prefetch-depth",
    "0",
    "--ready-shards",
    "1",
    "--no-prefetch-adaptive",
    "--acquire-timeout",
    str(TIMEOUT_S),
]
Factory = Callable[..., SidecarProcess]


def fraction(proc: SidecarProcess) -> float | None:
    text = proc.http_get("/metrics")[1]
    match = re.search(
        r'^shardcache_reader_stall_fraction\{rank="0",reader="[0-9a-f]+"\} (\S+)$',
        text,
        re.MULTILINE,
    )
    return float(match.group(1)) if match else None


def started(sidecar_factory: Factory, tmp_path: Path) -> tuple[Path, SidecarProcess]:
    """The dataset's directory and a ready sidecar over it."""
    root = tmp_path / "ds"
    datasets.write_dataset(pafs.LocalFileSystem(), str(root), SHARDS)
    proc = sidecar_factory(f"file://{root}", args=ARGS)
    proc.start(wait="ready")
    return root, proc


def test_a_reader_stuck_on_a_hung_store_shows_in_status_and_metrics_until_its_timeout(
    sidecar_factory: Factory, tmp_path: Path
) -> None:
    root, proc = started(sidecar_factory, tmp_path)
    hung = HungShard(root / f"part-0000{HUNG}.parquet")
    shards = sidecar_client.SidecarProvider.from_env(environ=proc.client_env())
    ds = shardcache.Dataset(shards, plans.PlanParams(shuffle=False))
    raised: list[BaseException] = []

    def loop() -> None:
        try:
            for _ in ds.batches(10):
                time.sleep(0.05)  # a step: the loop computes between batches
        except BaseException as exc:
            raised.append(exc)

    reading = threading.Thread(target=loop, daemon=True)
    try:
        reading.start()

        def stuck() -> list[Any] | None:
            (reader,) = [r for r in proc.control("GET", "/v1/status")[1]["readers"]]
            waits = reader.get("waiting")
            return waits if waits and waits[0]["seconds"] > 1.5 else None

        (wait,) = waiting.wait_until(
            "/v1/status to show the reader waiting on the hung shard",
            stuck,
            describe=lambda: str(proc.control("GET", "/v1/status")[1]["readers"]),
        )
        assert (wait["shard"], wait["path"], wait["timeout_s"]) == (
            HUNG,
            f"part-0000{HUNG}.parquet",
            TIMEOUT_S,
        )
        assert re.fullmatch(ISO, wait["since"]), wait
        attempt = wait["attempt"]
        assert attempt is not None, wait
        # Begun by the acquire, or by the readahead of the shard the reader moved to.
        assert attempt["why"] in ("acquire", "readahead"), attempt
        assert attempt["stage"] == "fetch", attempt
        assert attempt["waiting_acquires"] == 1, attempt
        assert re.fullmatch(ISO, attempt["stage_since"]), attempt
        # Its last report (the two shards before) was of a loop whose data kept up; a
        # loop that only waits now reads as stalled.
        stalled = fraction(proc)
        assert stalled is not None and stalled > 0.9, stalled

        reading.join(TIMEOUT_S + 30)
        assert not reading.is_alive(), "the acquire outlived the sidecar's acquire timeout"
        (error,) = raised
        # The class an embedded acquire raises: a CacheError and a TimeoutError.
        assert isinstance(error, errors.AcquireTimeoutError), error
        assert isinstance(error, TimeoutError), error
        message = str(error)
        assert f"shard {HUNG} (part-0000{HUNG}.parquet)" in message, message
        assert f"acquire timeout of {TIMEOUT_S} s" in message, message
        assert "fetching its source bytes from the store since" in message, message
        assert "code=timeout" in message, message
        (reader,) = proc.control("GET", "/v1/status")[1]["readers"]
        assert reader["waiting"] == []
    finally:
        hung.answer()
        ds.close()


def test_a_failed_fetch_is_in_the_status_with_its_shard_reason_and_time(
    sidecar_factory: Factory, tmp_path: Path
) -> None:
    root, proc = started(sidecar_factory, tmp_path)
    assert proc.control("GET", "/v1/status")[1]["stats"]["last_fetch_error"] is None
    (root / "part-00001.parquet").unlink()
    shards = sidecar_client.SidecarProvider.from_env(environ=proc.client_env())
    reader = shards.open_reader(plans.PlanParams(shuffle=False), position=0)
    try:
        with pytest.raises(errors.ShardcacheError):
            shards.acquire(reader, 1, epoch=0, position=40)
        stats = proc.control("GET", "/v1/status")[1]["stats"]
    finally:
        shards.close()
    assert stats["fetch_failures"] >= 1
    failure = stats["last_fetch_error"]
    assert (failure["shard"], failure["path"]) == (1, "part-00001.parquet"), failure
    assert "No such file" in failure["error"], failure
    assert re.fullmatch(ISO, failure["at"]), failure
