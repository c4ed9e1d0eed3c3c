"""The data path in embedded mode against a real S3-compatible server (MinIO)."""

from __future__ import annotations

import logging
import random
import threading
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

import shardcache
from shardcache import errors, formats, plans, source
from tests.support import datasets
from tests.support.faultproxy import FaultProxy
from tests.support.s3server import S3Server

pytestmark = pytest.mark.integration

SHARDS = [300, 0, 170, 512, 45, 260]
FAST_RETRY = source.RetryPolicy(attempts=4, initial_delay=0.05, max_delay=0.2)


@pytest.fixture
def s3_dataset(s3_server: S3Server, s3_bucket: str) -> tuple[str, pa.Table]:
    table = datasets.write_dataset(s3_server.filesystem(), f"{s3_bucket}/ds", SHARDS)
    return f"s3://{s3_bucket}/ds", table


def open_s3(s3_server: S3Server, uri: str, cache: Path, **kwargs: Any) -> shardcache.Dataset:
    kwargs.setdefault("block_size", 64)
    return shardcache.open(
        uri,
        cache_dir=cache,
        storage_options=s3_server.env(),
        retry=FAST_RETRY,
        **kwargs,
    )


def uids(batches: list[pa.RecordBatch]) -> list[int]:
    return [u for b in batches for u in b.column("uid").to_pylist()]


def expected_in_plan_order(ds: shardcache.Dataset, table: pa.Table) -> pa.Table:
    """A direct read of the same rows, in the plan's order, without shardcache."""
    offsets = plans.shard_offsets(ds.manifest.shard_rows)
    pieces = [table.slice(offsets[r.shard] + r.start, len(r)) for r in ds.runs()]
    return pa.concat_tables(pieces).combine_chunks()


@pytest.mark.parametrize("shuffle", [False, True])
def test_batches_equal_a_direct_pyarrow_read_bit_for_bit(
    s3_server: S3Server, s3_dataset: tuple[str, pa.Table], tmp_path: Path, shuffle: bool
) -> None:
    uri, table = s3_dataset
    with open_s3(s3_server, uri, tmp_path, shuffle=shuffle, seed=3) as ds:
        got = pa.Table.from_batches(list(ds.batches(50))).combine_chunks()
        want = expected_in_plan_order(ds, table)
    assert got.schema.equals(want.schema)
    assert got.equals(want)
    if not shuffle:
        assert got.column("uid").to_pylist() == list(range(sum(SHARDS)))


def test_batches_inside_a_block_are_zero_copy_views_of_the_mapped_shard(
    tmp_path: Path,
) -> None:
    datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / "ds"), [1000])
    with shardcache.open(str(tmp_path / "ds"), cache_dir=tmp_path / "c", block_size=500) as ds:
        first = next(iter(ds.batches(100)))
        mem_files = list((tmp_path / "c" / "mem").glob(f"*-d{formats.DECODE_VERSION}"))
        assert len(mem_files) == 1
        # The batch's values buffer lies inside this process's mapping of the file.
        addr = first.column("tokens").values.buffers()[1].address
        assert mapping_of(addr) == str(mem_files[0].resolve())


def mapping_of(address: int) -> str | None:
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= address < hi:
            return fields[5] if len(fields) == 6 else None
    return None


@pytest.mark.parametrize("fmt", ["arrow", "jsonl"])
def test_other_formats_decode_to_the_same_rows(tmp_path: Path, fmt: str) -> None:
    table = datasets.write_dataset(
        pafs.LocalFileSystem(), str(tmp_path / "ds"), [30, 0, 41], fmt=fmt
    )
    with shardcache.open(str(tmp_path / "ds"), cache_dir=tmp_path / "c", shuffle=False) as ds:
        got = pa.Table.from_batches(list(ds.batches(16)))
    assert got.column("uid").to_pylist() == table.column("uid").to_pylist()
    assert got.column("tokens").to_pylist() == table.column("tokens").to_pylist()


