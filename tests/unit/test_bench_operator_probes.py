"""`make bench-operator`'s arithmetic: histogram quantiles between scrapes, percentiles."""

from __future__ import annotations

import math
import pathlib
import subprocess
import time

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


def test_pod_requests_are_counted_by_verb_and_subresource_for_pods_only() -> None:
    def sample(value: float, **labels: str) -> tuple[str, tuple[tuple[str, str], ...], float]:
        return ("apiserver_request_total", tuple(sorted(labels.items())), value)

    scrape = probes.Scrape(
        (
            sample(3, verb="POST", resource="pods", code="201"),
            sample(1, verb="POST", resource="pods", code="500"),
            sample(5, verb="PATCH", resource="pods", subresource="status", code="200"),
            sample(9, verb="POST", resource="configmaps", code="201"),
            ("apiserver_request_duration_seconds_count", (("resource", "pods"),), 7.0),
        )
    )
    assert probes.pod_requests(scrape) == {"post": 4.0, "patch status": 5.0}


def test_control_plane_cpu_counts_only_the_named_cluster_s_processes(
    tmp_path: pathlib.Path,
) -> None:
    # A script named like a control-plane binary: its process's comm is "etcd" and its
    # command line names tmp_path, as a cluster's etcd names its data directory.
    fake = tmp_path / "etcd"
    fake.write_text("#!/bin/sh\nwhile :; do :; done\n")
    fake.chmod(0o755)
    busy = subprocess.Popen([str(fake)])
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            found = probes.control_plane_cpu(tmp_path)
            if found.get("etcd", 0.0) > 0:
                break
            time.sleep(0.05)
        assert set(found) == {"etcd"} and found["etcd"] > 0
        # Another cluster's directory: the same process is not counted.
        assert probes.control_plane_cpu(tmp_path / "other") == {}
    finally:
        busy.kill()
        busy.wait()
