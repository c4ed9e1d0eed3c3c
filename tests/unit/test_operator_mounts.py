"""The webhook's DatasetMounts from memory: its own watch first, a read once, parsed specs."""

from __future__ import annotations

from typing import Any

import pytest
from shardcache_operator import mounts

from shardcache import errors

pytestmark = pytest.mark.unit


def dsm(
    name: str = "data", *, uid: str = "u-1", generation: int = 1, **spec: Any
) -> dict[str, Any]:
    return {
        "apiVersion": "shardcache.io/v1alpha1",
        "kind": "DatasetMount",
        "metadata": {"name": name, "namespace": "ml", "uid": uid, "generation": generation},
        "spec": {"source": {"uri": "s3://bucket/data/"}, **spec},
        "status": {"phase": "Ready"},
    }


def test_the_watch_answers_and_supersedes_an_earlier_read() -> None:
    store = mounts.Store()
    store.listed([])
    read, watched = dsm(), {**dsm(), "status": {"phase": "Degraded"}}
    assert store.lookup("ml", "data", now=0) is None
    store.remember(read, now=0)
    assert store.lookup("ml", "data", now=1) is read
    store.seen("ADDED", watched)
    assert store.lookup("ml", "data", now=2) is watched
    # Once the watch had it, the read is gone: a deletion seen by the watch is final.
    store.seen("DELETED", watched)
    assert store.lookup("ml", "data", now=3) is None


def test_a_read_is_served_only_until_its_time_to_live() -> None:
    store = mounts.Store()
    store.remember(dsm(), now=100)
    assert store.lookup("ml", "data", now=100 + mounts.READ_TTL_SECONDS - 1) is not None
    assert store.lookup("ml", "data", now=100 + mounts.READ_TTL_SECONDS + 1) is None


def test_kopfs_index_never_answers_an_admission() -> None:
    # kopf freezes its index while peering pauses the replica (node tier, s18): a
    # replica that led, then was outranked, served the old digest and URI from it.
    store = mounts.Store()
    store.index = {("ml", "data"): [dsm(uid="u-old")]}
    assert store.lookup("ml", "data", now=0) is None  # not watched: read the API
    store.listed([dsm(uid="u-new")])
    found = store.lookup("ml", "data", now=1)
    assert found is not None and found["metadata"]["uid"] == "u-new"


def test_an_edit_is_served_from_the_next_watch_event() -> None:
    store = mounts.Store()
    store.listed([dsm()])
    edited = dsm(generation=2)
    edited["spec"]["source"]["uri"] = "s3://bucket/other/"
    store.seen("MODIFIED", edited)
    found = store.lookup("ml", "data", now=0)
    assert found is not None and found["spec"]["source"]["uri"] == "s3://bucket/other/"


def test_a_mount_deleted_and_created_again_is_served_as_created() -> None:
    store = mounts.Store()
    store.listed([dsm(uid="u-1")])
    store.seen("DELETED", dsm(uid="u-1"))
    assert store.lookup("ml", "data", now=0) is None
    store.seen("ADDED", dsm(uid="u-2"))
    found = store.lookup("ml", "data", now=1)
    assert found is not None and found["metadata"]["uid"] == "u-2"


def test_a_relist_drops_mounts_deleted_while_the_watch_was_down() -> None:
    store = mounts.Store()
    store.listed([dsm("gone"), dsm("kept")])
    store.lost()
    store.listed([dsm("kept")])
    assert store.lookup("ml", "gone", now=0) is None
    assert store.lookup("ml", "kept", now=0) is not None


def test_nothing_watched_is_served_before_the_first_list_or_while_the_watch_is_down() -> None:
    store = mounts.Store()
    store.seen("ADDED", dsm())  # an event before any LIST: not a complete view yet
    assert store.lookup("ml", "data", now=0) is None
    store.listed([dsm()])
    assert store.lookup("ml", "data", now=0) is not None
    store.lost()
    assert store.lookup("ml", "data", now=0) is None  # the API is read instead
    store.remember(dsm(generation=2), now=0)
    found = store.lookup("ml", "data", now=1)
    assert found is not None and found["metadata"]["generation"] == 2


def test_a_spec_is_parsed_once_per_uid_and_generation() -> None:
    store = mounts.Store()
    first = store.load(dsm(), known=1)
    status_changed = {**dsm(), "status": {"phase": "Degraded", "attachedPods": 3}}
    again = store.load(status_changed, known=1)
    assert store.parses == 1
    assert again.spec is first.spec and again.phase == "Degraded"
    store.load(dsm(generation=2, prefetch={"depth": 4}), known=1)
    store.load(dsm(uid="u-2"), known=1)  # deleted and created again under the same name
    assert store.parses == 3


def test_an_invalid_spec_is_refused_every_time_from_one_parse() -> None:
    store = mounts.Store()
    bad = dsm(cache={"memory": "-1Gi"})
    for _ in range(2):
        with pytest.raises(errors.InputError, match=r"spec\.cache\.memory"):
            store.load(bad, known=1)
    assert store.parses == 1


def test_the_spec_cache_stays_bounded_by_the_mounts_known() -> None:
    store = mounts.Store()
    for i in range(100):
        store.load(dsm(f"m{i}", uid=f"u{i}"), known=2)
    assert len(store._parsed) <= 2 * 2 + 16
