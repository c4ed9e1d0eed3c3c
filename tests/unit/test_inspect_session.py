from __future__ import annotations

import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardcache.inspect import locate, render, session

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "uri,shown",
    [
        ("s3://AKIAXXX:s3cr3t@bucket/prefix/", "s3://bucket/prefix/"),
        ("s3://bucket/data?access_key=AK&secret_key=s3cr3t", "s3://bucket/data"),
        ("gs://user@bucket:443/x", "gs://bucket:443/x"),
        ("file:///data/tokens", "file:///data/tokens"),
        ("/plain/path", "/plain/path"),
    ],
)
def test_public_uri_drops_credentials(uri: str, shown: str) -> None:
    assert session.public_uri(uri) == shown


ESC = "\x1b"
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def hostile_dataset(root: Path) -> str:
    """Escape sequences in a column name, a struct field, chat turns, a value, the
    shard's file name and the dataset root."""
    root.mkdir(parents=True)
    table = pa.table(
        {
            "uid": [0, 1],
            f"col{ESC}[8m": ["a\x9b", f"b{ESC}]8;;http://evil.example/{ESC}\\"],
            "turns": pa.array(
                [[{"role": f"user{ESC}[1A", "content": f"hi {ESC}[2J{ESC}]52;c;cm0K\x07"}]] * 2
            ),
            "meta": pa.array([{f"k{ESC}[31m": "\u202eexe"}] * 2),
        }
    )
    pq.write_table(table, root / f"part{ESC}[2K.parquet")
    return root.as_uri()


def test_step_text_prints_no_control_character_from_the_data(tmp_path: Path) -> None:
    insp = session.open_uri(
        hostile_dataset(tmp_path / f"ds{ESC}[5m"), cache_dir=str(tmp_path / "c")
    )
    try:
        view = insp.step(locate.Query(batch_size=2, shuffle=False))
        text = session.step_text(
            session.step_json(view, insp.manifest, options=render.RenderOptions())
        )
        where = session.where_text(
            session.where_json(insp.where("uid == 1", locate.Query(batch_size=2))), locate.Query()
        )
    finally:
        insp.close()
    for output in (text, where):
        assert not CONTROL.search(output.replace("\n", "")), output
    assert "part\\u001b[2K.parquet" in text
    assert "col\\u001b[8m" in text


def test_a_column_named_twice_is_shown_once(tmp_path: Path) -> None:
    insp = session.open_uri(hostile_dataset(tmp_path / "ds"), cache_dir=str(tmp_path / "c"))
    try:
        assert insp.columns(["uid", "uid", "meta", "uid"]) == ["uid", "meta"]
        view = insp.step(locate.Query(batch_size=2), ["uid", "uid"])
        assert view.batch.schema.names == ["uid"]
    finally:
        insp.close()


def test_a_scan_budget_smaller_than_a_shard_scans_its_first_rows(tmp_path: Path) -> None:
    root = tmp_path / "big"
    root.mkdir()
    pq.write_table(pa.table({"uid": pa.array(range(5000), pa.int64())}), root / "one.parquet")
    insp = session.open_uri(root.as_uri(), cache_dir=str(tmp_path / "c"))
    try:
        found = insp.scan("uid == 3", max_rows=1000)
        assert (found.indices, found.scanned, found.rows, found.stopped) == (
            [3],
            1000,
            5000,
            "budget",
        )
        missed = insp.where("uid == 4500", locate.Query(), max_rows=1000)
        data = session.where_json(missed)
        assert (data["matches"], data["truncated"], data["stopped"]) == (0, True, "budget")
        # Not "no sample matches": it says how far it looked.
        assert "searched the first 1,000 of 5,000 rows" in session.where_text(data, locate.Query())
        whole = insp.scan("uid == 4500")
        assert (whole.indices, whole.stopped, whole.scanned) == ([4500], None, 5000)
    finally:
        insp.close()


def test_statistics_of_wide_rows_stop_at_their_byte_budget_not_at_the_row_bound(
    tmp_path: Path,
) -> None:
    # Four shards of 50 rows of 64 KiB each (3.2 MiB a shard): a row bound of 100,000
    # read them all; a budget of one shard's bytes reads the first, and says so.
    root = tmp_path / "wide"
    root.mkdir()
    for shard in range(4):
        blobs = [bytes([shard]) * (64 << 10)] * 50
        pq.write_table(pa.table({"image": pa.array(blobs, pa.binary())}), root / f"{shard}.parquet")
    insp = session.open_uri(root.as_uri(), cache_dir=str(tmp_path / "c"))
    try:
        bounded = insp.stats(max_rows=100_000, max_bytes=3 << 20)
        assert (bounded["rows"], bounded["dataset_rows"]) == (50, 200)
        assert insp.stats(max_rows=100_000, max_bytes=7 << 20)["rows"] == 150
        assert insp.stats(max_rows=100_000)["rows"] == 200
        assert insp.stats(max_rows=70, max_bytes=1)["rows"] == 50  # the first shard always
    finally:
        insp.close()
