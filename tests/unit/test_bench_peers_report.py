"""The RESULT line's arithmetic: which rows it compares, and when it says FAILED."""

from __future__ import annotations

from typing import Any

import pytest

from bench.peers import report

pytestmark = pytest.mark.unit


def _row(loader: str, family: str, warm_tps: float, status: str = "ok") -> dict[str, Any]:
    return {"loader": loader, "family": family, "warm_tps": warm_tps, "status": status}


def test_result_divides_the_fastest_sidecar_row_by_each_peers_fastest_variant() -> None:
    rows = [
        _row("shardcache-sidecar", "shardcache", 1000.0),
        _row("shardcache-sidecar-disk", "shardcache", 1500.0),
        _row("shardcache-embedded", "shardcache", 9000.0),  # not a sidecar row
        _row("mosaic", "mosaic", 5.0),
        _row("mosaic-dataloader", "mosaic", 15.0),
        _row("litdata", "litdata", 150.0),
        _row("pyarrow", "pyarrow", 120.0),
    ]
    assert report.ratios(rows) == {"mosaic": "100.00", "litdata": "10.00", "pyarrow": "12.50"}
    assert report.result_line(rows) == "RESULT vs_mosaic=100.00 vs_litdata=10.00 vs_pyarrow=12.50"


def test_a_sidecar_row_that_was_not_exact_fails_every_ratio_even_if_another_is_fast() -> None:
    rows = [
        _row("shardcache-sidecar", "shardcache", 0.0, status="FAILED"),
        _row("shardcache-sidecar-disk", "shardcache", 1500.0),
        _row("pyarrow", "pyarrow", 120.0),
    ]
    assert report.ratios(rows) == {"mosaic": "n/a", "litdata": "n/a", "pyarrow": "FAILED"}


def test_a_peer_whose_every_variant_failed_is_failed_and_one_not_run_is_na() -> None:
    rows = [
        _row("shardcache-sidecar", "shardcache", 1500.0),
        _row("litdata", "litdata", 0.0, status="FAILED"),
        _row("litdata-dataloader", "litdata", 0.0, status="FAILED"),
    ]
    assert report.ratios(rows) == {"mosaic": "n/a", "litdata": "FAILED", "pyarrow": "n/a"}


def test_the_docs_name_the_rows_the_result_divided() -> None:
    rows = [
        _row("shardcache-sidecar", "shardcache", 1.0e9),
        _row("shardcache-sidecar-disk", "shardcache", 1.5e9),
        _row("mosaic", "mosaic", 5.0e6),
        _row("mosaic-dataloader", "mosaic", 15.0e6),
        _row("pyarrow", "pyarrow", 120.0e6),
    ]
    assert report.result_basis(rows) == (
        "shardcache's figure is `shardcache-sidecar-disk` (1,500.0 M tokens/s warm), the "
        "faster sidecar row; the peers' are `mosaic-dataloader`, `pyarrow`."
    )
