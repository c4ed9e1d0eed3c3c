"""The RESULT line's arithmetic: which rows it compares, and when it says FAILED."""

from __future__ import annotations

from typing import Any

import pytest

from bench.peers import report, runner

pytestmark = pytest.mark.unit


def _row(loader: str, family: str, warm_tps: float, status: str = "ok") -> dict[str, Any]:
    return {"loader": loader, "family": family, "warm_tps": warm_tps, "status": status}


def test_result_divides_the_sample_mode_sidecar_row_by_each_peers_fastest_variant() -> None:
    rows = [
        _row("shardcache-sidecar-sample", "shardcache", 1500.0),
        _row("shardcache-sidecar", "shardcache", 4000.0),  # block mode: not like with like
        _row("shardcache-sidecar-disk", "shardcache", 5000.0),
        _row("shardcache-embedded-sample", "shardcache", 9000.0),  # not a sidecar row
        _row("mosaic", "mosaic", 5.0),
        _row("mosaic-dataloader", "mosaic", 15.0),
        _row("litdata", "litdata", 150.0),
        _row("pyarrow", "pyarrow", 120.0),
    ]
    assert report.ratios(rows) == {"mosaic": "100.00", "litdata": "10.00", "pyarrow": "12.50"}
    assert report.result_line(rows) == "RESULT vs_mosaic=100.00 vs_litdata=10.00 vs_pyarrow=12.50"


def test_a_sample_sidecar_row_that_was_not_exact_fails_every_ratio_even_if_block_is_fast() -> None:
    rows = [
        _row("shardcache-sidecar-sample", "shardcache", 0.0, status="FAILED"),
        _row("shardcache-sidecar-disk", "shardcache", 1500.0),
        _row("pyarrow", "pyarrow", 120.0),
    ]
    assert report.ratios(rows) == {"mosaic": "n/a", "litdata": "n/a", "pyarrow": "FAILED"}


def test_a_peer_whose_every_variant_failed_is_failed_and_one_not_run_is_na() -> None:
    rows = [
        _row("shardcache-sidecar-sample", "shardcache", 1500.0),
        _row("litdata", "litdata", 0.0, status="FAILED"),
        _row("litdata-dataloader", "litdata", 0.0, status="FAILED"),
    ]
    assert report.ratios(rows) == {"mosaic": "n/a", "litdata": "FAILED", "pyarrow": "n/a"}


def test_the_docs_name_the_rows_the_result_divided() -> None:
    rows = [
        _row("shardcache-sidecar-sample", "shardcache", 1.0e9),
        _row("shardcache-sidecar", "shardcache", 1.5e9),
        _row("shardcache-sidecar-disk", "shardcache", 2.0e9),
        _row("mosaic", "mosaic", 5.0e6),
        _row("mosaic-dataloader", "mosaic", 15.0e6),
        _row("pyarrow", "pyarrow", 120.0e6),
    ]
    assert report.result_basis(rows) == (
        "shardcache's figure is `shardcache-sidecar-sample` (1,000.0 M tokens/s warm), "
        "per-sample shuffle through the sidecar; the peers' are their fastest "
        "per-sample-shuffle variants: `mosaic-dataloader`, `pyarrow` (pyarrow shuffles "
        "only the file order, so its row is coarser than ours). Sample mode delivered "
        "0.50x the warm tokens/s of block mode (`shardcache-sidecar-disk`) in this run."
    )


def test_the_table_names_each_rows_shuffle_granularity() -> None:
    rows = [_row("shardcache-sidecar-sample", "shardcache", 1.0e9), _row("pyarrow", "pyarrow", 1.0)]
    for r in rows:
        r.update(cold_tps=1.0, cold_ttfb_ms=1.0, warm_ttfb_ms=1.0, resume_ms=None)
    table = report.table_rows(rows)
    assert [line[:2] for line in table] == [
        ("shardcache-sidecar-sample", "sample (65,536-row windows)"),
        ("pyarrow", "file (row order kept)"),
    ]


EXPECTED = {"samples": 10, "tokens": 100, "token_sum": 5000, "digest": 77}


def _pass(seconds: float, **tally: int) -> dict[str, Any]:
    return {"seconds": seconds, "ttfb_s": 0.01, "tally": {**EXPECTED, **tally}}


def _raw(warm: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "loader": "litdata",
        "settings": "",
        "setup_s": 0.0,
        "cold": _pass(2.0),
        "warm_passes": warm,
        "warm": runner.median_pass(warm),
        "resume": {"supported": False},
    }


def test_the_warm_figure_is_the_median_pass_of_several() -> None:
    warm = [_pass(0.5), _pass(0.2), _pass(0.4)]
    assert runner.median_pass(warm) is warm[2]
    assert runner.median_pass(warm[:2]) is warm[1]  # an even count: the lower middle
    row = report.judge(_raw(warm), EXPECTED, "litdata")
    assert row["status"] == "ok" and row["warm_tps"] == pytest.approx(100 / 0.4)


def test_a_wrong_warm_pass_fails_the_loader_though_its_time_is_not_the_one_reported() -> None:
    warm = [_pass(0.3), _pass(0.1, samples=9), _pass(0.2)]
    row = report.judge(_raw(warm), EXPECTED, "litdata")
    assert row["status"] == "FAILED"
    assert row["failure"] == "warm pass 2 of 3: samples: expected 10, got 9"