@pytest.mark.parametrize("shuffle", ["block", "sample", False])
def test_a_closed_dataset_refuses_to_read_on_and_says_it_was_closed(
    tmp_path: Path, shuffle: str | bool
) -> None:
    datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / "ds"), [30, 41, 25, 33])
    ds = shardcache.open(str(tmp_path / "ds"), cache_dir=tmp_path / "c", shuffle=shuffle, window=40)
    begun = ds.batches(8)
    read = next(begun).num_rows
    ds.close()
    # The iteration begun before close() reads at most what its shard already holds.
    with pytest.raises(errors.InputError, match="this dataset was closed"):
        for batch in begun:
            read += batch.num_rows
    assert read < len(ds)
    with pytest.raises(errors.InputError, match="this dataset was closed"):
        next(iter(ds.batches(8)))
    with pytest.raises(errors.InputError, match="this dataset was closed"):
        ds.take([0])
    ds.close()  # twice is fine


def test_four_ranks_over_two_epochs_see_every_row_exactly_once(
    s3_server: S3Server, s3_dataset: tuple[str, pa.Table], tmp_path: Path
) -> None:
    uri, _ = s3_dataset
    orders: dict[tuple[int, int], list[int]] = {}
    for epoch in range(2):
        seen: list[int] = []
        for rank in range(4):
            with open_s3(s3_server, uri, tmp_path / "c", rank=rank, world_size=4, seed=11) as ds:
                ds.set_epoch(epoch)
                got = uids(list(ds.batches(32)))
                assert len(got) == len(ds)
                orders[(epoch, rank)] = got
                seen += got
        assert sorted(seen) == list(range(sum(SHARDS)))
    # Reproducible, and another epoch or seed gives another order.
    with open_s3(s3_server, uri, tmp_path / "c", rank=1, world_size=4, seed=11) as ds:
        ds.set_epoch(1)
        assert uids(list(ds.batches(32))) == orders[(1, 1)]
    assert orders[(0, 0)] != orders[(1, 0)]
    with open_s3(s3_server, uri, tmp_path / "c", rank=0, world_size=4, seed=12) as ds:
        assert uids(list(ds.batches(32))) != orders[(0, 0)]


def test_resume_at_random_points_yields_the_uninterrupted_stream(
    s3_server: S3Server, s3_dataset: tuple[str, pa.Table], tmp_path: Path
) -> None:
    uri, _ = s3_dataset
    kwargs: dict[str, Any] = {"rank": 1, "world_size": 2, "seed": 5}
    with open_s3(s3_server, uri, tmp_path, **kwargs) as ds:
        full = uids(list(ds.batches(7)))
        runs = ds.runs()
    boundaries = []
    acc = 0
    for run in runs:
        acc += len(run)
        boundaries.append(acc)
    rng = random.Random(1234)
    # Shard and block boundaries, mid-batch points, the very start and the very end.
    points = sorted({0, len(full), *boundaries[:6], *(rng.randrange(len(full)) for _ in range(16))})
    assert len(points) >= 20
    for point in points:
        with open_s3(s3_server, uri, tmp_path, **kwargs) as ds:
            # Read up to the point with one batch size (mid-batch for another) ...
            taken: list[int] = []
            stream = ds.batches(1)
            while len(taken) < point:
                taken += next(stream).column("uid").to_pylist()
            state = ds.state_dict()
            stream.close()
        assert state["position"] == point
        with open_s3(s3_server, uri, tmp_path, **kwargs) as resumed:
            resumed.load_state_dict(state)
            rest = uids(list(resumed.batches(13)))
        assert taken + rest == full, f"resume at {point} diverged"


def test_state_dict_is_small_json_and_names_mismatches(tmp_path: Path) -> None:
    import json

    datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / "ds"), [10, 10])
    with shardcache.open(str(tmp_path / "ds"), cache_dir=tmp_path / "c", seed=1) as ds:
        state = ds.state_dict()
        assert json.loads(json.dumps(state)) == state
    with shardcache.open(
        str(tmp_path / "ds"), cache_dir=tmp_path / "c", seed=2, world_size=2
    ) as other:
        with pytest.raises(
            errors.StateMismatchError, match=r"seed: state has 1, this dataset has 2"
        ) as info:
            other.load_state_dict(state)
        assert "world_size: state has 1, this dataset has 2" in str(info.value)
    datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / "other"), [10, 11])
    with shardcache.open(str(tmp_path / "other"), cache_dir=tmp_path / "c", seed=1) as other:
        with pytest.raises(errors.StateMismatchError, match="digest: state has 'sha256:"):
            other.load_state_dict(state)


