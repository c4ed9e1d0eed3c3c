"""The bucket layout of checkpoints: names, manifest, pointer, retention plan (pure)."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from shardcache_sidecar.checkpoint import siblings

from shardcache import errors
from shardcache.checkpoint import layout
from shardcache.lineage import published

pytestmark = pytest.mark.unit


def manifest(step: int = 42) -> layout.CheckpointManifest:
    return layout.CheckpointManifest(
        step=step,
        name=f"step-{step}",
        files=(
            layout.FileEntry("model.pt", 1000, "a" * 64),
            layout.FileEntry("optim/rank0.pt", 10, "b" * 64),
        ),
        data_state={"position": 7, "epoch": 1},
        created_at=1700000000.5,
    )


def test_step_directories_sort_in_step_order_and_parse_back() -> None:
    names = [layout.step_dir("b/run", s).rsplit("/", 1)[1] for s in (9, 10, 100, 2)]
    assert sorted(names) == [names[3], names[0], names[1], names[2]]
    assert [layout.parse_step_dir(n) for n in names] == [9, 10, 100, 2]
    assert layout.parse_step_dir("latest") is None
    assert layout.parse_step_dir("step-x") is None


@pytest.mark.parametrize("name", ["step-1\n", "step-000000000001\n", "step-\u0661", "xstep-1"])
def test_names_that_only_look_like_step_directories_are_no_step(name: str) -> None:
    assert layout.parse_step_dir(name) is None


def test_object_names_follow_the_documented_layout() -> None:
    assert layout.manifest_path("b/run", 42) == "b/run/step-000000000042/checkpoint.json"
    assert layout.data_path("b/run", 42, "optim/x.pt") == "b/run/step-000000000042/data/optim/x.pt"
    assert layout.pointer_path("b/run") == "b/run/latest"


def test_manifest_round_trips_with_version_and_digest() -> None:
    doc = manifest().to_json()
    assert doc["version"] == layout.LAYOUT_VERSION
    assert doc["total_bytes"] == 1010
    assert doc["digest"].startswith("sha256:")
    assert layout.CheckpointManifest.from_json(copy.deepcopy(doc), where="t") == manifest()


def test_an_altered_manifest_is_detected() -> None:
    doc = manifest().to_json()
    doc["files"][0]["sha256"] = "c" * 64
    with pytest.raises(layout.CorruptCheckpointError, match="does not match its digest"):
        layout.CheckpointManifest.from_json(doc, where="t")


def test_another_layout_version_is_refused_with_both_versions_named() -> None:
    doc = manifest().to_json()
    doc["version"] = 2
    with pytest.raises(errors.InputError, match=r"version 2 .*expected 1"):
        layout.CheckpointManifest.from_json(doc, where="t")


@pytest.mark.parametrize("bad", ["../etc/passwd", "/abs", "a//b", "a/./b"])
def test_file_paths_cannot_escape_the_checkpoint(bad: str) -> None:
    m = layout.CheckpointManifest(1, "s", (layout.FileEntry(bad, 1, "a" * 64),), None, 0.0)
    with pytest.raises(layout.CorruptCheckpointError, match="escapes"):
        layout.CheckpointManifest.from_json(m.to_json(), where="t")


def test_pointer_names_a_step_and_unknown_versions_are_ignored() -> None:
    assert layout.parse_pointer(layout.pointer_json(manifest(5))) == 5
    assert layout.parse_pointer({"version": 99, "step": 5}) is None
    assert layout.parse_pointer(None) is None
    assert layout.parse_pointer({"version": 1, "step": -1}) is None


def test_retention_keeps_the_newest_n_and_only_old_unfinished_uploads_go() -> None:
    dropped, orphans = layout.retention_plan([10, 30, 20, 40], [5, 25, 50], keep_last=2)
    assert dropped == [10, 20]
    # 25 and 5 are older than every kept step: dead uploads. 50 may be in flight.
    assert orphans == [5, 25]


def test_retention_with_fewer_checkpoints_than_n_deletes_nothing() -> None:
    assert layout.retention_plan([1], [2], keep_last=3) == ([], [])
    assert layout.retention_plan([], [1, 2], keep_last=3) == ([], [])


def test_retention_needs_at_least_one_kept() -> None:
    with pytest.raises(errors.InputError, match=">= 1"):
        layout.retention_plan([1, 2], [], keep_last=0)


def test_only_rank_directories_named_exactly_rank_n_are_ranks(tmp_path: Path) -> None:
    for name in ("rank-0", "rank-1", "rank-2\n", "rank-\u0663", "rank-4x"):
        (tmp_path / name).mkdir()
    prefixes = published.rank_prefixes(pafs.LocalFileSystem(), str(tmp_path))
    assert list(prefixes) == [0, 1]
    assert siblings.base_of("b/run/rank-3") == "b/run"
    assert siblings.base_of("b/run/rank-3\n") is None
    assert siblings.base_of("b/run/rank-\u0663") is None


def test_empty_directories_round_trip_in_the_manifest_of_layout_1_1() -> None:
    m = dataclasses.replace(manifest(), dirs=("optim/empty", "shards/rank-3"))
    doc = m.to_json()
    assert (doc["version"], doc["minor"]) == (1, layout.LAYOUT_MINOR) == (1, 1)
    assert doc["dirs"] == ["optim/empty", "shards/rank-3"]
    assert layout.CheckpointManifest.from_json(copy.deepcopy(doc), where="t") == m


def test_a_manifest_of_layout_1_0_without_minor_or_dirs_is_still_read() -> None:
    body = {k: v for k, v in manifest().to_json().items() if k not in ("minor", "dirs", "digest")}
    old = {**body, "digest": layout._digest(body)}
    assert layout.CheckpointManifest.from_json(old, where="t") == manifest()


def test_a_later_minor_is_read_and_its_unknown_fields_ignored() -> None:
    body = {**manifest().to_json(), "minor": 7, "tags": ["future"]}
    del body["digest"]
    doc = {**body, "digest": layout._digest(body)}
    assert layout.CheckpointManifest.from_json(doc, where="t") == manifest()


def test_the_same_files_with_other_empty_directories_are_the_same_checkpoint() -> None:
    # A step published by a layout-1.0 agent, uploaded again after an upgrade.
    assert dataclasses.replace(manifest(), dirs=("empty",)).same_content(manifest())
