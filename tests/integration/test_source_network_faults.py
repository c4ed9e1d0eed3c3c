"""What real networks do to an object's body, between the store and the cache.

Through the fault proxy, the answer to one shard's GET is reset mid-body, truncated
under a correct Content-Length, dripped far below any sane throughput, or replaced by
other bytes of the same length. Each is retried to the correct rows or refused with an
error that names the shard; wrong rows are never served.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

import shardcache
from shardcache import errors, source
from tests.support import datasets
from tests.support.faultproxy import FaultProxy
from tests.support.s3server import S3Server

pytestmark = pytest.mark.integration

SHARDS = [120, 90, 150, 60]
VICTIM = "part-00002"
FAST_RETRY = source.RetryPolicy(attempts=4, initial_delay=0.05, max_delay=0.2)


@pytest.fixture
def s3_dataset(s3_server: S3Server, s3_bucket: str) -> tuple[str, pa.Table]:
    table = datasets.write_dataset(s3_server.filesystem(), f"{s3_bucket}/ds", SHARDS)
    return f"s3://{s3_bucket}/ds", table


def open_through(
    proxy: FaultProxy, s3_server: S3Server, uri: str, cache: Path
) -> shardcache.Dataset:
    env = {
        **s3_server.env(),
        "AWS_ENDPOINT_URL": proxy.endpoint_url,
        # Below the drip's 2 s per byte: a dripped body times out instead of finishing.
        source.ENV_S3_REQUEST_TIMEOUT: "1",
    }
    return shardcache.open(
        uri, cache_dir=cache, storage_options=env, retry=FAST_RETRY, shuffle=False
    )


def uids(ds: shardcache.Dataset) -> list[int]:
    return [u for b in ds.batches(50) for u in b.column("uid").to_pylist()]


@pytest.mark.parametrize("kind", ["reset", "truncate", "drip"])
def test_a_broken_body_is_retried_to_the_correct_rows(
    kind: str,
    s3_server: S3Server,
    s3_dataset: tuple[str, pa.Table],
    fault_proxy: FaultProxy,
    tmp_path: Path,
) -> None:
    uri, table = s3_dataset
    # Armed after open(): the manifest is resolved, the shard's own fetch is broken.
    with open_through(fault_proxy, s3_server, uri, tmp_path) as ds:
        fault_proxy.break_next(1, kind, target_contains=VICTIM)
        got = uids(ds)
    assert fault_proxy.breaks_injected == 1
    assert got == table.column("uid").to_pylist()


def test_a_body_of_other_bytes_is_refused_or_fetched_again_never_served(
    s3_server: S3Server,
    s3_dataset: tuple[str, pa.Table],
    fault_proxy: FaultProxy,
    tmp_path: Path,
) -> None:
    """The flipped bits reach the shard's footer, so the decode fails; the damaged bytes
    are dropped from the disk tier. Whether the readahead or the reader met them, the
    reader either gets the shard fetched again or an error naming it; a later reader
    gets the right rows. (A flip inside a data page is only caught where the shard has
    page checksums: test_parquet_page_checksums.py; docs/faults.md says what is not.)"""
    uri, table = s3_dataset
    want = table.column("uid").to_pylist()
    got: list[int] = []
    refused: errors.ShardcacheError | None = None
    with open_through(fault_proxy, s3_server, uri, tmp_path) as ds:
        fault_proxy.break_next(1, "corrupt", target_contains=VICTIM)
        try:
            for batch in ds.batches(1):
                got += batch.column("uid").to_pylist()
        except errors.ShardcacheError as exc:
            refused = exc
    assert fault_proxy.breaks_injected == 1
    assert got == want[: len(got)], "rows other than the pinned ones were served"
    if refused is None:
        assert got == want  # fetched again after the readahead met the damage
    else:
        assert f"shard 2 ({VICTIM}.parquet)" in str(refused)
    # Nothing damaged stayed cached: a new reader gets every row, right.
    with open_through(fault_proxy, s3_server, uri, tmp_path) as ds:
        assert uids(ds) == want
