"""What a trainer's first mistakes get: a clear InputError naming the argument, never a
silent misread or a traceback from deep inside pathlib or pyarrow. Regression tests of
the s20 trainer explorer's D2-D5."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import shardcache
import shardcache.numpy
from shardcache import errors, source
from tests.support import datasets

pytestmark = pytest.mark.unit


def test_columns_given_as_a_str_is_refused_not_read_as_its_letters(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "ds").mkdir()
    pq.write_table(
        pa.table({"a": [1, 2], "b": [3, 4], "ab": [5, 6]}), tmp_path / "ds" / "p.parquet"
    )
    with shardcache.open(f"file://{tmp_path / 'ds'}", cache_dir=tmp_path / "c") as ds:
        with pytest.raises(errors.InputError, match=r"columns=\['ab'\]"):
            next(iter(ds.batches(2, columns="ab")))
        assert next(iter(ds.batches(2, columns=["ab"]))).schema.names == ["ab"]


def test_the_numpy_batches_refuse_columns_given_as_a_str(tmp_path: Path) -> None:
    uri, _ = datasets.write_local(tmp_path / "ds", [5])
    with pytest.raises(errors.InputError, match="expected a list of column names"):
        shardcache.numpy.Batches(uri, batch_size=2, columns="uid", cache_dir=tmp_path / "c")


def test_a_cache_dir_that_is_a_file_is_named_in_the_error(tmp_path: Path) -> None:
    uri, _ = datasets.write_local(tmp_path / "ds", [5])
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(errors.InputError, match="cache_dir: expected a directory"):
        shardcache.open(uri, cache_dir=tmp_path / "file")


@pytest.mark.parametrize(
    "options",
    [
        {"key": "k", "secret": "s", "endpoint_url": "http://127.0.0.1:9"},  # fsspec's
        {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_ENDPOINT": "http://x"},
    ],
)
def test_storage_options_with_keys_nobody_reads_are_refused_naming_them(
    tmp_path: Path, options: dict[str, str]
) -> None:
    with pytest.raises(errors.InputError, match="storage_options: expected keys among") as refused:
        shardcache.open("s3://bucket/tokens/", cache_dir=tmp_path / "c", storage_options=options)
    unknown = sorted(k for k in options if k not in source.STORAGE_OPTION_KEYS)
    assert str(unknown) in str(refused.value)


def test_every_key_the_s3_client_reads_is_a_known_storage_option() -> None:
    source.check_storage_options({k: "x" for k in source.STORAGE_OPTION_KEYS})


def test_sample_mode_without_numpy_is_refused_at_open_naming_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri, _ = datasets.write_local(tmp_path / "ds", [5])
    real = importlib.util.find_spec

    def without_numpy(name: str, package: str | None = None) -> object:
        return None if name == "numpy" else real(name, package)

    # A trainer's pyarrow-only install: numpy is not found.
    monkeypatch.setattr(importlib.util, "find_spec", without_numpy)
    with pytest.raises(errors.InputError, match=r"shardcache\[sample\]"):
        shardcache.open(uri, cache_dir=tmp_path / "c", shuffle="sample")
    shardcache.open(uri, cache_dir=tmp_path / "c", shuffle="block").close()
