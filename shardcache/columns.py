"""Arrow columns as raw byte ranges, for adapters that build tensors over them.

A fixed-width column without nulls is one contiguous range of its values buffer; a
list column is its offsets plus such a range of its values. The adapters wrap these
ranges as tensors or arrays without copying (`torch.frombuffer`, `numpy.frombuffer`)
or copy them to a device. Nulls have no tensor form, so a column with nulls is refused
rather than silently filled.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.types as patypes

from shardcache import errors

#: Arrow type → numpy-style dtype name (the adapters map these to their own types).
DTYPES: dict[pa.DataType, str] = {
    pa.int8(): "int8",
    pa.int16(): "int16",
    pa.int32(): "int32",
    pa.int64(): "int64",
    pa.uint8(): "uint8",
    pa.uint16(): "uint16",
    pa.uint32(): "uint32",
    pa.uint64(): "uint64",
    pa.float16(): "float16",
    pa.float32(): "float32",
    pa.float64(): "float64",
    pa.bool_(): "bool",
}


def is_list(field_type: pa.DataType) -> bool:
    return bool(patypes.is_list(field_type) or patypes.is_large_list(field_type))


def fixed(array: pa.Array, *, name: str = "column") -> tuple[pa.Array, str]:
    """A fixed-width array ready to be wrapped without a copy (DLPack, numpy), and the
    dtype name it stands for. Booleans, which Arrow packs as bits, come back widened to
    one byte each (a copy) with dtype "bool"."""
    if array.null_count:
        raise errors.InputError(
            f"{name}: expected no nulls (a tensor has no null), found {array.null_count}; "
            "drop the column with columns= or fill it in the dataset"
        )
    if patypes.is_boolean(array.type):
        return pc.cast(array, pa.uint8()), "bool"
    dtype = DTYPES.get(array.type)
    if dtype is None:
        raise errors.InputError(
            f"{name}: expected a fixed-width numeric or boolean column, found {array.type}; "
            "select the columns to turn into tensors with columns="
        )
    return array, dtype


def as_bytes(array: pa.Array) -> pa.Array:
    """The bytes of a fixed-width array's values, as a uint8 array over the same
    memory (no copy): what a device copy moves."""
    width = array.type.byte_width
    data = array.buffers()[1]
    if data is None or not len(array):
        return pa.array([], pa.uint8())
    view = data.slice(array.offset * width, len(array) * width)
    return pa.Array.from_buffers(pa.uint8(), len(view), [None, view])
