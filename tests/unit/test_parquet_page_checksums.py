"""Parquet shards that carry page checksums are verified on decode: a bit flipped in a
data page (on the wire, on a disk) is an error, not other values."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardcache import formats
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