def test_corrupted_or_truncated_disk_tier_file_is_fetched_again(
    s3_server: S3Server, s3_dataset: tuple[str, pa.Table], tmp_path: Path
) -> None:
    uri, table = s3_dataset
    with open_s3(s3_server, uri, tmp_path, shuffle=False) as ds:
        first = uids(list(ds.batches(64)))
    disk = sorted(p for p in (tmp_path / "disk").iterdir() if "." not in p.name)
    assert len(disk) == len([r for r in SHARDS if r])
    # Flip a byte in one file, truncate another; drop the memory tier so both are read.
    data = bytearray(disk[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    disk[0].write_bytes(bytes(data))
    with open(disk[1], "r+b") as f:
        f.truncate(10)
    for p in (tmp_path / "mem").iterdir():
        if p.is_file():  # not `.limits/`, the inserting processes' limits
            p.unlink()
    with open_s3(s3_server, uri, tmp_path, shuffle=False) as ds:
        again = uids(list(ds.batches(64)))
        stats = ds._provider.node.stats()  # type: ignore[attr-defined]
    assert again == first == table.column("uid").to_pylist()
    assert stats.corrupted["disk"] == 2
    assert stats.fetches == 2


def test_resident_bytes_stay_under_limits_and_small_limits_still_progress(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    table = datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / "ds"), [400] * 8)
    shard_file = next((tmp_path / "ds").iterdir())
    # Room for about two decoded shards while the prefetcher wants four ahead.
    probe = pq.read_table(shard_file)
    limit = int(probe.nbytes * 2.6) + 4096
    peak = {"memory": 0, "disk": 0}
    stop = threading.Event()
    caplog.set_level(logging.WARNING)
    with shardcache.open(
        str(tmp_path / "ds"),
        cache_dir=tmp_path / "c",
        memory_limit=limit,
        disk_limit=limit * 4,
        prefetch_depth=4,
        shuffle=True,
        block_size=100,
    ) as ds:
        node = ds._provider.node  # type: ignore[attr-defined]

        def watch() -> None:
            while not stop.is_set():
                peak["memory"] = max(peak["memory"], node.memory.used_bytes())
                peak["disk"] = max(peak["disk"], node.disk.used_bytes())
                stop.wait(0.001)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            got = uids(list(ds.batches(64)))
        finally:
            stop.set()
            watcher.join()
    assert sorted(got) == table.column("uid").to_pylist()
    assert 0 < peak["memory"] <= limit
    assert 0 < peak["disk"] <= limit * 4
    assert "smaller than the readahead wants" in caplog.text


def test_a_shard_larger_than_the_memory_limit_is_a_clear_error(tmp_path: Path) -> None:
    datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / "ds"), [2000])
    with shardcache.open(str(tmp_path / "ds"), cache_dir=tmp_path / "c", memory_limit=1024) as ds:
        with pytest.raises(
            errors.CacheError, match=r"shard 0 \(part-00000.parquet\).*at most 1024 bytes"
        ):
            list(ds.batches(10))


def test_source_5xx_and_stalls_are_retried_with_backoff(
    s3_server: S3Server, s3_dataset: tuple[str, pa.Table], fault_proxy: FaultProxy, tmp_path: Path
) -> None:
    uri, table = s3_dataset
    env = {**s3_server.env(), "AWS_ENDPOINT_URL": fault_proxy.endpoint_url,
           source.ENV_S3_REQUEST_TIMEOUT: "1"}  # fmt: skip
    ds = shardcache.open(
        uri, cache_dir=tmp_path, storage_options=env, retry=FAST_RETRY, shuffle=False
    )
    with ds:
        fault_proxy.fail_next(3)
        fault_proxy.stall_next(1, 3.0)
        got = uids(list(ds.batches(100)))
    assert got == table.column("uid").to_pylist()
    assert fault_proxy.faults_injected >= 3
    assert fault_proxy.stalls_injected >= 1


