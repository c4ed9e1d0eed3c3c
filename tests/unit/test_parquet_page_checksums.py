"""Shards are verified on decode: a bit flipped in a checksummed Parquet data page, or a
string that is not UTF-8 (Parquet, Arrow IPC), is an error, not other values."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardcache import errors, formats
from tests.support import datasets

pytestmark = pytest.mark.unit


def shard_bytes(*, checksums: bool) -> tuple[bytes, pa.Table]:
    table = datasets.make_table(240, 150)
    buf = io.BytesIO()
    pq.write_table(table, buf, write_page_checksum=checksums)
    return buf.getvalue(), table


def flip_in_first_data_page(data: bytes) -> bytes:
    column = pq.ParquetFile(io.BytesIO(data)).metadata.row_group(0).column(0)
    # Inside the column chunk's last page, past its header: data, not structure.
    at = column.data_page_offset + column.total_compressed_size - 3
    out = bytearray(data)
    out[at] ^= 0x10
    return bytes(out)


def test_a_checksummed_shard_decodes_to_its_rows() -> None:
    data, table = shard_bytes(checksums=True)
    decoded = formats.decode("parquet", pa.BufferReader(data))
    assert decoded.batch.column("uid").to_pylist() == table.column("uid").to_pylist()


def test_a_flipped_bit_in_a_checksummed_data_page_is_refused() -> None:
    data, _ = shard_bytes(checksums=True)
    with pytest.raises(OSError, match="CRC checksum verification failed"):
        formats.decode("parquet", pa.BufferReader(flip_in_first_data_page(data)))


def not_utf8(rows: int, bad: int) -> pa.Array:
    """`rows` strings, row `bad` of them Latin-1 (what pyarrow's Parquet reader does not
    check), the others UTF-8."""
    values = [f"row {k} é".encode() for k in range(rows)]
    values[bad] = "café".encode("latin-1")
    return pa.array(values, pa.binary()).view(pa.string())


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_a_string_column_that_is_not_utf8_is_refused_naming_the_column_and_row(
    fmt: str,
) -> None:
    table = pa.table({"uid": range(1000), "text": not_utf8(1000, 637)})
    buf = io.BytesIO()
    if fmt == "parquet":
        pq.write_table(table, buf, row_group_size=300)
    else:
        with pa.ipc.new_file(buf, table.schema) as writer:
            writer.write_table(table, max_chunksize=300)
    with pytest.raises(
        errors.InputError, match=r"column 'text' \(string\) is not valid at row 637"
    ):
        formats.decode(fmt, pa.BufferReader(buf.getvalue()))


def test_strings_nested_in_a_list_are_checked_too_naming_the_row() -> None:
    bad = not_utf8(10, 4)
    table = pa.table({"tags": pa.ListArray.from_arrays([0, 5, 10], bad)})
    buf = io.BytesIO()
    pq.write_table(table, buf)
    with pytest.raises(
        errors.InputError, match=r"column 'tags' \(list<element: string>\) is not valid at row 0"
    ):
        formats.decode("parquet", pa.BufferReader(buf.getvalue()))
