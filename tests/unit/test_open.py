"""`shardcache.open()`'s options: types, ranges, and the mode that uses each one."""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import pyarrow.fs as pafs
import pytest

import shardcache
from shardcache import _open_options, contract, errors, source
from shardcache.node import caches
from tests.support import datasets

pytestmark = pytest.mark.unit

#: A valid value of each embedded-only option: refused without a URI all the same.
EMBEDDED_VALUES: dict[str, object] = {
    "cache_dir": "/tmp/cache",
    "format": "parquet",
    "memory_dir": "/dev/shm/x",
    "memory_limit": 1 << 30,
    "disk_limit": 1 << 30,
    "prefetch_depth": 4,
    "fetch_concurrency": 4,
    "storage_options": {"AWS_REGION": "us-east-1"},
    "retry": source.RetryPolicy(),
}


@pytest.fixture
def no_sidecar(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (contract.ENV_MOUNT, contract.ENV_SOCKET, contract.ENV_RUN_DIR):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def local_uri(tmp_path: Path) -> str:
    datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / "ds"), [40, 25])
    return str(tmp_path / "ds")


def test_every_open_parameter_has_a_kind_and_at_most_one_mode() -> None:
    params = inspect.signature(shardcache.open).parameters
    named = {n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
    assert set(_open_options.KINDS) == named
    assert set(_open_options.EMBEDDED_ONLY) <= named
    assert set(_open_options.SIDECAR_ONLY) <= named
    assert not set(_open_options.EMBEDDED_ONLY) & set(_open_options.SIDECAR_ONLY)
    assert set(EMBEDDED_VALUES) == set(_open_options.EMBEDDED_ONLY)


@pytest.mark.usefixtures("no_sidecar")
@pytest.mark.parametrize("name", sorted(EMBEDDED_VALUES))
def test_sidecar_mode_refuses_an_embedded_only_option_by_name(name: str) -> None:
    with pytest.raises(errors.InputError, match=rf"found {name}; set them in the DatasetMount"):
        shardcache.open(**{name: EMBEDDED_VALUES[name]})  # type: ignore[arg-type]


@pytest.mark.usefixtures("no_sidecar")
def test_sidecar_mode_names_every_refused_option() -> None:
    with pytest.raises(errors.InputError) as info:
        shardcache.open(cache_dir="/tmp/c", prefetch_depth=2, storage_options={})
    assert "found cache_dir, prefetch_depth, storage_options;" in str(info.value)


@pytest.mark.usefixtures("no_sidecar")
def test_sidecar_mode_with_only_shared_options_goes_on_to_find_the_sidecar() -> None:
    # Past the option checks, the next thing open() needs is the sidecar's address.
    with pytest.raises(errors.InputError, match=r"not set up for a sidecar"):
        shardcache.open(seed=3, rank=1, world_size=2, shuffle=False, digest="sha256:x")


def test_embedded_mode_refuses_a_mount(local_uri: str, tmp_path: Path) -> None:
    with pytest.raises(errors.InputError, match=r"found mount; drop the URI"):
        shardcache.open(local_uri, cache_dir=tmp_path / "c", mount="tokens")


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        (
            "shuffle",
            "samples",
            """shuffle: expected True, False, "block" or "sample", found str 'samples'""",
        ),
        ("shuffle", 1, """shuffle: expected True, False, "block" or "sample", found int 1"""),
        ("window", 0, r"window: expected a row count \(an int >= 1\), found 0"),
        ("seed", "7", "seed: expected an int, found str '7'"),
        ("rank", True, "rank: expected an int, found bool True"),
        ("world_size", 2.0, "world_size: expected an int, found float 2.0"),
        ("block_size", 8.0, "block_size: expected an int, found float 8.0"),
        ("memory_limit", -1, r"memory_limit: expected a byte count \(an int >= 0\), found -1"),
        ("disk_limit", "1Gi", r"disk_limit: expected a byte count \(an int >= 0\), found str"),
        ("prefetch_depth", -2, r"prefetch_depth: expected a shard count \(an int >= 0\)"),
        ("fetch_concurrency", 0, "fetch_concurrency: expected an int >= 1, found 0"),
        (
            "storage_options",
            {"AWS_MAX_ATTEMPTS": 3},
            "found the entry str 'AWS_MAX_ATTEMPTS': int 3",
        ),
        ("storage_options", [("a", "b")], "storage_options: expected a mapping of str to str"),
        ("retry", {"attempts": 2}, "retry: expected a shardcache.source.RetryPolicy, found dict"),
        ("cache_dir", 3, r"cache_dir: expected a directory path \(str or os.PathLike\)"),
        ("digest", b"sha256:x", "digest: expected a manifest digest string, found bytes"),
        ("resume_from", 2.5, r'resume_from: expected "latest", a step \(int\) or a checkpoint'),
    ],
)
def test_a_wrong_option_is_refused_saying_expected_and_found(
    local_uri: str, tmp_path: Path, name: str, value: object, message: str
) -> None:
    with pytest.raises(errors.InputError, match=message):
        shardcache.open(local_uri, **{"cache_dir": tmp_path / "c", name: value})  # type: ignore[arg-type]
    assert not (tmp_path / "c").exists(), "no cache may start before the options are checked"


def test_a_uri_that_is_not_a_string_is_refused(tmp_path: Path) -> None:
    with pytest.raises(errors.InputError, match=r"source_uri: expected a URI string"):
        shardcache.open(tmp_path, cache_dir=tmp_path / "c")  # type: ignore[arg-type]


def test_options_given_reach_the_embedded_cache(local_uri: str, tmp_path: Path) -> None:
    retry = source.RetryPolicy(attempts=2, initial_delay=0.01)
    with shardcache.open(
        local_uri,
        cache_dir=tmp_path / "c",
        memory_limit=1 << 20,
        disk_limit=2 << 20,
        prefetch_depth=0,
        fetch_concurrency=2,
        retry=retry,
        shuffle=False,
    ) as ds:
        settings = ds.provider.node.settings  # type: ignore[attr-defined]
        assert sum(b.num_rows for b in ds.batches(10)) == 65
    assert (settings.memory_limit, settings.disk_limit) == (1 << 20, 2 << 20)
    assert (settings.prefetch_depth, settings.fetch_concurrency) == (0, 2)
    assert settings.retry is retry


def test_options_left_out_take_the_node_cache_defaults(local_uri: str, tmp_path: Path) -> None:
    defaults = caches.NodeSettings(disk_dir=tmp_path, memory_dir=tmp_path)
    with shardcache.open(local_uri, cache_dir=os.fspath(tmp_path / "c")) as ds:
        settings = ds.provider.node.settings  # type: ignore[attr-defined]
    assert settings.prefetch_depth == defaults.prefetch_depth
    assert settings.fetch_concurrency == defaults.fetch_concurrency
    assert settings.retry == defaults.retry
    assert settings.memory_dir == tmp_path / "c" / contract.MEMORY_SUBDIR