def test_persistent_source_failure_names_the_shard_and_the_cause(
    s3_server: S3Server, s3_dataset: tuple[str, pa.Table], fault_proxy: FaultProxy, tmp_path: Path
) -> None:
    uri, _ = s3_dataset
    env = {**s3_server.env(), "AWS_ENDPOINT_URL": fault_proxy.endpoint_url}
    ds = shardcache.open(
        uri, cache_dir=tmp_path, storage_options=env, retry=FAST_RETRY, shuffle=False
    )
    with ds:
        fault_proxy.refuse_connections()
        with pytest.raises(errors.SourceError) as info:
            list(ds.batches(100))
    message = str(info.value)
    assert "shard 0 (part-00000.parquet)" in message
    assert "failed after 4 attempts" in message


def test_bad_input_on_s3_says_what_was_expected(
    s3_server: S3Server, s3_bucket: str, tmp_path: Path
) -> None:
    fs = s3_server.filesystem()
    with pytest.raises(errors.InputError, match="nothing found at"):
        open_s3(s3_server, f"s3://{s3_bucket}/no-such-prefix", tmp_path)
    with pytest.raises(errors.InputError):
        open_s3(s3_server, "s3://no-such-bucket-shardcache/x", tmp_path)
    fs.create_dir(f"{s3_bucket}/empty")
    with fs.open_output_stream(f"{s3_bucket}/empty/_SUCCESS") as out:
        out.write(b"")
    with pytest.raises(errors.InputError, match="empty dataset"):
        open_s3(s3_server, f"s3://{s3_bucket}/empty", tmp_path)
    datasets.write_dataset(fs, f"{s3_bucket}/mixed", [3])
    with fs.open_output_stream(f"{s3_bucket}/mixed/part-00009.parquet") as out:
        pq.write_table(pa.table({"x": [1.0]}), out)
    with pytest.raises(errors.InputError, match="shards disagree on the schema"):
        open_s3(s3_server, f"s3://{s3_bucket}/mixed", tmp_path)
    with pytest.raises(errors.InputError, match="unsupported format 'csv'"):
        open_s3(s3_server, f"s3://{s3_bucket}/mixed", tmp_path, format="csv")


def test_a_later_epoch_reads_through_the_mappings_of_the_previous_one(tmp_path: Path) -> None:
    datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / "ds"), [500, 500])
    with shardcache.open(str(tmp_path / "ds"), cache_dir=tmp_path / "c", block_size=100) as ds:
        first = {b.column("uid")[0].as_py(): b for b in ds.batches(100)}
        ds.set_epoch(1)
        second = {b.column("uid")[0].as_py(): b for b in ds.batches(100)}
    assert first.keys() == second.keys()
    # Same rows at the same addresses: the epoch-0 mapping served epoch 1. (The batch
    # that ends an epoch's reading of a shard is a copy, at an address of its own.)
    sliced = 0
    for uid, batch in first.items():
        addr = batch.column("tokens").values.buffers()[1].address
        again = second[uid].column("tokens").values.buffers()[1].address
        if mapping_of(addr) is not None and mapping_of(again) is not None:
            sliced += 1
            assert again == addr
    assert sliced >= len(first) - 4


def test_mappings_of_evicted_shards_are_let_go(tmp_path: Path) -> None:
    datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / "ds"), [400] * 6)
    probe = pq.read_table(next((tmp_path / "ds").iterdir()))
    limit = int(probe.nbytes * 2.6) + 4096
    mem = tmp_path / "c" / "mem"
    with shardcache.open(
        str(tmp_path / "ds"), cache_dir=tmp_path / "c", memory_limit=limit, block_size=100
    ) as ds:
        for epoch in range(2):
            ds.set_epoch(epoch)
            for _ in ds.batches(64):
                deleted = [
                    line
                    for line in Path("/proc/self/maps").read_text().splitlines()
                    if str(mem) in line and line.endswith("(deleted)")
                ]
                # Only the shard being read may still be mapped after its eviction.
                assert len({line.split()[-2] for line in deleted}) <= 1
