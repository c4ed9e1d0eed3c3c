"""Parquet shards."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

EXTENSIONS: tuple[str, ...] = (".parquet", ".pq")


def inspect(source: pa.NativeFile) -> tuple[int, pa.Schema]:
    meta = pq.ParquetFile(source)
    return meta.metadata.num_rows, meta.schema_arrow


def read(source: pa.NativeFile) -> pa.Table:
    # Page checksums, where the writer stored them (parquet-mr does by default), catch
    # bytes that changed on the way: a flipped bit in a data page otherwise decodes to
    # other values without any error. A CRC32 per page is cheap beside the decode.
    return pq.read_table(source, use_threads=True, page_checksum_verification=True)


#: Rows per batch of the dictionary pass in `decoded_size`.
_SIZE_BATCH = 64 * 1024


def _expands(kind: pa.DataType) -> bool:
    return bool(
        pa.types.is_string(kind)
        or pa.types.is_binary(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_large_binary(kind)
    )


def decoded_size(source: pa.NativeFile, *, limit: int) -> int:
    """Bytes the shard takes decoded, or some number above `limit` as soon as it is
    known to be over it; without decoding the shard.

    From the footer: fixed-width columns are rows x width, other columns their
    uncompressed pages (a compressed bomb is over the limit here already). Strings and
    binaries stored with a dictionary expand when decoded (one value repeated a million
    times): those columns alone are read *as dictionaries*, a batch at a time, and
    their expanded length summed without expanding them. Nested columns count their
    uncompressed pages (a bound that dictionary-encoded lists can exceed).
    """
    parquet_file = pq.ParquetFile(source)
    meta = parquet_file.metadata
    schema = parquet_file.schema_arrow
    rows = meta.num_rows
    uncompressed: dict[str, int] = {}
    dictionary: set[str] = set()
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        for c in range(group.num_columns):
            column = group.column(c)
            top = column.path_in_schema.split(".")[0]
            uncompressed[top] = uncompressed.get(top, 0) + column.total_uncompressed_size
            if column.has_dictionary_page:
                dictionary.add(top)
    total = sum(uncompressed.values())
    if total > limit:
        return total
    total = 0
    expanding: list[str] = []
    for field in schema:
        width = field.type.bit_width if pa.types.is_primitive(field.type) else None
        if width is not None and not pa.types.is_boolean(field.type):
            total += rows * width // 8 + rows // 8
        elif _expands(field.type) and field.name in dictionary:
            expanding.append(field.name)
        else:
            total += uncompressed.get(field.name, 0)
    if total > limit or not expanding:
        return total
    source.seek(0)
    as_dictionaries = pq.ParquetFile(source, read_dictionary=expanding)
    for batch in as_dictionaries.iter_batches(batch_size=_SIZE_BATCH, columns=expanding):
        for column in batch.columns:
            lengths = pc.binary_length(column.dictionary)
            values = pc.sum(lengths.take(column.indices)).as_py() or 0
            total += values + 8 * (len(column) + 1)
        if total > limit:
            break
    return total
