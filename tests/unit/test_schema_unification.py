"""Shards whose all-missing columns have type null unify with the typed shards; real
conflicts are refused naming the shards and the fields."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

import shardcache
from shardcache import errors, manifests
from shardcache.formats import schemas

pytestmark = pytest.mark.unit


def write(root: Path, tables: list[pa.Table]) -> str:
    root.mkdir()
    for i, table in enumerate(tables):
        pq.write_table(table, root / f"part-{i:05d}.parquet")
    return str(root)


def typed(first: int, rows: int) -> pa.Table:
    return pa.table(
        {
            "uid": pa.array(range(first, first + rows), pa.int64()),
            "label": pa.array(
                [u % 3 if u % 4 else None for u in range(first, first + rows)], pa.int64()
            ),
            "text": pa.array([f"t{u}" for u in range(first, first + rows)]),
        }
    )


def all_null(first: int, rows: int) -> pa.Table:
    """What pandas or pyarrow write for a shard whose labels are all None."""
    table = typed(first, rows)
    return table.set_column(1, pa.field("label", pa.null()), pa.nulls(rows))


def test_unify_promotes_a_null_column_to_the_type_of_the_others() -> None:
    a, b = typed(0, 3).schema, all_null(3, 2).schema
    promoted = schemas.unify([("a", a), ("b", b), ("c", a)])
    assert promoted == pa.schema([pa.field("label", pa.int64())])
    assert schemas.unify([("a", a), ("c", a)]) is None


def test_a_column_null_in_every_shard_stays_null() -> None:
    b = all_null(0, 2).schema
    assert schemas.unify([("a", b), ("b", b)]) is None


def test_a_dataset_with_an_all_null_shard_reads_exactly(tmp_path: Path) -> None:
    tables = [typed(0, 40), all_null(40, 25), typed(65, 30)]
    uri = write(tmp_path / "ds", tables)
    with shardcache.open(uri, cache_dir=tmp_path / "cache", shuffle=False) as ds:
        assert ds.manifest.promoted is not None
        got = pa.Table.from_batches(list(ds.batches(16)))
    expected = pa.concat_tables([t.cast(tables[0].schema) for t in tables])
    assert got.schema == tables[0].schema
    assert got.equals(expected)
    assert got.column("label").to_pylist()[40:65] == [None] * 25


def test_a_dataset_with_an_all_null_shard_reads_exactly_shuffled(tmp_path: Path) -> None:
    tables = [all_null(0, 33), typed(33, 40), all_null(73, 7)]
    uri = write(tmp_path / "ds", tables)
    with shardcache.open(uri, cache_dir=tmp_path / "cache", seed=5, block_size=8) as ds:
        batches = list(ds.batches(10))
    got = pa.Table.from_batches(batches).sort_by("uid")
    expected = pa.concat_tables([t.cast(tables[1].schema) for t in tables])
    assert got.equals(expected)


def test_int_against_string_is_refused_naming_the_shards_and_the_field(tmp_path: Path) -> None:
    strings = typed(40, 5)
    strings = strings.set_column(1, "label", pa.array(["x"] * 5))
    uri = write(tmp_path / "ds", [typed(0, 40), all_null(40, 3), strings])
    with pytest.raises(
        errors.InputError,
        match=(
            r"shards disagree on the schema: field 'label' is int64 in 'part-00000.parquet', "
            r"string in 'part-00002.parquet'; expected one type per field"
        ),
    ):
        shardcache.open(uri, cache_dir=tmp_path / "cache")


def test_other_fields_are_refused_naming_both_shards(tmp_path: Path) -> None:
    other = typed(40, 5).rename_columns(["uid", "label", "body"])
    uri = write(tmp_path / "ds", [typed(0, 40), other])
    with pytest.raises(
        errors.InputError,
        match=r"'part-00001.parquet' has the fields \['uid', 'label', 'body'\], but "
        r"'part-00000.parquet' has \['uid', 'label', 'text'\]",
    ):
        shardcache.open(uri, cache_dir=tmp_path / "cache")


def test_a_promotion_is_part_of_the_digest_and_survives_json(tmp_path: Path) -> None:
    uri = write(tmp_path / "ds", [typed(0, 4), all_null(4, 4)])
    manifest = manifests.resolve(uri)
    again = manifests.Manifest.from_json(manifest.to_json())
    assert again == manifest
    plain = manifests.Manifest.build(manifest.root, manifest.format, manifest.shards)
    assert plain.digest != manifest.digest
    # The same source shard decodes to another file once promoted.
    assert plain.decoded_key(1) != manifest.decoded_key(1)
    assert "promoted" not in plain.to_json()
    tampered = {
        **manifest.to_json(),
        "promoted": schemas.encode(pa.schema([("label", pa.string())])),
    }
    with pytest.raises(errors.ManifestMismatchError, match="altered"):
        manifests.Manifest.from_json(tampered)


def test_a_not_null_field_promoted_from_an_all_null_shard_is_served_nullable(
    tmp_path: Path,
) -> None:
    strict = pa.schema([("x", pa.int64()), pa.field("lab", pa.int64(), nullable=False)])
    tables = [
        pa.table({"x": [1, 2], "lab": [1, 2]}, schema=strict),
        pa.table({"x": [3, 4], "lab": pa.nulls(2)}),
    ]
    uri = write(tmp_path / "ds", tables)
    assert schemas.unify([("a", tables[0].schema), ("b", tables[1].schema)]) == pa.schema(
        [pa.field("lab", pa.int64(), nullable=True)]
    )
    with shardcache.open(uri, cache_dir=tmp_path / "cache", shuffle=False) as ds:
        got = pa.Table.from_batches(list(ds.batches(4)))
    # Every shard, the typed one too, has the field as the data has it: nullable.
    assert got.schema.field("lab") == pa.field("lab", pa.int64(), nullable=True)
    assert got.column("lab").to_pylist() == [1, 2, None, None]
    got.validate(full=True)


def write_jsonl(root: Path, shards: dict[str, bytes]) -> str:
    root.mkdir()
    for name, text in shards.items():
        (root / name).write_bytes(text)
    return str(root)


def test_jsonl_shards_with_keys_in_another_order_or_missing_unify_by_name(
    tmp_path: Path,
) -> None:
    uri = write_jsonl(
        tmp_path / "ds",
        {
            "part-0.jsonl": b'{"text":"a","label":1}\n{"text":"b","label":2,"meta":"x"}\n',
            "part-1.jsonl": b'{"label":3,"text":"c"}\n',  # other order, no "meta"
            "part-2.jsonl": b"{}\n{}\n",  # no key at all
            "part-3.jsonl": b"",
        },
    )
    with shardcache.open(uri, cache_dir=tmp_path / "cache", shuffle=False) as ds:
        got = pa.Table.from_batches(list(ds.batches(8)))
    assert got.schema.names == ["text", "label", "meta"]
    assert got.to_pylist() == [
        {"text": "a", "label": 1, "meta": None},
        {"text": "b", "label": 2, "meta": "x"},
        {"text": "c", "label": 3, "meta": None},
        {"text": None, "label": None, "meta": None},
        {"text": None, "label": None, "meta": None},
    ]


def test_jsonl_shards_that_disagree_on_a_type_are_still_refused(tmp_path: Path) -> None:
    uri = write_jsonl(
        tmp_path / "ds", {"part-0.jsonl": b'{"a":1,"b":"x"}\n', "part-1.jsonl": b'{"b":2}\n'}
    )
    with pytest.raises(errors.InputError, match=r"field 'b' is string in 'part-0.jsonl', int64"):
        manifests.resolve(uri)


def test_jsonl_shards_of_the_same_fields_promote_as_before(tmp_path: Path) -> None:
    # The digest of a dataset that resolved before unification by name is unchanged.
    uri = write_jsonl(
        tmp_path / "ds",
        {"part-0.jsonl": b'{"a":1,"b":null}\n', "part-1.jsonl": b'{"a":2,"b":"x"}\n'},
    )
    manifest = manifests.resolve(uri)
    assert manifest.promoted_schema == pa.schema([("b", pa.string())])
    assert manifest.to_json()["version"] == manifests.MANIFEST_VERSION == 3


def test_a_manifest_matching_jsonl_fields_by_name_has_its_own_version(tmp_path: Path) -> None:
    """A shardcache before unification by name would decode each shard in its own field
    order: such a manifest is version 4, which it refuses by number, and it round-trips
    here."""
    uri = write_jsonl(
        tmp_path / "ds",
        {"part-0.jsonl": b'{"a":1,"b":"x"}\n', "part-1.jsonl": b'{"b":"y","a":2}\n'},
    )
    manifest = manifests.resolve(uri)
    body = manifest.to_json()
    assert body["version"] == manifests.BY_NAME_VERSION == 4
    assert manifests.Manifest.from_json(body) == manifest
    # The version is covered by the digest and must agree with the promotion.
    with pytest.raises(
        errors.InputError, match="says version 3, but its promotion makes it version 4"
    ):
        manifests.Manifest.from_json({**body, "version": 3})
    with pytest.raises(errors.InputError, match="manifest version 5 is not supported"):
        manifests.Manifest.from_json({**body, "version": 5})


def all_null_categorical(rows: int, indices: str = "int32") -> pa.DictionaryArray:
    """An all-None pandas categorical as pyarrow converts it: a dictionary of nulls."""
    index = pa.nulls(rows, pa.type_for_alias(indices))
    return pa.DictionaryArray.from_arrays(index, pa.array([], pa.null()))


def with_label(table: pa.Table, label: pa.Array) -> pa.Table:
    return table.set_column(1, pa.field("label", label.type), label)


def write_shards(root: Path, fmt: str, tables: list[pa.Table]) -> str:
    if fmt == "parquet":
        return write(root, tables)
    root.mkdir()
    for i, table in enumerate(tables):
        feather.write_feather(table, root / f"part-{i:05d}.arrow")
    return str(root)


def test_unify_counts_a_dictionary_of_nulls_as_a_column_without_values() -> None:
    strings = pa.schema([("label", pa.string())])
    nulls = pa.schema([("label", pa.null())])
    categories = pa.schema([("label", pa.dictionary(pa.int8(), pa.string()))])
    no_categories = pa.schema([("label", all_null_categorical(1).type)])
    assert schemas.unify([("a", strings), ("b", no_categories)]) == strings
    assert schemas.unify([("a", no_categories), ("b", categories)]) == categories
    # No shard has a value: `null` and a dictionary of nulls do not concatenate, so
    # every shard gets the field as `null`.
    assert schemas.unify([("a", nulls), ("b", no_categories)]) == nulls
    assert schemas.unify([("a", no_categories), ("b", no_categories)]) is None
    # A dictionary of strings holds values: against a string it is another type.
    with pytest.raises(
        errors.InputError,
        match=r"field 'label' is string in 'a', dictionary<values=string, indices=int8",
    ):
        schemas.unify([("a", strings), ("b", categories)])


@pytest.mark.parametrize("fmt", ["arrow", "parquet"])
def test_a_shard_whose_labels_are_an_all_null_categorical_reads_as_the_typed_shards(
    tmp_path: Path, fmt: str
) -> None:
    tables = [typed(0, 6), with_label(typed(6, 4), all_null_categorical(4)), typed(10, 3)]
    uri = write_shards(tmp_path / "ds", fmt, tables)
    with shardcache.open(uri, cache_dir=tmp_path / "cache", shuffle=False) as ds:
        got = pa.Table.from_batches(list(ds.batches(5)))
    assert got.schema == tables[0].schema
    assert got.column("uid").to_pylist() == list(range(13))
    assert got.column("label").to_pylist() == [
        *[u % 3 if u % 4 else None for u in range(6)],
        *[None] * 4,
        *[u % 3 if u % 4 else None for u in range(10, 13)],
    ]
    got.validate(full=True)


def test_shards_of_all_null_categoricals_and_of_null_columns_read_as_null_sampled(
    tmp_path: Path,
) -> None:
    tables = [
        with_label(typed(0, 5), all_null_categorical(5, "int8")),
        all_null(5, 4),
        with_label(typed(9, 3), all_null_categorical(3)),
    ]
    uri = write_shards(tmp_path / "ds", "arrow", tables)
    with shardcache.open(uri, cache_dir=tmp_path / "cache", shuffle="sample", seed=3) as ds:
        got = pa.Table.from_batches(list(ds.batches(4))).sort_by("uid")
    assert got.schema.field("label") == pa.field("label", pa.null())
    assert got.column("uid").to_pylist() == list(range(12))
    assert got.column("label").null_count == 12


def test_a_categorical_of_strings_against_strings_is_still_refused(tmp_path: Path) -> None:
    categories = pa.array(["x", "y", "x"]).dictionary_encode()
    strings = with_label(typed(3, 2), pa.array(["x", None]))
    uri = write_shards(tmp_path / "ds", "arrow", [with_label(typed(0, 3), categories), strings])
    with pytest.raises(
        errors.InputError,
        match=r"field 'label' is dictionary<values=string, indices=int32, ordered=0> in "
        r"'part-00000.arrow', string in 'part-00001.arrow'",
    ):
        shardcache.open(uri, cache_dir=tmp_path / "cache")
