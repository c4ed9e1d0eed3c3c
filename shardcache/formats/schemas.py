"""Schema unification across the shards of one dataset.

Writers leave a column whose values are all missing with Arrow type `null` (pandas and
pyarrow do so for an all-None column), or as a dictionary whose values are `null` (an
all-None pandas categorical converts to one; an Arrow IPC or Feather shard keeps that
type, where Parquet reads it back as `null`), while other shards of the same dataset
carry its real type. Such a shard is not a conflict: a column with no values unifies
with the typed one, and the shard is cast at decode so every shard a reader gets has
the one unified schema. Anything else that differs (another type; another field or
order, but for JSON Lines) is a real conflict and an error naming the shards and the
fields.

The rules (README.md beside this file, "Schema unification"):

1. Every shard has the same field names in the same order. (A shard with no fields at
   all and no rows, an empty JSON Lines file, is left out of the comparison.) JSON
   Lines shards are matched by name instead (`unify(by_name=True)`): JSON objects have
   no key order and leave optional keys out, so a field a shard lacks is one of type
   `null` there, and a shard's fields may come in any order.
2. For each field, the types other than `null` are all equal: that type is the
   field's unified type. A `dictionary<values=null>` (any index type) counts as `null`
   here: it can hold no value either. A field that is `null` in every shard stays as it
   is where every shard has the same type, and is unified as `null` where they differ
   (`null` in one, a dictionary of nulls in another).
3. A shard whose field is `null` where the unified type is not is *promoted*: at
   decode, that column becomes an all-null array of the unified type (a validity
   bitmap and zeroed values: the only cost), with the typed shards' field made
   nullable (the typed shards' columns too), so batches of any two shards concatenate.
4. Apart from that, a field must be equal in every shard: type, nullability and
   field metadata (schema-level metadata, such as pandas', is ignored).

Only whole top-level columns are promoted; a `list<null>` against `list<int32>` is a
conflict, since promoting inside a nested type would change values, not just types. So
is a `dictionary<string>` against `string`: both hold values, in other types.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.types as patypes

from shardcache import errors

#: Schema metadata of a promotion that is the whole unified schema (JSON Lines shards
#: unified by field name): decoding then gives every shard those fields, in that order.
_BY_NAME = {b"shardcache.unified": b"by-name"}


def unify(schemas: Sequence[tuple[str, pa.Schema]], *, by_name: bool = False) -> pa.Schema | None:
    """The fields shards must be promoted to, or None when every shard already has the
    same fields and types.

    `schemas` are (shard path, schema) in manifest order. Returns a schema of just the
    fields some shard has as `null` and others as a type. Raises InputError naming the
    shards and fields on a real conflict.

    With `by_name` (JSON Lines, whose objects have no key order and may leave a key
    out), shards may name their fields in any order and lack some: a missing field is
    one of type null. Where their field names differ, the promotion returned is the
    whole unified schema (every field, in the order first seen), for `promote` to
    give each shard.
    """
    if not schemas:
        return None
    first_path, first = schemas[0]
    names = first.names
    same_names = all(schema.names == names for _, schema in schemas[1:])
    if not same_names and not by_name:
        path, schema = next((p, s) for p, s in schemas[1:] if s.names != names)
        raise errors.InputError(
            f"shards disagree on the schema: {path!r} has the fields {schema.names}, but "
            f"{first_path!r} has {names}; expected every shard to have the same fields in "
            "the same order"
        )
    if not same_names:
        names = list(dict.fromkeys(name for _, schema in schemas for name in schema.names))
    unified: list[pa.Field] = []
    promoted: list[pa.Field] = []
    conflicts: list[str] = []
    for i, name in enumerate(names):
        # Fields compared whole (type, nullability, field metadata): batches of two
        # shards are concatenated, which needs equal fields.
        typed: dict[str, tuple[pa.Field, str]] = {}
        some_null = False
        #: The types of the shards' columns with no values (`null`, dictionary of nulls).
        empty: set[pa.DataType] = set()
        for path, schema in schemas:
            # By position where the names are the same (a Parquet file may name two
            # columns alike); by name otherwise, where a shard may lack the field.
            index = i if same_names else schema.get_field_index(name)
            field = schema.field(index) if index >= 0 else None
            if field is None or no_values(field.type):
                some_null = True
                if field is not None:
                    empty.add(field.type)
            else:
                typed.setdefault(_describe(field), (field, path))
        if len(typed) > 1:
            found = ", ".join(f"{what} in {path!r}" for what, (_, path) in typed.items())
            conflicts.append(f"field {name!r} is {found}")
        elif typed and some_null:
            ((field, _),) = typed.values()
            # A shard has no value for it at all: the promoted field is nullable even
            # where the typed shards say `not null`, which their rows keep to.
            promoted.append(field.with_nullable(True))
            unified.append(promoted[-1])
        elif typed:
            unified.append(next(iter(typed.values()))[0])
        elif len(empty) > 1:
            # No shard has a value, in types that do not concatenate (`null` in one, a
            # dictionary of nulls in another): every shard gets it as plain `null`.
            promoted.append(pa.field(name, pa.null()))
            unified.append(promoted[-1])
        else:
            unified.append(pa.field(name, pa.null()))
    if conflicts:
        raise errors.InputError(
            "shards disagree on the schema: "
            + "; ".join(conflicts)
            + "; expected one type per field across shards (a column of type null, or a "
            "dictionary of nulls, all values missing, unifies with any type)"
        )
    if not same_names:
        return pa.schema(unified, metadata=_BY_NAME)
    return pa.schema(promoted) if promoted else None


def no_values(kind: pa.DataType) -> bool:
    """Whether a column of type `kind` can hold no value: `null`, or a dictionary whose
    values are `null` (what an all-None categorical is written as), whose every index is
    null or points at a null."""
    if patypes.is_dictionary(kind):
        return bool(patypes.is_null(kind.value_type))
    return bool(patypes.is_null(kind))


def _describe(field: pa.Field) -> str:
    text = str(field.type) + ("" if field.nullable else " not null")
    if field.metadata:
        text += f" with metadata {dict(field.metadata)}"
    return text


def promote(table: pa.Table, promoted: pa.Schema | None) -> pa.Table:
    """`table` with each of its columns with no values (`no_values`: `null`, or a
    dictionary of nulls) named in `promoted` replaced by an all-null column of the
    promoted type, and each of its fields of that type made nullable as `promoted` has
    it; other columns (and the metadata) untouched.

    A promotion by name (`unify(by_name=True)`) gives the table exactly the promotion's
    fields, in the promotion's order: a field the table lacks is an all-null column."""
    if promoted is None:
        return table
    if promoted.metadata == _BY_NAME:
        return _conform(table, promoted)
    for field in promoted:
        i = table.schema.get_field_index(field.name)
        kind = table.schema.field(i).type if i >= 0 else None
        if kind is not None and (kind == field.type or no_values(kind)):
            table = table.set_column(i, field, _column(table, i, field))
    return table


