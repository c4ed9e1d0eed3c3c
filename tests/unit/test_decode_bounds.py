"""Bounds on what a shard decodes to, known before (Parquet) or while (JSON Lines) it is
decoded: the sizes the node cache refuses hostile shards by (docs/security.md)."""

from __future__ import annotations

import decimal
import io
import json
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardcache import errors, formats
from shardcache.formats import budgets, jsonl, parquet


def _parquet(table: pa.Table) -> pa.BufferReader:
    out = io.BytesIO()
    pq.write_table(table, out, compression="zstd", store_schema=False)
    return pa.BufferReader(out.getvalue())


def _repeated(value: str, rows: int, per_row: int) -> pa.Array:
    values = pa.DictionaryArray.from_arrays(
        pa.array(np.zeros(rows * per_row, dtype=np.int32)), pa.array([value])
    )
    offsets = pa.array(np.arange(0, rows * per_row + 1, per_row, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, values)


SHAPES = {
    "flat": pa.table({"x": np.arange(10_000), "s": ["abc" * 10] * 10_000}),
    "lists of lists of strings": pa.table({"l": [[["a", "b"], []], None, [["c"]]] * 500}),
    "structs with strings": pa.table({"s": [{"x": 1, "y": "q" * 50}, None] * 1000}),
    "maps": pa.table({"m": pa.array([[("k", 1)]] * 1000, pa.map_(pa.string(), pa.int64()))}),
    "decimals": pa.table({"d": pa.array([decimal.Decimal("1.5")] * 1000, pa.decimal128(5, 1))}),
    # A few KB each; what the footer's page sizes alone cannot see.
    "a million empty lists": pa.table({"l": pa.array([[]] * 1_000_000, pa.list_(pa.int64()))}),
    "a list of one dictionary string repeated": pa.table({"l": _repeated("y" * 600, 100, 1000)}),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_parquet_decoded_size_never_undercounts_nested_columns(shape: str) -> None:
    source = _parquet(SHAPES[shape])
    bound = parquet.decoded_size(source, limit=1 << 40)
    source.seek(0)
    actual = parquet.read(source).combine_chunks().nbytes
    assert actual <= bound <= 4 * actual + 4096, (actual, bound)


def test_parquet_decoded_size_stops_at_the_limit_from_the_footer() -> None:
    source = _parquet(SHAPES["a million empty lists"])
    # The offsets alone (4 MB) are over: known from num_values, nothing is read.
    assert parquet.decoded_size(source, limit=1 << 20) > 1 << 20


def _jsonl(lines: list[object]) -> pa.BufferReader:
    return pa.BufferReader("".join(json.dumps(line) + "\n" for line in lines).encode())


def test_jsonl_read_types_pieces_as_inspect_does() -> None:
    lines: list[object] = [{"a": None, "b": i} for i in range(20_000)] + [{"a": "x", "b": 1}]
    rows, schema = jsonl.inspect(_jsonl(lines))
    table = jsonl.read(_jsonl(lines))
    assert table.num_rows == rows == 20_001
    assert table.schema == schema
    assert table.column("a").type == pa.string()


def test_jsonl_read_stops_once_its_byte_budget_is_spent() -> None:
    lines = [{"a": [0] * 10_000} for _ in range(400)]  # ~8 MB of text, ~32 MB decoded
    with pytest.raises(budgets.OverBudget) as caught:
        jsonl.read(_jsonl(lines), budget=budgets.Budget(bytes=4 << 20))
    assert caught.value.what == budgets.BYTES
    assert caught.value.limit == 4 << 20
    # Stopped within a piece of the budget: it never decoded the whole file.
    assert 4 << 20 < caught.value.found < (4 << 20) + 8 * jsonl.INSPECT_CHUNK
    assert "expected at most 4194304" in str(caught.value)


def test_jsonl_read_stops_at_more_rows_than_pinned() -> None:
    with pytest.raises(budgets.OverBudget, match="over 3 rows, expected at most 2"):
        jsonl.read(_jsonl([{"a": 1}] * 3), budget=budgets.Budget(rows=2))


def test_jsonl_line_longer_than_the_limit_is_refused_naming_both_lengths() -> None:
    text = b'{"a": "' + b"x" * (jsonl.MAX_LINE + 1) + b'"}\n'
    with pytest.raises(budgets.OverBudget, match=f"expected lines of at most {jsonl.MAX_LINE}"):
        jsonl.inspect(pa.BufferReader(text))


def _wide_then_empty(empty_lines: int) -> pa.BufferReader:
    """One line of 1,000 keys, then empty objects: a few bytes a line of text, but 8 KB a
    row once every row has a slot for every field."""
    first = json.dumps({f"c{i}": 1 for i in range(1000)}) + "\n"
    return pa.BufferReader((first + "{}\n" * empty_lines).encode())


def test_jsonl_rows_of_fields_named_elsewhere_are_bounded_before_they_are_allocated() -> None:
    # 80,000 empty rows beside 1,000 fields: 640 MB as one parse; in bounded parts here.
    rows, schema = jsonl.inspect(_wide_then_empty(80_000))
    assert rows == 80_001 and len(schema) == 1000
    with pytest.raises(budgets.OverBudget) as caught:
        jsonl.read(_wide_then_empty(80_000), budget=budgets.Budget(bytes=64 << 20))
    # Refused from the sizes of the null columns the concatenation would fill in.
    assert caught.value.what == budgets.BYTES and caught.value.found > 600_000_000


def test_jsonl_with_more_distinct_fields_than_the_limit_is_refused() -> None:
    text = "".join(json.dumps({f"k{i}": 1}) + "\n" for i in range(jsonl.MAX_FIELDS + 1))
    with pytest.raises(budgets.OverBudget, match=f"expected at most {jsonl.MAX_FIELDS}"):
        jsonl.inspect(pa.BufferReader(text.encode()))


def test_jsonl_nested_deeper_than_the_limit_is_refused_before_pyarrow_parses_it() -> None:
    # 20,000 levels crash pyarrow's parser (SIGSEGV): the process would die, not fail.
    deep = 20_000
    text = ('{"a": ' + "[" * deep + "]" * deep + "}\n").encode()
    with pytest.raises(budgets.OverBudget, match=f"expected at most {jsonl.MAX_DEPTH}"):
        jsonl.inspect(pa.BufferReader(text))
    with pytest.raises(budgets.OverBudget, match="levels deep"):
        jsonl.read(pa.BufferReader(text))


def test_jsonl_brackets_inside_strings_are_not_nesting() -> None:
    text = ('{"a": "' + "[" * (2 * jsonl.MAX_DEPTH) + '\\"{"}\n').encode()
    rows, schema = jsonl.inspect(pa.BufferReader(text))
    assert rows == 1 and schema.field("a").type == pa.string()


@pytest.mark.parametrize(
    "columns",
    [["user.name"], ["user.name", "user"]],
    ids=["dotted", "dotted beside a struct of that path"],
)
def test_parquet_decoded_size_counts_dictionary_columns_with_a_dot_in_their_name(
    columns: list[str],
) -> None:
    # Flattened JSON names columns "user.name": its leaf's path names no top-level
    # "user", or one that is another column (a struct "user" with a field "name").
    values = {"user.name": ["x" * 1000] * 20_000, "user": [{"name": "y" * 1000}] * 20_000}
    source = _parquet(pa.table({name: values[name] for name in columns}))
    bound = parquet.decoded_size(source, limit=1 << 40)
    source.seek(0)
    assert bound >= parquet.read(source).combine_chunks().nbytes > 20_000_000 * len(columns)


def test_jsonl_text_that_looks_like_times_in_one_piece_stays_text_across_pieces() -> None:
    # The first piece alone is typed timestamp; the whole file, as pyarrow reads it
    # in one parse, is text: the pieces are typed (and the first parsed again) as such.
    looks = [{"d": "2020-01-01T00:00:00", "s": {"e": "2021-02-03"}}] * 3000
    text = [{"d": "not a date", "s": {"e": "later"}}] * 10
    rows, schema = jsonl.inspect(_jsonl([*looks, *text]))
    table = jsonl.read(_jsonl([*looks, *text]))
    assert rows == table.num_rows == 3010
    assert table.schema == schema
    assert schema.field("d").type == pa.string()
    assert schema.field("s").type == pa.struct([("e", pa.string())])
    assert table.column("d").to_pylist() == ["2020-01-01T00:00:00"] * 3000 + ["not a date"] * 10
    assert table.column("s").to_pylist()[0] == {"e": "2021-02-03"}


def test_jsonl_lines_without_keys_keep_their_rows() -> None:
    text = pa.BufferReader(b"{}\n{}\n{}\n")
    assert jsonl.inspect(text) == (3, pa.schema([]))
    text.seek(0)
    assert jsonl.read(text).num_rows == 3
    text.seek(0)
    assert formats.decode("jsonl", text).batch.num_rows == 3


@pytest.mark.parametrize("read", [jsonl.inspect, jsonl.read])
def test_jsonl_that_is_not_utf8_is_refused_naming_the_byte_and_line(
    read: Callable[[pa.NativeFile], object],
) -> None:
    text = b'{"text": "fine"}\n' * 20_000 + b'{"text": "caf\xe9 latin-1"}\n'
    with pytest.raises(errors.InputError, match=r"invalid UTF-8 at byte 340013 \(line 20001\)"):
        read(pa.BufferReader(text))
