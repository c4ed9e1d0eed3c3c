from __future__ import annotations

import io
import re
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.json as pajson
import pyarrow.parquet as pq
import pytest

from shardcache import errors, manifests, source
from shardcache.formats import parquet, schemas
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


def test_the_largest_shard_is_the_first_of_the_largest_stored_size() -> None:
    def shard(path: str, size: int) -> manifests.ShardEntry:
        return manifests.ShardEntry(path, size, "mtime:1", 1, "f", "0" * 64)

    shards = (shard("a", 5), shard("b", 9), shard("c", 9), shard("d", 1))
    manifest = manifests.Manifest.build("file:///ds", "parquet", shards)
    assert manifest.largest_shard == shards[1]
    assert manifest.shard_count == 4
    assert manifests.Manifest.build("file:///ds", "parquet", ()).largest_shard is None


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


@pytest.mark.parametrize("name", ["data.parquet", "./data.parquet"])
def test_a_relative_single_file_uri_is_rooted_at_its_absolute_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    pq.write_table(datasets.make_table(0, 3), tmp_path / "data.parquet")
    monkeypatch.chdir(tmp_path)
    m = manifests.resolve(name)
    assert m.root == str(tmp_path)
    assert m.shard_uri_path(0) == str(tmp_path / "data.parquet")


@pytest.mark.parametrize("tail", ["#2", "?2", "?", "#"])
@pytest.mark.parametrize("scheme", ["file://", "s3://"])
def test_a_hash_or_question_mark_after_a_path_is_refused_not_dropped(
    tmp_path: Path, scheme: str, tail: str
) -> None:
    # Dropped, "v1#2" would read the dataset "v1" without a word.
    uri = f"{scheme}{tmp_path if scheme == 'file://' else 'bucket'}/v1{tail}"
    with pytest.raises(
        errors.InputError, match=f"followed by a '{re.escape(tail[0])}'.*%23 or %3F"
    ):
        manifests.resolve(uri)


def test_a_percent_encoded_name_is_decoded_for_s3_as_for_file(tmp_path: Path) -> None:
    assert source.split_uri("s3://bucket/ds/v1%232/") == ("s3", "bucket/ds/v1#2")
    for name, rows in [("v1", 3), ("v1#2", 5)]:
        (tmp_path / name).mkdir()
        pq.write_table(datasets.make_table(0, rows), tmp_path / name / "a.parquet")
    assert manifests.resolve(f"file://{tmp_path}/v1%232").total_rows == 5


def damaged_footer(tmp_path: Path) -> Path:
    buf = io.BytesIO()
    pq.write_table(datasets.make_table(0, 100), buf)
    raw = bytearray(buf.getvalue())
    length = int.from_bytes(raw[-8:-4], "little")
    raw[-8 - length : -8] = b"\xab" * length  # the magic at both ends intact
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "part-1.parquet").write_bytes(bytes(raw))
    return tmp_path / "ds"


