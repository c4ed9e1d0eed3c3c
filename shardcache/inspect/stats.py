"""Column statistics and length histograms over the first rows of a dataset.

Computed with pyarrow.compute over whole columns. Statistics over a huge dataset would
read all of it, so callers pass a row budget and the result says how many rows it saw.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.types as pat

from shardcache.inspect import render

#: Bars of a length histogram: enough to see the shape, few enough to read.
HISTOGRAM_BINS = 20


def histogram(values: Sequence[int], bins: int = HISTOGRAM_BINS) -> dict[str, list[int]]:
    """Integer-width bins from min to max: `edges[i]` is bin i's first value, and the
    last edge is one past the largest value."""
    if not values:
        return {"edges": [], "counts": []}
    lo, hi = min(values), max(values)
    width = max(1, -(-(hi - lo + 1) // bins))
    count = -(-(hi - lo + 1) // width)
    counts = [0] * count
    for v in values:
        counts[(v - lo) // width] += 1
    return {"edges": [lo + i * width for i in range(count + 1)], "counts": counts}


def _summary(lengths: pa.ChunkedArray) -> dict[str, Any]:
    lengths = lengths.drop_null()
    if len(lengths) == 0:
        return {"min": None, "max": None, "mean": None}
    mm = pc.min_max(lengths).as_py()
    out = {"min": mm["min"], "max": mm["max"], "mean": round(pc.mean(lengths).as_py(), 3)}
    if render.exact(mm["min"]) is not None or render.exact(mm["max"]) is not None:
        # A page's JSON numbers are doubles: 64-bit ids need their exact text.
        out["display"] = f"{mm['min']} / {out['mean']} / {mm['max']}"
    return out


def column_stats(table: pa.Table) -> dict[str, Any]:
    """Per-column statistics of `table`: nulls; min/max/mean of numbers; length
    summaries of text, binary and lists; a length histogram of list columns (the
    token-length histogram of token-id columns)."""
    columns: list[dict[str, Any]] = []
    for field in table.schema:
        col = table.column(field.name)
        entry: dict[str, Any] = {
            "name": field.name,
            "type": str(field.type),
            "nulls": col.null_count,
        }
        t = field.type
        if pat.is_integer(t) or pat.is_floating(t):
            entry["values"] = _summary(col)
        elif pat.is_string(t) or pat.is_large_string(t):
            entry["length_chars"] = _summary(pc.utf8_length(col))
        elif pat.is_binary(t) or pat.is_large_binary(t):
            entry["length_bytes"] = _summary(pc.binary_length(col))
        elif pat.is_list(t) or pat.is_large_list(t) or pat.is_fixed_size_list(t):
            lengths = pc.list_value_length(col)
            entry["length_items"] = _summary(lengths)
            entry["tokens"] = pat.is_integer(t.value_type)
            entry["histogram"] = histogram(lengths.drop_null().to_pylist())
        columns.append(entry)
    return {"rows": table.num_rows, "columns": columns}
