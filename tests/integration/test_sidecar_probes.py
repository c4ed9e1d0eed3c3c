"""/healthz, /readyz, /metrics, digest pinning and process lifecycle of a real sidecar."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest

import shardcache
from shardcache import contract, errors, plans, sidecar_client
from shardcache.contract import protocol
from shardcache.node import backings
from tests.support import datasets, waiting
from tests.support.sidecar import SidecarProcess

pytestmark = pytest.mark.integration

SHARDS = [200, 150, 0, 220]
Factory = Callable[..., SidecarProcess]

EXPECTED_METRICS = [
    "shardcache_source_fetched_bytes_total",
    "shardcache_source_fetch_duration_seconds_bucket",
    "shardcache_source_errors_total",
    "shardcache_readahead_failures_total",
    'shardcache_cache_hits_total{tier="memory"}',
    'shardcache_cache_misses_total{tier="disk"}',
    'shardcache_cache_evictions_total{tier="memory"}',
    'shardcache_cache_corrupted_entries_total{tier="disk"}',
    'shardcache_cache_resident_bytes{tier="memory"}',
    'shardcache_cache_limit_bytes{tier="disk"}',
    "shardcache_readers",
    "shardcache_memory_volume_cycles_total",
    "shardcache_ready",
]


@pytest.fixture
def dataset(tmp_path: Path) -> str:
    root = tmp_path / "ds"
    datasets.write_dataset(pafs.LocalFileSystem(), str(root), SHARDS)
    return f"file://{root}"


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in metrics"
    return float(match.group(1))


def test_probes_and_metrics_on_tcp_and_on_the_socket(
    sidecar_factory: Factory, dataset: str
) -> None:
    proc = sidecar_factory(dataset)
    proc.start()
    assert proc.http_get("/healthz") == (200, {"status": "alive", "version": "v1"})
    ready = proc.wait_for("/readyz")
    assert ready["ready"] is True
    assert {c["name"]: c["ok"] for c in ready["checks"]} == {
        "tiers": True,
        "manifest": True,
        "warm": True,
    }
    assert proc.control("GET", "/healthz")[0] == 200
    assert proc.control("GET", "/readyz")[0] == 200

    shards = sidecar_client.SidecarProvider.from_env(environ=proc.client_env())
    ds = shardcache.Dataset(shards, plans.PlanParams())
    assert sum(b.num_rows for b in ds.batches(64)) == sum(SHARDS)

    status, text = proc.http_get("/metrics")
    assert status == 200
    for name in EXPECTED_METRICS:
        assert name in text, name
    assert metric(text, "shardcache_source_fetched_bytes_total") > 0
    # A miss is a reader's lookup that did not find the shard: at most one per shard it
    # asked for (the readahead and the warm-up made most resident first, uncounted).
    assert metric(text, 'shardcache_cache_misses_total{tier="memory"}') <= 3
    assert metric(text, 'shardcache_cache_resident_bytes{tier="memory"}') > 0
    assert metric(text, "shardcache_readers") == 1  # the trainer's reader replaced the startup plan
    assert metric(text, "shardcache_ready") == 1
    assert metric(text, "shardcache_source_fetch_duration_seconds_count") == 3  # non-empty shards
    socket_status, socket_text = proc.control("GET", "/metrics")
    assert socket_status == 200 and "shardcache_readers" in socket_text


def test_memory_tier_hits_count_shards_handed_to_readers_and_misses_their_cold_lookups(
    sidecar_factory: Factory, dataset: str
) -> None:
    """What `shardcache:cache_hit_ratio:rate5m` is made of (docs/monitoring.md). A cold
    acquire used to count two misses and a hit, and the warm-up and every readahead a
    miss with no reader asking: the ratio read 38% for an epoch whose shards were one in
    five warm."""
    args = ["--no-shuffle", "--prefetch-depth", "0", "--ready-shards", "1"]
    proc = sidecar_factory(dataset, args=args)
    proc.start(wait="ready")

    def counts() -> tuple[float, float]:
        text = proc.http_get("/metrics")[1]
        return (
            metric(text, 'shardcache_cache_hits_total{tier="memory"}'),
            metric(text, 'shardcache_cache_misses_total{tier="memory"}'),
        )

    # The warm-up made shard 0 resident: no reader looked.
    assert counts() == (0, 0)
    shards = sidecar_client.SidecarProvider.from_env(environ=proc.client_env())
    reader = shards.open_reader(plans.PlanParams(shuffle=False), position=0)
    try:
        # At position 0 throughout: no readahead of the shards asked for races the
        # lookups (shard 0, the plan's next, is resident).
        # A shard granted ahead is counted when the client's notes say it was taken,
        # sent in the background: flushed before each reading of the counts.
        shards.acquire(reader, 0, epoch=0, position=0).release()
        assert shards.flush()
        assert counts() == (1, 0), "(hits, misses) after a warm shard"
        for cold in (1, 3):
            shards.acquire(reader, cold, epoch=0, position=0).release()
        assert shards.flush()
        assert counts() == (3, 2), "(hits, misses) after two cold shards"
        # Taken again (pinned without asking, told in notes): a hit.
        shards.acquire(reader, 1, epoch=0, position=0).release()
        assert shards.flush()
        assert counts() == (4, 2), "(hits, misses) after a shard taken again"
    finally:
        shards.close()


def test_a_pinned_digest_that_differs_serves_no_data_and_says_why(
    sidecar_factory: Factory, dataset: str
) -> None:
    pinned = "sha256:" + "ab" * 32
    proc = sidecar_factory(dataset, env={contract.ENV_MANIFEST_DIGEST: pinned})
    proc.start()
    actual = shardcache.resolve(dataset).digest

    def says_digest() -> tuple[int, Any] | None:
        reply = proc.http_get("/readyz")
        return reply if actual in str(reply[1]) else None

    status, body = waiting.wait_until(
        "/readyz to name the resolved digest", says_digest, describe=proc.log_tail
    )
    assert status == 503
    assert pinned in str(body) and actual in str(body)
    assert proc.http_get("/healthz")[0] == 200
    status, body = proc.control("GET", protocol.MANIFEST)
    assert (status, body["error"]["code"]) == (409, protocol.CODE_MANIFEST_MISMATCH)
    with pytest.raises(errors.ManifestMismatchError, match="refusing to serve"):
        sidecar_client.SidecarProvider.from_env(environ=proc.client_env(), reconnect_timeout=5)
    assert "refusing to serve" in proc.log_tail()


def test_a_pinned_digest_that_matches_is_served(sidecar_factory: Factory, dataset: str) -> None:
    digest = shardcache.resolve(dataset).digest
    proc = sidecar_factory(dataset, env={contract.ENV_MANIFEST_DIGEST: digest})
    proc.start(wait="ready")
    shards = sidecar_client.SidecarProvider.from_env(environ=proc.client_env())
    assert shards.manifest.digest == digest


def test_an_unusable_source_is_reported_and_clients_fail_fast(
    sidecar_factory: Factory, tmp_path: Path
) -> None:
    missing = tmp_path / "no-such-dataset"
    proc = sidecar_factory(f"file://{missing}")
    proc.start()
    with pytest.raises(errors.InputError, match="nothing found"):
        # Fails on the sidecar's answer, not after the reconnect timeout.
        sidecar_client.SidecarProvider.from_env(environ=proc.client_env(), reconnect_timeout=60)
    status, body = proc.http_get("/readyz")
    assert status == 503 and str(missing) in str(body)
    assert proc.http_get("/healthz")[0] == 200


def test_sigterm_stops_cleanly_and_removes_the_socket(
    sidecar_factory: Factory, dataset: str
) -> None:
    proc = sidecar_factory(dataset)
    proc.start(wait="ready")
    assert proc.socket_path.exists()
    assert proc.stop() == 0
    assert not proc.socket_path.exists()
    assert '"msg": "shutting down"' in proc.log_tail()


def test_a_second_sidecar_on_a_live_socket_refuses_to_start(
    sidecar_factory: Factory, dataset: str
) -> None:
    first = sidecar_factory(dataset)
    first.start(wait="ready")
    second = sidecar_factory(dataset, workdir=first.workdir)
    second.start(wait="none")
    assert second.process is not None
    assert second.process.wait(timeout=60) == 2
    assert "already serving" in second.log_tail()
    assert first.control("GET", "/healthz")[0] == 200


def test_missing_settings_exit_with_a_message() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "shardcache", "sidecar", "--socket", "/tmp/x.sock"],
        env={k: v for k, v in os.environ.items() if not k.startswith("SHARDCACHE_")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert contract.ENV_SOURCE_URI in result.stderr


@pytest.mark.parametrize("base", ["/dev/shm", "/tmp"])
def test_the_sidecar_reports_what_backs_its_memory_tier(
    sidecar_factory: Factory, dataset: str, base: str
) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="scs-backing-", dir=base))
    proc = sidecar_factory(dataset, workdir=workdir)
    proc.start()
    proc.wait_for("/readyz")
    expected = backings.of(proc.memory_dir)
    assert expected is not None
    _, status = proc.control("GET", protocol.STATUS)
    assert status["memory_tier"] == expected.to_json()
    _, text = proc.http_get("/metrics")
    pages = (
        ("4KiB" if expected.small_pages else "huge") if expected.fstype == "tmpfs" else "page-cache"
    )
    name = f'shardcache_memory_tier_backing_info{{filesystem="{expected.fstype}",pages="{pages}"}}'
    assert metric(text, name) == 1
    assert f"memory tier {proc.memory_dir}: {expected.describe()}" in proc.log_tail()