def _column(table: pa.Table, i: int, field: pa.Field) -> pa.ChunkedArray | pa.Array:
    """Column i of `table` as `field` has it: its values (only the field changes), or
    all null where it has no values (`no_values`) in another type."""
    kind = table.schema.field(i).type
    if no_values(kind) and kind != field.type:
        return pa.nulls(table.num_rows, type=field.type)
    return table.column(i)


def _conform(table: pa.Table, unified: pa.Schema) -> pa.Table:
    columns = []
    for field in unified:
        i = table.schema.get_field_index(field.name)
        columns.append(
            _column(table, i, field) if i >= 0 else pa.nulls(table.num_rows, type=field.type)
        )
    schema = pa.schema(list(unified), metadata=table.schema.metadata)
    return pa.Table.from_arrays(columns, schema=schema)


def is_by_name(schema: pa.Schema) -> bool:
    """Whether `schema` is a promotion by name (`unify(by_name=True)`), which an older
    shardcache would apply by position: manifests holding one have their own version."""
    return bool(schema.metadata == _BY_NAME)


def encode(schema: pa.Schema) -> str:
    """The schema as text for the manifest's JSON (base64 of its IPC serialization)."""
    return base64.b64encode(schema.serialize().to_pybytes()).decode()


def decode(text: str) -> pa.Schema:
    try:
        return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text, validate=True)))
    except (ValueError, TypeError) as exc:
        raise errors.InputError(f"malformed promoted schema in the manifest: {exc}") from exc


def identity(text: str) -> str:
    """A short identity of an encoded promoted schema (part of the memory-tier key)."""
    return hashlib.sha256(text.encode()).hexdigest()[:12]
