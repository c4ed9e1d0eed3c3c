"""`shardcache.open(digest=…)` in both modes: a pinned dataset is served as pinned or
refused, never mixed with bytes of a dataset that changed.

The refusals reached: the digest differs at open (embedded) or from what the sidecar
serves; an object whose size changed after the manifest was resolved (source.download);
an object of the same size whose rows changed (the node cache's decode check).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

import shardcache
from shardcache import contract, errors
from tests.support import datasets
from tests.support.sidecar import SidecarProcess

pytestmark = pytest.mark.integration

# Enough shards that the last one is read (and fetched) well after open() resolved.
SHARDS = [40, 35, 50, 30, 45, 20, 25, 60]
LAST = len(SHARDS) - 1


def write(tmp_path: Path, fmt: str = "parquet") -> tuple[Path, pa.Table]:
    root = tmp_path / "ds"
    table = datasets.write_dataset(pafs.LocalFileSystem(), str(root), SHARDS, fmt=fmt)
    return root, table


def shard_file(root: Path, index: int) -> Path:
    (path,) = root.glob(f"part-{index:05d}.*")
    return path


def grow(path: Path) -> None:
    """The object now has other bytes and another size (rewritten by someone else)."""
    path.write_bytes(path.read_bytes() + b"\0" * 17)


def rewrite(path: Path, rows: int) -> None:
    """A valid shard with other rows in place of the old one."""
    pq.write_table(datasets.make_table(10_000, rows), path)


def same_size_fewer_rows(path: Path) -> None:
    """A JSON Lines shard rewritten to the same byte size with one row fewer."""
    lines = path.read_text().splitlines(keepends=True)
    merged = json.loads(lines[-2])
    # The dropped line's bytes move into the kept row's text: same total size.
    merged["text"] += "y" * len(lines[-1])
    path.write_text("".join(lines[:-2]) + json.dumps(merged) + "\n")


def uids_until_error(ds: shardcache.Dataset) -> tuple[list[int], BaseException | None]:
    got: list[int] = []
    try:
        for batch in ds.batches(1):  # one row at a time: every row before a refusal shows
            got += batch.column("uid").to_pylist()
    except errors.ShardcacheError as exc:
        return got, exc
    return got, None


def test_embedded_open_with_the_resolved_digest_reads_the_pinned_dataset(tmp_path: Path) -> None:
    root, table = write(tmp_path)
    digest = shardcache.resolve(str(root)).digest
    with shardcache.open(str(root), cache_dir=tmp_path / "c", digest=digest, shuffle=False) as ds:
        assert ds.manifest.digest == digest
        got, error = uids_until_error(ds)
    assert error is None and got == table.column("uid").to_pylist()


def test_embedded_open_refuses_a_dataset_that_changed_since_it_was_pinned(
    tmp_path: Path,
) -> None:
    root, _ = write(tmp_path)
    digest = shardcache.resolve(str(root)).digest
    rewrite(shard_file(root, 3), SHARDS[3] + 1)
    with pytest.raises(errors.ManifestMismatchError, match=f"{digest} was pinned"):
        shardcache.open(str(root), cache_dir=tmp_path / "c", digest=digest)


def test_embedded_an_object_resized_after_resolve_is_refused_not_served(tmp_path: Path) -> None:
    root, table = write(tmp_path)
    digest = shardcache.resolve(str(root)).digest
    # prefetch_depth=1: the last shard is fetched only when the reader gets near it,
    # long after open() resolved the manifest.
    ds = shardcache.open(
        str(root), cache_dir=tmp_path / "c", digest=digest, shuffle=False, prefetch_depth=1
    )
    with ds:
        grow(shard_file(root, LAST))
        got, error = uids_until_error(ds)
    assert isinstance(error, errors.ManifestMismatchError), error
    assert "changed after the manifest was resolved" in str(error)
    assert f"shard {LAST}" in str(error)
    # What was served is exactly the pinned rows before the changed shard, nothing of it.
    assert got == table.column("uid").to_pylist()[: sum(SHARDS[:LAST])]


def test_embedded_an_object_with_other_rows_at_the_same_size_is_refused(tmp_path: Path) -> None:
    root, table = write(tmp_path, fmt="jsonl")
    digest = shardcache.resolve(str(root)).digest
    ds = shardcache.open(
        str(root), cache_dir=tmp_path / "c", digest=digest, shuffle=False, prefetch_depth=1
    )
    with ds:
        path = shard_file(root, LAST)
        size = path.stat().st_size
        same_size_fewer_rows(path)
        assert path.stat().st_size == size
        got, error = uids_until_error(ds)
    assert isinstance(error, errors.ManifestMismatchError), error
    # The manifest pins each file's content (sha256 for file://), so the fetch refuses
    # it before the decode's row check, which stays as the second line of defence.
    assert "changed after the manifest was resolved and is not served" in str(error)
    assert got == table.column("uid").to_pylist()[: sum(SHARDS[:LAST])]


@pytest.fixture
def pinned_sidecar(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[SidecarProcess, str]]:
    root, _ = write(tmp_path)
    digest = shardcache.resolve(str(root)).digest
    proc = SidecarProcess(
        f"file://{root}",
        env={
            contract.ENV_MANIFEST_DIGEST: digest,
            contract.ENV_READY_SHARDS: "1",
            # No readahead and no epoch fill: the last shard is fetched only when the
            # reader reaches it, after the test changed it. (With the fill, the sidecar
            # may hold its pinned bytes before the change, and serving those is right.)
            contract.ENV_PREFETCH_DEPTH: "0",
        },
        args=["--no-shuffle"],
    )
    try:
        proc.start(wait="ready")
        for key, value in proc.client_env().items():
            monkeypatch.setenv(key, value)
        yield proc, digest
    finally:
        proc.cleanup()


def test_sidecar_open_with_the_pinned_digest_refuses_an_object_resized_after_resolve(
    pinned_sidecar: tuple[SidecarProcess, str], tmp_path: Path
) -> None:
    proc, digest = pinned_sidecar
    table = pa.concat_tables(datasets.make_table(sum(SHARDS[:i]), n) for i, n in enumerate(SHARDS))
    with shardcache.open(digest=digest, shuffle=False) as ds:
        assert ds.manifest.digest == digest
        grow(shard_file(tmp_path / "ds", LAST))
        got, error = uids_until_error(ds)
    assert error is not None, "the changed shard was served"
    assert "changed after the manifest was resolved" in str(error), error
    assert got == table.column("uid").to_pylist()[: sum(SHARDS[:LAST])]
    assert "changed after the manifest was resolved" in proc.log_tail()


def test_sidecar_open_with_another_digest_is_refused_naming_both(
    pinned_sidecar: tuple[SidecarProcess, str],
) -> None:
    _, digest = pinned_sidecar
    other = "sha256:" + "cd" * 32
    with pytest.raises(errors.ManifestMismatchError) as info:
        shardcache.open(digest=other)
    assert digest in str(info.value) and other in str(info.value)
