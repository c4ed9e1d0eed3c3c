"""`make bench-operator`'s arithmetic: histogram quantiles between scrapes, percentiles."""

from __future__ import annotations

import math

import pytest

from bench import operator_probes as probes

pytestmark = pytest.mark.unit


def test_a_quantile_counts_only_what_was_observed_between_the_scrapes() -> None:
    before = {0.005: 10.0, 0.025: 10.0, 0.1: 10.0, math.inf: 10.0}
    # 100 new calls: 50 under 5 ms, 50 between 25 and 100 ms.
    after = {0.005: 60.0, 0.025: 60.0, 0.1: 110.0, math.inf: 110.0}
    assert probes.histogram_quantile(0.5, before, after) == pytest.approx(0.005)
    # The 99th call of 100 lies 48/50 of the way through the 25-100 ms bucket.
    assert probes.histogram_quantile(0.99, before, after) == pytest.approx(0.025 + 0.075 * 0.98)
    assert math.isnan(probes.histogram_quantile(0.5, after, after))


def test_nearest_rank_percentiles() -> None:
    values = [float(v) for v in range(1, 101)]
    assert probes.percentile(values, 50) == 50
    assert probes.percentile(values, 99) == 99
    assert probes.percentile([7.0], 99) == 7
