from __future__ import annotations

import re
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from shardcache import errors, manifests
from tests.support import datasets

pytestmark = pytest.mark.unit


def write(tmp_path: Path, rows: list[int], fmt: str = "parquet") -> str:
    datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / "ds"), rows, fmt=fmt)
    return f"file://{tmp_path}/ds"


@pytest.mark.parametrize("fmt", ["parquet", "arrow", "jsonl"])
def test_manifest_lists_shards_with_rows_and_schema(tmp_path: Path, fmt: str) -> None:
    m = manifests.resolve(write(tmp_path, [5, 0, 7], fmt))
    assert m.format == fmt
    assert [s.rows for s in m.shards] == [5, 0, 7]
    assert [s.path for s in m.shards] == [
        f"part-0000{i}.{'parquet' if fmt == 'parquet' else fmt}" for i in range(3)
    ]
    assert len({s.fingerprint for s in m.shards if s.rows}) == 1
    assert m.digest.startswith("sha256:") and len(m.digest) == 7 + 64


def test_manifest_order_is_sorted_relative_paths_recursively_skipping_hidden(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ds"
    for rel in [
        "b/2.parquet",
        "a.parquet",
        "b/1.parquet",
        "_SUCCESS",
        ".x.crc",
        "_tmp/9.parquet",
        "c/.hidden/3.parquet",
    ]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        if rel.endswith(".parquet"):
            pq.write_table(datasets.make_table(0, 2), root / rel)
        else:
            (root / rel).write_bytes(b"ignored")
    m = manifests.resolve(str(root))
    assert [s.path for s in m.shards] == ["a.parquet", "b/1.parquet", "b/2.parquet"]


def test_digest_is_stable_and_changes_with_content(tmp_path: Path) -> None:
    uri = write(tmp_path, [3, 4])
    assert manifests.resolve(uri).digest == manifests.resolve(uri).digest
    pq.write_table(datasets.make_table(100, 5), tmp_path / "ds" / "part-00001.parquet")
    changed = manifests.resolve(uri)
    original = manifests.resolve(write(tmp_path / "y", [3, 4]))
    assert changed.shards[1].rows == 5
    assert changed.digest != original.digest


def test_manifest_json_round_trip_verifies_the_digest(tmp_path: Path) -> None:
    m = manifests.resolve(write(tmp_path, [3, 4]))
    assert manifests.Manifest.from_json(m.to_json()) == m
    tampered = m.to_json()
    tampered["shards"][0]["rows"] = 99
    with pytest.raises(errors.ManifestMismatchError, match="altered"):
        manifests.Manifest.from_json(tampered)


def test_single_file_uri_is_a_one_shard_dataset(tmp_path: Path) -> None:
    write(tmp_path, [3, 4])
    m = manifests.resolve(str(tmp_path / "ds" / "part-00001.parquet"))
    assert [s.path for s in m.shards] == ["part-00001.parquet"]
    assert m.shard_uri_path(0) == str(tmp_path / "ds" / "part-00001.parquet")


def test_mismatched_schemas_name_both_shards(tmp_path: Path) -> None:
    write(tmp_path, [3, 4])
    pq.write_table(pa.table({"other": [1]}), tmp_path / "ds" / "part-00002.parquet")
    with pytest.raises(errors.InputError, match=r"'part-00002.parquet'.*'part-00000.parquet'"):
        manifests.resolve(f"file://{tmp_path}/ds")


def test_empty_dataset_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "_SUCCESS").write_bytes(b"")
    with pytest.raises(errors.InputError, match="empty dataset"):
        manifests.resolve(str(tmp_path / "empty"))


def test_empty_shard_is_legal(tmp_path: Path) -> None:
    m = manifests.resolve(write(tmp_path, [0, 2]))
    assert m.total_rows == 2


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("ftp://host/x", "unsupported URI scheme 'ftp'"),
        ("/nonexistent/prefix", "nothing found at '/nonexistent/prefix'"),
        ("", "expected a dataset URI"),
    ],
)
def test_bad_uris_say_what_was_expected(uri: str, message: str) -> None:
    with pytest.raises(errors.InputError, match=re.escape(message)):
        manifests.resolve(uri)


def test_unknown_extensions_need_an_explicit_format(tmp_path: Path) -> None:
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "a.csv").write_text("a\n1\n")
    with pytest.raises(errors.InputError, match="cannot infer the format"):
        manifests.resolve(str(tmp_path / "ds"))
    with pytest.raises(errors.InputError, match="unsupported format 'csv'"):
        manifests.resolve(str(tmp_path / "ds"), format="csv")


def test_bytes_of_another_format_are_a_clear_error(tmp_path: Path) -> None:
    write(tmp_path, [3])
    with pytest.raises(errors.InputError, match="not readable as arrow"):
        manifests.resolve(f"file://{tmp_path}/ds", format="arrow")
