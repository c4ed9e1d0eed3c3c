"""A shard the pinned manifest names that the store no longer has is the store's
failure (`SourceError`, kind=source), on a `file://` source as on S3.

`source.download` let the store's FileNotFoundError through `with_retries`, which
raised every permanent error as `InputError`: a dataset file deleted after the manifest
was pinned reached the trainer as kind=input, "fix your input", from a user who gave
nothing wrong, and it was counted as no source failure.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pytest

import shardcache
from shardcache import errors, source
from tests.support import datasets
from tests.support.s3server import S3Server

pytestmark = pytest.mark.integration

FAST_RETRY = source.RetryPolicy(attempts=2, initial_delay=0.01, max_delay=0.02)


def test_download_of_a_pinned_object_that_is_gone_is_a_source_error(tmp_path: Path) -> None:
    data = b"x" * 100
    shard = tmp_path / "part-00000.parquet"
    shard.write_bytes(data)
    shard.unlink()
    with pytest.raises(errors.SourceError) as raised:
        source.download(
            pafs.LocalFileSystem(),
            str(shard),
            tmp_path / "dest",
            expected_size=len(data),
            what="fetching shard 0 (part-00000.parquet)",
            policy=FAST_RETRY,
            sha256=hashlib.sha256(data).hexdigest(),
        )
    assert not isinstance(raised.value, errors.InputError)
    message = str(raised.value)
    assert "fetching shard 0 (part-00000.parquet)" in message
    assert "expected the 100-byte object the manifest pinned, found none" in message
    assert "re-pin the dataset" in message


def _read_after_deleting_shard_1(
    uri: str, delete: Callable[[str], None], cache: Path, options: dict[str, str] | None = None
) -> errors.ShardcacheError:
    ds = shardcache.open(
        uri, cache_dir=cache, storage_options=options, retry=FAST_RETRY, shuffle=False
    )
    with ds:
        delete(ds.manifest.shards[1].path)
        with pytest.raises(errors.ShardcacheError) as raised:
            list(ds.batches(5))
    return raised.value


def test_a_file_shard_deleted_after_pinning_reaches_the_trainer_as_a_source_error(
    tmp_path: Path,
) -> None:
    root = tmp_path / "data"
    uri, _ = datasets.write_local(root, [10, 10, 10])
    error = _read_after_deleting_shard_1(
        uri, lambda name: os.unlink(root / name), tmp_path / "cache"
    )
    assert isinstance(error, errors.SourceError), repr(error)
    assert "shard 1 (part-00001.parquet)" in str(error)


def test_an_s3_shard_deleted_after_pinning_reaches_the_trainer_as_a_source_error(
    s3_server: S3Server, s3_bucket: str, tmp_path: Path
) -> None:
    fs = s3_server.filesystem()
    table: pa.Table = datasets.write_dataset(fs, f"{s3_bucket}/ds", [10, 10, 10])
    assert table.num_rows == 30
    error = _read_after_deleting_shard_1(
        f"s3://{s3_bucket}/ds",
        lambda name: fs.delete_file(f"{s3_bucket}/ds/{name}"),
        tmp_path / "cache",
        s3_server.env(),
    )
    assert isinstance(error, errors.SourceError), repr(error)
    assert "shard 1 (part-00001.parquet)" in str(error)
