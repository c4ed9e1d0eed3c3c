"""A process killed between a commit's two renames (or an eviction's two unlinks)
leaves a disk-tier data file without its meta file. It counted against the limit for
good: eviction takes only committed entries, and nothing ran the start-up scan that
docs/cache-format.md promised. On a namespace's shared disk tier every sidecar killed at
the wrong moment shrank the cache; with a tight limit the next job waited for leases
nobody held (300 s), then failed. Now a cache reclaims such orphans when it starts and
when its tier is full.

Unlike the crash matrix, whose restarted process reads the same dataset again (and so
commits the same key over the orphan), the next job here reads another dataset.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardcache.node import names, tiers
from tests.support import datasets

pytestmark = pytest.mark.integration

READER = """
import sys, shardcache
with shardcache.open(sys.argv[1], cache_dir=sys.argv[2], shuffle=False,
                     disk_limit=int(sys.argv[3])) as ds:
    print(sum(b.num_rows for b in ds.batches(1000)))
"""
#: Far longer than the next job needs; the old code waited the tier's 300 s here.
NEXT_JOB_S = 60.0


def read(uri: str, cache: Path, disk_limit: int, fault: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "SHARDCACHE_TEST_FAULT"}
    if fault:
        env["SHARDCACHE_TEST_FAULT"] = fault
    done = subprocess.run(
        [sys.executable, "-c", READER, uri, str(cache), str(disk_limit)],
        env=env,
        capture_output=True,
        text=True,
        timeout=NEXT_JOB_S,
    )
    if fault:
        assert done.returncode == -9, f"not killed at {fault}: {done.stderr[-2000:]}"
        return ""
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def orphans(disk: Path) -> list[str]:
    return sorted(
        p.name
        for p in disk.iterdir()
        if not p.name.startswith(".")
        and "." not in p.name
        and not (disk / (p.name + names.META_SUFFIX)).exists()
    )


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fault", ["cache.insert:1", "cache.evict:1"])
def test_an_orphan_a_killed_job_left_in_the_disk_tier_is_reclaimed_by_the_next_job(
    tmp_path: Path, fault: str
) -> None:
    crashed_uri, crashed = datasets.write_local(tmp_path / "a", [3000] * 3)
    next_uri, _ = datasets.write_local(tmp_path / "b", [3000] * 4)
    cache = tmp_path / "cache"
    shard_bytes = max(p.stat().st_size for p in (tmp_path / "a").iterdir())
    # The killed job's limit holds one of its shards, so its second fetch evicts.
    read(crashed_uri, cache, shard_bytes + shard_bytes // 2, fault=fault)
    disk = cache / "disk"
    left = orphans(disk)
    assert left, "the kill left no orphan: the episode tests nothing"
    # The next job's dataset fits its limit with the orphan gone, and not beside it.
    next_bytes = sum(p.stat().st_size for p in (tmp_path / "b").iterdir())
    limit = next_bytes + 4096
    assert read(next_uri, cache, limit) == str(4 * 3000)
    assert orphans(disk) == []
    tier = tiers.Tier(disk, limit_bytes=limit, name="disk", verify="never")
    committed = tier.keys()
    assert tier.used_bytes() == sum(os.stat(disk / key).st_size for key in committed)
    assert crashed.num_rows == 3 * 3000
