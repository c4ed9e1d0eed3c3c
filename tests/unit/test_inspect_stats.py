from __future__ import annotations

import pyarrow as pa
import pytest

from shardcache.inspect import stats

pytestmark = pytest.mark.unit


def test_histogram_counts_every_value_once_in_its_bin() -> None:
    values = [3, 3, 4, 10, 25, 25, 25]
    h = stats.histogram(values, bins=4)
    assert sum(h["counts"]) == len(values)
    assert h["edges"][0] == 3
    assert h["edges"][-1] > 25
    for v in values:
        i = max(i for i, e in enumerate(h["edges"][:-1]) if e <= v)
        assert h["counts"][i] > 0


def test_histogram_of_equal_values_is_one_bar() -> None:
    assert stats.histogram([7, 7, 7]) == {"edges": [7, 8], "counts": [3]}


def test_column_stats_cover_numbers_text_and_token_lengths() -> None:
    table = pa.table(
        {
            "uid": pa.array([1, 2, None, 4], pa.int64()),
            "text": ["a", "bbb", None, "cc"],
            "tokens": pa.array([[1], [1, 2, 3], [], None], pa.list_(pa.int32())),
        }
    )
    got = {c["name"]: c for c in stats.column_stats(table)["columns"]}
    assert got["uid"]["nulls"] == 1
    assert got["uid"]["values"] == {"min": 1, "max": 4, "mean": pytest.approx(7 / 3, abs=1e-3)}
    assert got["text"]["length_chars"] == {"min": 1, "max": 3, "mean": 2.0}
    assert got["tokens"]["tokens"] is True
    assert got["tokens"]["length_items"]["max"] == 3
    assert sum(got["tokens"]["histogram"]["counts"]) == 3
