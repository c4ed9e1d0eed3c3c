"""The chart's dashboard is generated (helm/monitoring/dashboard.py), never hand-edited."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.unit

GENERATOR = Path(__file__).resolve().parents[2] / "helm" / "monitoring" / "dashboard.py"


def load_generator() -> ModuleType:
    # A script beside the chart, not a package of the distribution.
    spec = importlib.util.spec_from_file_location("shardcache_dashboard", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_the_committed_dashboard_json_is_what_the_generator_writes() -> None:
    generator = load_generator()
    assert generator.OUTPUT.read_text() == generator.render(), (
        "helm/shardcache/dashboards/shardcache.json differs: run "
        "python helm/monitoring/dashboard.py"
    )
    assert generator.main(["--check"]) == 0


def test_every_panel_has_one_query_and_a_place_of_its_own() -> None:
    board = json.loads(load_generator().render())
    places = set()
    for panel in board["panels"]:
        assert [t["expr"] for t in panel["targets"]], panel["title"]
        grid = panel["gridPos"]
        places.add((grid["x"], grid["y"]))
    assert len(places) == len(board["panels"])
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])


def test_memory_volume_cycles_have_a_panel_beside_the_memory_tier_panels() -> None:
    # ShardcacheMemoryVolumeCycle alerts on this counter; the dashboard showed nothing
    # of it, so an alert's "why" had no graph next to the memory tier's.
    board = json.loads(load_generator().render())
    by_title = {p["title"]: p for p in board["panels"]}
    (cycles,) = [
        p
        for p in board["panels"]
        if "shardcache_memory_volume_cycles_total" in p["targets"][0]["expr"]
    ]
    assert 'namespace=~"$namespace"' in cycles["targets"][0]["expr"]
    assert "ShardcacheMemoryVolumeCycle" in cycles["description"]
    windows = by_title["Sample windows / memory tier limit"]["gridPos"]
    resident = by_title["Cache resident bytes by tier"]["gridPos"]
    place = cycles["gridPos"]
    assert place["y"] == windows["y"] and place["x"] == windows["x"] + windows["w"]
    assert place["x"] == resident["x"] and place["y"] == resident["y"] + resident["h"]
