"""The operator's pod index: which mounts unfinished pods use, and when counts change."""

from __future__ import annotations

from typing import Any

import pytest
from shardcache_operator import metrics, pod_watch

pytestmark = pytest.mark.unit


def pod(name: str, mount: str | None, phase: str = "Running") -> dict[str, Any]:
    labels = {"shardcache.io/mount": mount} if mount else {}
    return {
        "metadata": {"name": name, "namespace": "ml", "labels": labels},
        "status": {"phase": phase},
    }


def watcher() -> tuple[pod_watch.Watcher, list[int]]:
    woken: list[int] = []
    return pod_watch.Watcher(pod_watch.Index(), metrics.Metrics(), lambda: woken.append(1)), woken


def test_pods_are_counted_until_they_finish_or_go() -> None:
    watch, woken = watcher()
    watch.apply("ADDED", pod("a", "data", "Pending"))
    watch.apply("ADDED", pod("b", "data_extra"))
    assert watch.index.count("ml", "data") == 2 and watch.index.count("ml", "extra") == 1
    watch.apply("MODIFIED", pod("a", "data", "Running"))  # same mounts: nothing to write
    assert len(woken) == 2
    watch.apply("MODIFIED", pod("a", "data", "Succeeded"))
    watch.apply("MODIFIED", pod("b", "data_extra", "Failed"))
    assert watch.index.count("ml", "data") == 0 and dict(watch.index) == {}
    watch.apply("ADDED", pod("c", "data"))
    watch.apply("DELETED", pod("c", "data"))
    assert watch.index.count("ml", "data") == 0 and len(woken) == 6


def test_a_malformed_label_is_no_mount_and_unlabelled_pods_are_counted_apart() -> None:
    watch, _ = watcher()
    watch.apply("ADDED", pod("a", "Not_A_Name"))
    watch.apply("ADDED", pod("b", None))
    assert dict(watch.index) == {}
    sample = watch._meters.registry.get_sample_value
    assert sample("shardcache_operator_pod_events_total", {"opted_in": "true"}) == 1
    assert sample("shardcache_operator_pod_events_total", {"opted_in": "false"}) == 1


def test_a_fresh_list_replaces_the_index_exactly() -> None:
    index = pod_watch.Index()
    index.set("ml", "old", ("data",))
    index.set("ml", "kept", ("data",))
    assert index.replace({("ml", "kept"): ("data",), ("ml", "new"): ("other",)})
    assert index.count("ml", "data") == 1 and index.count("ml", "other") == 1
    assert not index.replace({("ml", "kept"): ("data",), ("ml", "new"): ("other",)})
