"""A shard mapping keeps no file descriptor, and lives exactly as long as Arrow uses it.

CPython's `mmap.mmap` kept a dup of the descriptor per mapping, and a reader keeps up
to `_Mappings.MAX_MAPPINGS` mappings: a trainer under `ulimit -n` died of a bare EMFILE
after some epochs (docs/cache-format.md, "Mapping a shard").
"""

from __future__ import annotations

import errno
import gc
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from shardcache import datasets, errors
from shardcache.inspect import session
from shardcache.node import mapping, regular_files

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def _shard(path: Path, first: int, rows: int = 10) -> Path:
    batch = pa.record_batch({"uid": pa.array(range(first, first + rows), type=pa.int64())})
    with ipc.new_file(str(path), batch.schema) as writer:
        writer.write_batch(batch)
    return path


def _mapped(path: Path) -> bool:
    """Whether this process has a mapping of `path` (/proc/self/maps)."""
    return any(
        line.endswith(" " + str(path)) for line in Path("/proc/self/maps").read_text().splitlines()
    )


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


_UNDER_LIMIT = textwrap.dedent(
    """
    import json, os, resource, sys
    from pathlib import Path
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    from shardcache import datasets
    maps = datasets._Mappings()
    paths = sorted(Path(sys.argv[1]).iterdir())
    before = len(os.listdir("/proc/self/fd"))
    out = {"uids": [], "before": before}
    try:
        for epoch in range(2):
            for p in paths:
                out["uids"].extend(maps.batch(p).column(0).to_pylist())
            maps.prune()
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["kept"] = len(maps._maps)
    out["after"] = len(os.listdir("/proc/self/fd"))
    print(json.dumps(out))
    """
)


def test_a_hundred_shards_mapped_under_a_64_descriptor_limit_are_all_read(tmp_path: Path) -> None:
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(100):
        _shard(shards / f"s{i:03}", i * 10)
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(
        [sys.executable, "-c", _UNDER_LIMIT, str(shards)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert "error" not in out, out["error"]
    assert out["uids"] == list(range(1000)) * 2  # every row of every shard, both epochs
    assert out["kept"] == 100  # all kept across the epoch: none re-mapped
    # The mappings kept hold no descriptor: the count does not grow with them.
    assert out["after"] <= out["before"] + 2, out


def test_mappings_kept_add_no_descriptor(tmp_path: Path) -> None:
    paths = [_shard(tmp_path / f"s{i}", i * 10) for i in range(20)]
    before = _fds()
    maps = datasets._Mappings()
    batches = [maps.batch(p) for p in paths]
    lazily = [session.map_lazily(p) for p in paths]  # the inspector's mappings too
    assert _fds() <= before + 2  # (the watching thread's needs none; slack for pyarrow)
    assert all(_mapped(p) for p in paths)
    assert [b.num_rows for b in batches + lazily] == [10] * 40


def test_a_batch_keeps_its_pages_mapped_until_its_last_reference_goes(tmp_path: Path) -> None:
    path = _shard(tmp_path / "s", 0, rows=1 << 16)
    batch, root = datasets.map_shard(path)
    column = batch.column(0)
    data = column.buffers()[1]
    # Zero-copy: the column's values lie inside the mapping the listener is given.
    assert root.address <= data.address and data.address + data.size <= root.address + root.size
    assert root.size == path.stat().st_size and not root.is_mutable
    tail = column.slice(1000, 5)
    del batch, column, data, root
    gc.collect()
    # Only a slice of one column is left, and it keeps the whole mapping (and reads).
    assert _mapped(path)
    assert tail.to_pylist() == [1000, 1001, 1002, 1003, 1004]
    del tail
    gc.collect()
    assert not _mapped(path)


def test_a_dropped_mapping_is_unmapped_even_after_its_file_is_gone(tmp_path: Path) -> None:
    maps = datasets._Mappings()
    path = _shard(tmp_path / "s", 0)
    maps.batch(path)
    assert _mapped(path)
    os.unlink(path)  # evicted: the mapping is still valid, and still there
    maps.prune()
    gc.collect()
    assert not any(str(path) in line for line in Path("/proc/self/maps").read_text().splitlines())


def test_running_out_of_descriptors_is_a_cache_error_naming_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _shard(tmp_path / "s", 0)

    def no_descriptor_left(*args: object, **kwargs: object) -> int:
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE), str(path))

    monkeypatch.setattr(regular_files, "open_regular", no_descriptor_left)
    with pytest.raises(errors.CacheError, match="RLIMIT_NOFILE soft limit") as info:
        datasets.map_shard(path)
    assert str(path) in str(info.value) and "ulimit -n" in str(info.value)


def test_a_missing_shard_file_is_still_file_not_found(tmp_path: Path) -> None:
    # Only a lack of descriptors or mappings becomes a CacheError: callers retry a
    # file evicted under them.
    with pytest.raises(FileNotFoundError):
        datasets.map_shard(tmp_path / "gone")


def test_an_empty_shard_file_is_a_cache_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "s"
    path.write_bytes(b"")
    with pytest.raises(errors.CacheError, match="expected a decoded shard"):
        datasets.map_shard(path)


def test_where_each_mapping_keeps_a_descriptor_fewer_are_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert mapping.kept_mappings(512) == 512  # none keeps one here
    monkeypatch.setattr(mapping, "KEEPS_FD", True)
    monkeypatch.setattr(mapping, "nofile_limit", lambda: 1024)
    assert mapping.kept_mappings(512) == 256
    monkeypatch.setattr(mapping, "nofile_limit", lambda: 16)
    assert mapping.kept_mappings(512) == mapping.MIN_KEPT
    assert datasets._Mappings().max_mappings == mapping.MIN_KEPT
