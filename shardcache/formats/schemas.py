"""Schema unification across the shards of one dataset.

Writers leave a column whose values are all missing with Arrow type `null` (pandas and
pyarrow do so for an all-None column), while other shards of the same dataset carry
its real type. Such a shard is not a conflict: a null column unifies with the typed
one, and the shard is cast at decode so every shard a reader gets has the one
unified schema. Anything else that differs (another type, another field, another
order) is a real conflict and an error naming the shards and the fields.

The rules (README.md beside this file, "Schema unification"):

1. Every shard has the same field names in the same order. (A shard with no fields at
   all and no rows, an empty JSON Lines file, is left out of the comparison.)
2. For each field, the types other than `null` are all equal: that type is the
   field's unified type. A field that is `null` in every shard stays `null`.
3. A shard whose field is `null` where the unified type is not is *promoted*: at
   decode, that column becomes an all-null array of the unified type (a validity
   bitmap and zeroed values: the only cost), with the typed shards' field (its
   nullability and metadata), so batches of any two shards concatenate.
4. Apart from that, a field must be equal in every shard: type, nullability and
   field metadata (schema-level metadata, such as pandas', is ignored).

Only whole top-level columns are promoted; a `list<null>` against `list<int32>` is a
conflict, since promoting inside a nested type would change values, not just types.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.types as patypes

from shardcache import errors


def unify(schemas: Sequence[tuple[str, pa.Schema]]) -> pa.Schema | None:
    """The fields shards must be promoted to, or None when every shard already has the
    same fields and types.

    `schemas` are (shard path, schema) in manifest order. Returns a schema of just the
    fields some shard has as `null` and others as a type. Raises InputError naming the
    shards and fields on a real conflict.
    """
    if not schemas:
        return None
    first_path, first = schemas[0]
    names = first.names
    for path, schema in schemas[1:]:
        if schema.names != names:
            raise errors.InputError(
                f"shards disagree on the schema: {path!r} has the fields {schema.names}, but "
                f"{first_path!r} has {names}; expected every shard to have the same fields in "
                "the same order"
            )
    promoted: list[pa.Field] = []
    conflicts: list[str] = []
    for i, name in enumerate(names):
        # Fields compared whole (type, nullability, field metadata): batches of two
        # shards are concatenated, which needs equal fields.
        typed: dict[str, tuple[pa.Field, str]] = {}
        some_null = False
        for path, schema in schemas:
            field = schema.field(i)
            if patypes.is_null(field.type):
                some_null = True
            else:
                typed.setdefault(_describe(field), (field, path))
        if len(typed) > 1:
            found = ", ".join(f"{what} in {path!r}" for what, (_, path) in typed.items())
            conflicts.append(f"field {name!r} is {found}")
        elif typed and some_null:
            ((field, _),) = typed.values()
            promoted.append(field)
    if conflicts:
        raise errors.InputError(
            "shards disagree on the schema: "
            + "; ".join(conflicts)
            + "; expected one type per field across shards (a column of type null, all "
            "values missing, unifies with any type)"
        )
    return pa.schema(promoted) if promoted else None


def _describe(field: pa.Field) -> str:
    text = str(field.type) + ("" if field.nullable else " not null")
    if field.metadata:
        text += f" with metadata {dict(field.metadata)}"
    return text


def promote(table: pa.Table, promoted: pa.Schema | None) -> pa.Table:
    """`table` with each of its `null`-typed columns named in `promoted` replaced by an
    all-null column of the promoted type; other columns (and the metadata) untouched."""
    if promoted is None:
        return table
    for field in promoted:
        i = table.schema.get_field_index(field.name)
        if i < 0 or not patypes.is_null(table.schema.field(i).type):
            continue
        table = table.set_column(i, field, pa.nulls(table.num_rows, type=field.type))
    return table


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