def test_a_damaged_parquet_footer_is_an_input_error_naming_the_shard_without_retries(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # pyarrow reports a footer that is not Thrift as an OSError, as it does a failed read.
    root = damaged_footer(tmp_path)
    retry = source.RetryPolicy(attempts=3, initial_delay=0.001)
    with pytest.raises(errors.InputError, match=r"part-1.parquet' is not readable as parquet: "):
        manifests.resolve(str(root), retry=retry)
    assert not [r for r in caplog.records if "retrying" in r.getMessage()]


class FailingReads(io.RawIOBase):
    """A file of 1000 bytes whose reads fail as a store's do (a reset connection)."""

    at = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.at = 1000 + offset if whence == 2 else offset
        return self.at

    def tell(self) -> int:
        return self.at

    def readinto(self, buffer: object) -> int:
        raise ConnectionResetError("connection reset by peer")


def test_a_failed_read_of_a_parquet_footer_stays_an_os_error_to_be_retried() -> None:
    with pytest.raises(OSError, match="connection reset") as caught:
        parquet.inspect(pa.PythonFile(FailingReads(), mode="r"))
    assert not isinstance(caught.value, errors.ShardcacheError)


def many_jsonl(root: Path, lines: list[str]) -> str:
    """One JSON Lines shard of each line, in that order (part-00000.jsonl first)."""
    root.mkdir()
    for i, line in enumerate(lines):
        (root / f"part-{i:05d}.jsonl").write_text(line + "\n")
    return f"file://{root}"


def test_a_schema_conflict_past_the_inspection_window_names_the_first_shard_of_each_type(
    tmp_path: Path,
) -> None:
    # Shards of one schema on both sides of the window, the conflicting types first
    # seen far from the start: the message names the first shard of each type.
    count = 3 * manifests._INSPECT_WINDOW
    lines = ['{"a": null, "b": 1}'] * count
    lines[count - 20] = '{"a": "x", "b": 1}'
    lines[count - 30] = '{"a": 1, "b": 2}'
    lines[count - 10] = '{"a": 2, "b": 3}'
    uri = many_jsonl(tmp_path / "ds", lines)
    with pytest.raises(errors.InputError) as raised:
        manifests.resolve(uri, format="jsonl")
    first_int, first_str = f"part-{count - 30:05d}.jsonl", f"part-{count - 20:05d}.jsonl"
    assert str(raised.value) == (
        f"shards disagree on the schema: field 'a' is int64 in {first_int!r}, string in "
        f"{first_str!r}; expected one type per field across shards (a column of type null, "
        "or a dictionary of nulls, all values missing, unifies with any type)"
    )


def test_a_promotion_by_name_past_the_inspection_window_is_unify_of_every_shard(
    tmp_path: Path,
) -> None:
    count = 3 * manifests._INSPECT_WINDOW
    kinds = ['{"a": 1, "b": null}', '{"b": "x", "a": null}', '{"c": true}', "", '{"a": 2}']
    lines = [kinds[(i * 7) % len(kinds)] for i in range(count)]
    uri = many_jsonl(tmp_path / "ds", lines)
    every = []
    for i, line in enumerate(lines):
        one = manifests.resolve(f"{uri}/part-{i:05d}.jsonl", format="jsonl")
        if one.shards[0].rows:
            every.append((one.shards[0].path, pajson.read_json(io.BytesIO(line.encode())).schema))
    expected = schemas.unify(every, by_name=True)
    assert expected is not None
    m = manifests.resolve(uri, format="jsonl")
    assert m.promoted == schemas.encode(expected)
    assert [s.rows for s in m.shards] == [1 if line else 0 for line in lines]


def test_a_resolve_holds_under_a_kilobyte_and_a_half_of_python_objects_a_shard(
    tmp_path: Path,
) -> None:
    """Python's share of a resolve's memory a shard (tracemalloc's peak: what every
    shard's future, FileInfo and schema held until the end cost about 2 KB a shard)."""
    count = 2000
    uri = many_jsonl(tmp_path / "ds", ['{"a": 1, "b": "x"}'] * count)
    manifests.resolve(uri, format="jsonl")  # imports and caches warm
    tracemalloc.start()
    try:
        manifests.resolve(uri, format="jsonl")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak / count < 1536, f"{peak / count:.0f} bytes a shard"


def test_of_two_unreadable_shards_past_the_inspection_window_the_first_is_named(
    tmp_path: Path,
) -> None:
    count = 3 * manifests._INSPECT_WINDOW
    lines = ['{"a": 1}'] * count
    lines[count - 40] = lines[count - 5] = "not json"
    uri = many_jsonl(tmp_path / "ds", lines)
    with pytest.raises(errors.InputError, match=r"shard '[^']*/part-\d+\.jsonl'") as raised:
        manifests.resolve(uri, format="jsonl")
    assert f"part-{count - 40:05d}.jsonl" in str(raised.value)
