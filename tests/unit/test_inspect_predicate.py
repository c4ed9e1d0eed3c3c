from __future__ import annotations

import re

import pyarrow as pa
import pytest

from shardcache import errors
from shardcache.inspect import predicate

pytestmark = pytest.mark.unit

BATCH = pa.RecordBatch.from_pydict(
    {
        "uid": [1, 2, 3, 4, None],
        "lang": ["en", "de", "en", None, "fr"],
        "score": [0.5, 1.5, 2.5, 3.5, 4.5],
        "ok": [True, False, True, True, False],
    }
)


@pytest.mark.parametrize(
    "expr,rows",
    [
        ("uid == 3", [2]),
        ("uid != 3", [0, 1, 3]),
        ("uid >= 2 and uid < 4", [1, 2]),
        ("lang == 'en'", [0, 2]),
        ('lang == "de"', [1]),
        ("score > 2", [2, 3, 4]),
        ("score <= 1.5", [0, 1]),
        ("ok == true", [0, 2, 3]),
        ("`uid` == 1", [0]),
        ("lang == 'en' and uid > 1", [2]),
    ],
)
def test_expression_selects_the_matching_rows(expr: str, rows: list[int]) -> None:
    assert list(predicate.matching_rows(predicate.parse(expr), BATCH)) == rows


def test_null_never_matches() -> None:
    assert list(predicate.matching_rows(predicate.parse("uid != 99"), BATCH)) == [0, 1, 2, 3]


def test_quoted_text_keeps_escaped_quotes() -> None:
    assert predicate.parse(r"name == 'it\'s'").terms[0].value == "it's"


@pytest.mark.parametrize(
    "expr,message",
    [
        ("uid = 3", "cannot parse"),
        ("uid ==", "incomplete"),
        ("uid == 3 or uid == 4", "expected `and`"),
        ("uid == lang", "expected a literal"),
        ("3 == uid", "expected a column name"),
        ("", "empty"),
        ("__import__('os') == 1", "cannot parse"),
    ],
)
def test_malformed_expression_says_what_was_expected(expr: str, message: str) -> None:
    with pytest.raises(errors.InputError, match=message):
        predicate.parse(expr)


def test_unknown_column_names_the_columns_there_are() -> None:
    with pytest.raises(errors.InputError, match=r"unknown column\(s\) \['nope'\]"):
        predicate.check(predicate.parse("nope == 1"), BATCH.schema)


def test_literal_of_the_wrong_kind_is_an_input_error() -> None:
    with pytest.raises(errors.InputError, match="cannot compare column 'uid'"):
        predicate.mask(predicate.parse("uid == 'x'"), BATCH)


IDS = pa.RecordBatch.from_pydict(
    {
        "id": pa.array([1, 2**63 + 5, 2**64 - 1], pa.uint64()),
        "n": pa.array([1, 2, 3], pa.int64()),
        "small": pa.array([1, 2, 3], pa.uint8()),
    }
)


@pytest.mark.parametrize(
    "expr,rows",
    [
        ("id == 18446744073709551615", [2]),
        ("id == 9223372036854775813", [1]),
        ("id > 9223372036854775807", [1, 2]),
        ("small == 3", [2]),
    ],
)
def test_uint64_ids_above_2_63_are_searchable(expr: str, rows: list[int]) -> None:
    assert predicate.matching_rows(predicate.parse(expr), IDS) == rows


@pytest.mark.parametrize(
    "expr,named",
    [
        (
            "n == 99999999999999999999",
            "99999999999999999999 is out of range for column 'n' (int64)",
        ),
        (
            "small == 300",
            "300 is out of range for column 'small' (uint8): expected an integer from 0 to 255",
        ),
        ("id == -1", "-1 is out of range for column 'id' (uint64)"),
    ],
)
def test_a_literal_out_of_the_columns_range_is_an_input_error(expr: str, named: str) -> None:
    with pytest.raises(errors.InputError, match=re.escape(named)):
        predicate.matching_rows(predicate.parse(expr), IDS)
