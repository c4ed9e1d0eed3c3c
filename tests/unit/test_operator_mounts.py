"""The webhook's DatasetMounts from memory: kopf's index first, a read once, parsed specs."""

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


def test_the_index_answers_and_supersedes_an_earlier_read() -> None:
    store = mounts.Store()
    read, watched = dsm(), {**dsm(), "status": {"phase": "Degraded"}}
    assert store.lookup({}, "ml", "data", now=0) is None
    store.remember(read, now=0)
    assert store.lookup({}, "ml", "data", now=1) is read
    index = {("ml", "data"): [watched]}
    assert store.lookup(index, "ml", "data", now=2) is watched
    # Once the index had it, the read is gone: a deletion seen by the watch is final.
    assert store.lookup({}, "ml", "data", now=3) is None


def test_a_read_is_served_only_until_its_time_to_live() -> None:
    store = mounts.Store()
    store.remember(dsm(), now=100)
    assert store.lookup({}, "ml", "data", now=100 + mounts.READ_TTL_SECONDS - 1) is not None
    assert store.lookup({}, "ml", "data", now=100 + mounts.READ_TTL_SECONDS + 1) is None


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
