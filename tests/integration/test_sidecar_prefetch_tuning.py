"""A real sidecar tunes a reader's prefetch depth from its stall signal: a loop that waits
on cold shards from a slow store gets a deeper read-ahead, seen in /metrics and the log;
with tuning off the depth stays put. Either way the reader gets exactly its rows."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable
from typing import Any

import pytest

import shardcache
from shardcache import contract, plans, sidecar_client, source
from tests.support import datasets
from tests.support.faultproxy import FaultProxy
from tests.support.s3server import S3Server
from tests.support.sidecar import SidecarProcess

pytestmark = pytest.mark.integration

#: Many small shards: the first (cold) epoch lasts long enough for several stall
#: reports (one a second) while every shard still comes from the slow store.
SHARDS = [40] * 60
#: Each request to the store is held this long: the loop, which computes nothing,
#: waits for nearly every shard at depth 1.
STORE_DELAY_S = 0.15
START_DEPTH = 1
MAX_DEPTH = 6
Factory = Callable[..., SidecarProcess]


def sample(text: str, pattern: str) -> float | None:
    match = re.search(rf"^{pattern} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else None


def depth_changes(proc: SidecarProcess) -> list[dict[str, Any]]:
    """The sidecar's log lines about depth changes (JSON logs)."""
    found = []
    for line in proc.log_path.read_text(errors="replace").splitlines():
        if '"prefetch_depth"' in line:
            doc = json.loads(line)
            if doc.get("event") == "prefetch_depth":
                found.append(doc)
    return found


def read_cold_epoch(
    sidecar_factory: Factory, s3_server: S3Server, s3_bucket: str, proxy: FaultProxy, adaptive: bool
) -> tuple[SidecarProcess, str, list[dict[str, Any]], list[int]]:
    """One epoch in file order through a sidecar whose store answers slowly; returns the
    sidecar, its /metrics text and its depth changes logged while the reader is still
    open, and the uids read. (Closing the reader sends its last stall totals, which the
    tuner decides on too: a change logged then is in no /metrics text taken before.)"""
    datasets.write_dataset(s3_server.filesystem(), f"{s3_bucket}/ds", SHARDS)
    env = {
        **s3_server.env(),
        "AWS_ENDPOINT_URL": proxy.endpoint_url,
        source.ENV_S3_REQUEST_TIMEOUT: "10",
        contract.ENV_PREFETCH_ADAPTIVE: "true" if adaptive else "false",
        contract.ENV_PREFETCH_MAX_DEPTH: str(MAX_DEPTH),
    }
    args = [
        "--no-shuffle",
        "--ready-shards",
        "1",
        "--prefetch-depth",
        str(START_DEPTH),
        "--fetch-concurrency",
        "4",
        "--log-format",
        "json",
    ]
    proc = sidecar_factory(f"s3://{s3_bucket}/ds", env=env, args=args)
    proc.start(wait="ready")
    proxy.stall_next(1_000_000, STORE_DELAY_S)
    shards = sidecar_client.SidecarProvider.from_env(environ=proc.client_env())
    ds = shardcache.Dataset(shards, plans.PlanParams(shuffle=False))
    uids: list[int] = []
    try:
        for batch in ds.batches(100):
            uids.extend(batch.column("uid").to_pylist())
        shards.flush()
        text = proc.http_get("/metrics")[1]
        changes = depth_changes(proc)
    finally:
        ds.close()
        proxy.clear_faults()
    return proc, text, changes, uids


def test_a_reader_stalled_on_cold_shards_gets_a_deeper_prefetch_logged_and_exported(
    sidecar_factory: Factory, s3_server: S3Server, s3_bucket: str, fault_proxy: FaultProxy
) -> None:
    proc, text, changes, uids = read_cold_epoch(
        sidecar_factory, s3_server, s3_bucket, fault_proxy, adaptive=True
    )
    assert uids == list(range(sum(SHARDS)))
    assert changes, f"no depth change logged; the sidecar's log:\n{proc.log_tail()}"
    first = changes[0]
    reader = first["reader"]
    assert (first["old"], first["new"], first["reason"], first["rank"]) == (
        START_DEPTH,
        START_DEPTH + 1,
        "stalled",
        0,
    )
    assert first["stall_fraction"] >= 0.2 and first["misses"] > 0
    grown = [c for c in changes if c["reader"] == reader and c["reason"] == "stalled"]
    # Each change starts where the last one ended, and none goes past the max depth.
    for before, after in itertools.pairwise(grown):
        assert after["old"] == before["new"]
    assert all(START_DEPTH < c["new"] <= MAX_DEPTH for c in grown)
    depth = sample(text, rf'shardcache_prefetch_depth\{{rank="0",reader="{reader}"\}}')
    assert depth == grown[-1]["new"]
    ups = sample(
        text, r'shardcache_prefetch_depth_changes_total\{direction="up",reason="stalled"\}'
    )
    assert ups == len(grown)
    # A closed reader leaves the depth gauge.
    after = proc.http_get("/metrics")[1]
    assert sample(after, rf'shardcache_prefetch_depth\{{rank="0",reader="{reader}"\}}') is None


def test_with_tuning_off_the_same_stalled_reader_keeps_its_depth(
    sidecar_factory: Factory, s3_server: S3Server, s3_bucket: str, fault_proxy: FaultProxy
) -> None:
    proc, text, changes, uids = read_cold_epoch(
        sidecar_factory, s3_server, s3_bucket, fault_proxy, adaptive=False
    )
    assert uids == list(range(sum(SHARDS)))
    assert changes == depth_changes(proc) == []
    depths = re.findall(
        r'^shardcache_prefetch_depth\{rank="0",reader="[0-9a-f]+"\} (\S+)$', text, re.M
    )
    assert depths == [str(float(START_DEPTH))]
    ups = sample(
        text, r'shardcache_prefetch_depth_changes_total\{direction="up",reason="stalled"\}'
    )
    assert ups == 0.0
    # It did stall: the signal was there, only the tuning was off.
    fraction = sample(text, r'shardcache_reader_stall_fraction\{rank="0",reader="[0-9a-f]+"\}')
    assert fraction is not None and fraction >= 0.2
