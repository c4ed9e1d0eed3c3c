"""A shard missing from the source, through a real sidecar: `fetch_failures` and
`shardcache_source_errors_total{op="fetch"}` count one failure per failed fetch a
reader waited on; the readahead's (and the fill's) failed tries of the same shard count
apart, in `readahead_failures` and `shardcache_readahead_failures_total`
(docs/monitoring.md, "Source errors"). Before, one missing shard counted three times."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from shardcache import contract, errors, manifests, plans, sidecar_client
from shardcache.contract import protocol
from shardcache.node import pinned_manifests, tiers
from tests.support import datasets, waiting
from tests.support.sidecar import SidecarProcess

pytestmark = pytest.mark.integration

SHARDS = [100, 100, 100, 100, 100, 100]


def metric(proc: SidecarProcess, name: str) -> float:
    _, text = proc.http_get("/metrics")
    (line,) = [line for line in str(text).splitlines() if line.startswith(name + " ")]
    return float(line.removeprefix(name + " "))


def settled(stats: Callable[[], dict[str, object]]) -> dict[str, object]:
    """`stats` once the prefetcher is done: its counts unchanged for a second."""
    keys = ("fetches", "fetch_failures", "readahead_failures")
    last: list[tuple[object, ...]] = []

    def unchanged() -> dict[str, object] | None:
        now = stats()
        seen = tuple(now.get(k) for k in keys)
        last.append(seen)
        return now if len(last) >= 5 and len(set(last[-5:])) == 1 else None

    return waiting.wait_until("the prefetcher to go idle", unchanged, interval=0.25)


def test_a_missing_shard_counts_one_source_error_per_failed_fetch_a_reader_waited_on(
    tmp_path: Path, sidecar_factory: object
) -> None:
    root = tmp_path / "ds"
    datasets.write_dataset(pafs.LocalFileSystem(), str(root), SHARDS)
    uri = f"file://{root}"
    # The manifest pinned, as another sidecar of the node left it, names a shard the
    # source lost since: the sidecar starts without fetching it (its startup fill
    # would have), and every fetch of it fails.
    manifest = manifests.resolve(uri)
    workdir = tmp_path / "sidecar"
    proc: SidecarProcess = sidecar_factory(  # type: ignore[operator]
        uri,
        workdir=workdir,
        env={contract.ENV_MANIFEST_DIGEST: manifest.digest},
        args=[
            *("--no-shuffle", "--ready-shards", "1", "--prefetch-depth", "4"),
            *("--source-retry-seconds", "0.2"),
        ],
    )
    disk = tiers.Tier(proc.disk_dir, limit_bytes=1 << 30, name="disk", fsync=False)
    pinned_manifests.keep(disk, manifest, uri=uri)
    (root / "part-00003.parquet").unlink()
    proc.start(wait="ready")
    fetch = 'shardcache_source_errors_total{op="fetch"}'
    assert metric(proc, 'shardcache_manifest_loads_total{origin="node"}') == 1

    shards = sidecar_client.SidecarProvider.from_env(environ=proc.client_env())
    reader = shards.open_reader(plans.PlanParams(shuffle=False), position=0)

    def status_stats() -> dict[str, object]:
        return proc.control("GET", protocol.STATUS)[1]["stats"]  # type: ignore[no-any-return]

    # The startup fill and the reader's readahead try shard 3, and fail.
    waiting.wait_until(
        "the prefetch to try shard 3",
        lambda: "prefetch of shard 3 failed" in proc.log_tail(),
        describe=proc.log_tail,
    )
    ahead = settled(status_stats)
    # No reader waited on those tries: not source errors of the data path.
    assert ahead["fetch_failures"] == 0, ahead
    assert metric(proc, fetch) == 0
    assert metric(proc, "shardcache_readahead_failures_total") >= 1
    assert ahead["readahead_failures"] == metric(proc, "shardcache_readahead_failures_total")
    failure = ahead["last_fetch_error"]
    assert isinstance(failure, dict) and failure["shard"] == 3, ahead

    with pytest.raises(errors.ShardcacheError, match=r"part-00003\.parquet"):
        shards.acquire(reader, 3, epoch=0, position=300)
    stats = status_stats()
    assert stats["fetch_failures"] == 1, stats
    assert metric(proc, fetch) == 1
    # Each further failed fetch a reader waits on counts once more.
    with pytest.raises(errors.ShardcacheError, match=r"part-00003\.parquet"):
        shards.acquire(reader, 3, epoch=0, position=300)
    assert status_stats()["fetch_failures"] == 2
    assert metric(proc, fetch) == 2
    # The sidecar keeps serving the other shards.
    shards.acquire(reader, 4, epoch=0, position=400).release()
    assert metric(proc, fetch) == 2
