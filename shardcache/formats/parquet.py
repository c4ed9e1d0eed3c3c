"""Parquet shards."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from shardcache import errors

EXTENSIONS: tuple[str, ...] = (".parquet", ".pq")

_MAGIC = b"PAR1"
#: The footer's last bytes: the metadata's length (int32) and the magic.
_TAIL = 8
#: Bytes read from the end at first: the whole footer of almost every file in one read,
#: as pyarrow itself reads it.
_FIRST_READ = 64 << 10


def _footer(source: pa.NativeFile) -> bytes:
    """The file's footer (its metadata, their length and the magic), read apart from
    parsing it: an error reading is the store's (an OSError, retried by the caller),
    one parsing these bytes is the shard's (`inspect`)."""
    size = source.size()
    if size < len(_MAGIC) + _TAIL:
        raise errors.InputError(
            f"expected a Parquet file (its magic, a footer and the magic again: at least "
            f"{len(_MAGIC) + _TAIL} bytes), found {size} bytes"
        )
    first = min(size, _FIRST_READ)
    tail = source.read_at(first, size - first)
    if tail[-len(_MAGIC) :] != _MAGIC:
        raise errors.InputError(
            f"expected the Parquet magic {_MAGIC!r} at the end of the file, found "
            f"{tail[-len(_MAGIC) :]!r}: not a Parquet file, or an encrypted or cut one"
        )
    length = int.from_bytes(tail[-_TAIL : -len(_MAGIC)], "little")
    if length > size - len(_MAGIC) - _TAIL:
        raise errors.InputError(
            f"the Parquet footer says its metadata takes {length} bytes, but the file has "
            f"{size} bytes: expected at most {size - len(_MAGIC) - _TAIL}; the file is cut "
            "or damaged"
        )
    if length + _TAIL > first:
        return bytes(source.read_at(length + _TAIL, size - length - _TAIL))
    return bytes(tail[-(length + _TAIL) :])


def inspect(source: pa.NativeFile) -> tuple[int, pa.Schema]:
    """Rows and schema from the footer alone; bytes that do not parse as one are an
    `InputError` (no read of the store is retried for them)."""
    footer = _footer(source)
    try:
        # pyarrow parses the metadata from the end of what it is given: the footer
        # alone is a file to it, and no read of it can fail as I/O.
        meta = pq.ParquetFile(pa.BufferReader(footer))
        return meta.metadata.num_rows, meta.schema_arrow
    except (OSError, pa.ArrowException) as exc:
        # pyarrow reports a footer that is not Thrift as an OSError ("Couldn't
        # deserialize thrift"), like a failed read: told apart here by reading first.
        raise errors.InputError(f"damaged Parquet footer: {str(exc).strip()}") from exc


def read(source: pa.NativeFile) -> pa.Table:
    # Page checksums, where the writer stored them (parquet-mr does by default), catch
    # bytes that changed on the way: a flipped bit in a data page otherwise decodes to
    # other values without any error. A CRC32 per page is cheap beside the decode.
    return pq.read_table(source, use_threads=True, page_checksum_verification=True)


#: Rows per batch of the dictionary pass in `decoded_size`.
_SIZE_BATCH = 64 * 1024
#: Bytes per value once decoded, by Parquet physical type (BYTE_ARRAY: its offset; the
#: bytes themselves are counted apart). INT96 decodes to a 64-bit timestamp.
_WIDTH = {"BOOLEAN": 0, "INT32": 4, "INT64": 8, "INT96": 8, "FLOAT": 4, "DOUBLE": 8}
_OFFSET = 4
_DICTIONARY_ENCODINGS = frozenset({"PLAIN_DICTIONARY", "RLE_DICTIONARY"})


def _expands(kind: pa.DataType) -> bool:
    return bool(
        pa.types.is_string(kind)
        or pa.types.is_binary(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_large_binary(kind)
    )


def _value_width(column: pq.ParquetColumnSchema) -> int:
    kind = column.physical_type
    if kind == "FIXED_LEN_BYTE_ARRAY":
        # A decimal of any stored width decodes to 16 (or 32) bytes.
        length = int(column.length)
        if column.logical_type.type == "DECIMAL":
            return 32 if length > 16 else 16
        return length
    if kind == "BYTE_ARRAY":
        return _OFFSET
    return _WIDTH[kind]


def _leaf_bound(column: pq.ParquetColumnSchema, chunk: pq.ColumnChunkMetaData) -> tuple[int, bool]:
    """(bytes the leaf chunk takes decoded, not counting the values of a dictionary-
    encoded byte array; whether it is one), from the footer alone.

    `num_values` counts every level entry (nulls and empty lists too), so it bounds
    what the levels decode to whatever their run-length encoding makes of them: an
    offset per entry for each repeated level (a million empty lists stored in a few
    bytes are still a million offsets), a validity bit per entry for each optional one.
    """
    n = chunk.num_values
    structure = (
        n * _OFFSET * column.max_repetition_level + (n * column.max_definition_level + 7) // 8
    )
    values = n * _value_width(column) + (n + 7) // 8
    if column.physical_type != "BYTE_ARRAY":
        return structure + values, False
    if _DICTIONARY_ENCODINGS & set(chunk.encodings):
        return structure + values, True
    # PLAIN and DELTA_LENGTH pages hold every value's bytes (DELTA_BYTE_ARRAY's shared
    # prefixes are the one encoding that can exceed them: docs/security.md).
    return structure + values + chunk.total_uncompressed_size, False


def _expanded_bytes(array: pa.Array) -> int:
    """Bytes the dictionary-encoded byte arrays inside `array` take once expanded."""
    if isinstance(array, pa.DictionaryArray):
        if not _expands(array.type.value_type):
            return 0
        lengths = pc.binary_length(array.dictionary)
        return int(pc.sum(lengths.take(array.indices)).as_py() or 0)
    kind = array.type
    if isinstance(array, pa.MapArray):
        return _expanded_bytes(array.keys) + _expanded_bytes(array.items)
    if isinstance(array, pa.ListArray | pa.LargeListArray | pa.FixedSizeListArray):
        return _expanded_bytes(array.flatten())
    if pa.types.is_struct(kind):
        return sum(_expanded_bytes(array.field(i)) for i in range(kind.num_fields))
    return 0


def _leaves(kind: pa.DataType) -> int:
    """Parquet leaf columns an Arrow type is stored as (one per primitive inside it)."""
    if isinstance(kind, pa.BaseExtensionType):
        return _leaves(kind.storage_type)
    if pa.types.is_dictionary(kind):
        return _leaves(kind.value_type)
    if pa.types.is_map(kind):
        return _leaves(kind.key_type) + _leaves(kind.item_type)
    if kind.num_fields:  # structs, lists of every kind
        return sum(_leaves(kind.field(i).type) for i in range(kind.num_fields))
    return 1


def _top_fields(schema: pa.Schema, leaves: int) -> list[int] | None:
    """The top-level field of each leaf column, by index; None if the Arrow schema does
    not account for `leaves` leaves (then the caller reads every column).

    By index, not by the leaf's dotted path: a field named "user.name" has the path
    "user.name", which names no top-level field "user"."""
    tops = [i for i, field in enumerate(schema) for _ in range(_leaves(field.type))]
    return tops if len(tops) == leaves else None


def decoded_size(source: pa.NativeFile, *, limit: int) -> int:
    """Bytes the shard takes decoded, or some number above `limit` as soon as it is
    known to be over it; without decoding the shard.

    From the footer, per leaf column chunk, nested or not (`_leaf_bound`): the levels'
    offsets and validity from `num_values` and the maximum repetition and definition
    levels, fixed-width values as `num_values` x width, byte arrays their pages. A
    compressed bomb, or empty lists repeated a billion times, is over the limit here.
    Byte arrays stored with a dictionary expand when decoded (one value repeated a
    million times), at any depth: those leaves alone are read *as dictionaries* (their
    indices are within the bound just checked), a batch at a time, and their expanded
    length summed without expanding them.
    """
    parquet_file = pq.ParquetFile(source)
    meta = parquet_file.metadata
    schema = parquet_file.schema
    total = 0
    expanding: set[int] = set()
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        for c in range(group.num_columns):
            chunk = group.column(c)
            bound, dictionary = _leaf_bound(schema.column(c), chunk)
            total += bound
            if dictionary:
                expanding.add(c)
        if total > limit:
            return total
    if not expanding:
        return total
    source.seek(0)
    # By leaf index: two leaves may share a dotted path (a field "a.b" beside a struct
    # "a" with a child "b").
    as_dictionaries = pq.ParquetFile(source, read_dictionary=sorted(expanding))
    arrow_schema = as_dictionaries.schema_arrow
    owners = _top_fields(arrow_schema, meta.num_columns)
    # Every column is within the footer's bound just checked: reading them all, where
    # the leaves cannot be placed, costs time, never an undercount.
    tops = (
        None if owners is None else sorted({arrow_schema.field(owners[c]).name for c in expanding})
    )
    for batch in as_dictionaries.iter_batches(batch_size=_SIZE_BATCH, columns=tops):
        total += sum(_expanded_bytes(column) for column in batch.columns)
        if total > limit:
            break
    return total
