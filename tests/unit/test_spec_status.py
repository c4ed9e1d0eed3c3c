"""DatasetMount status: phases, conditions and their transition times (pure builders)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from shardcache_operator import reconcile, status

pytestmark = pytest.mark.unit

T0 = "2026-01-01T00:00:00Z"
T1 = "2026-01-01T01:00:00Z"
DIGEST = "sha256:" + "cd" * 32
RESOLVED = status.Resolved(digest=DIGEST, format="parquet", shards=12, rows=1200, bytes=3 * 2**30)
SOURCE = {"uri": "s3://b/p/", "format": "parquet"}


def by_type(st: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in st["conditions"]}


def test_resolved_status_carries_digest_counts_and_three_true_conditions() -> None:
    st = status.build_status(RESOLVED, previous={}, generation=3, now=T0, resolved_source=SOURCE)
    assert st["phase"] == "Ready"
    assert (st["manifestDigest"], st["shards"], st["rows"]) == (DIGEST, 12, 1200)
    assert st["size"] == "3Gi"
    assert st["observedGeneration"] == 3
    conditions = by_type(st)
    assert list(conditions) == ["SourceReachable", "ManifestResolved", "Ready"]
    for condition in conditions.values():
        assert condition["status"] == "True"
        assert condition["reason"] and condition["message"]
        assert condition["lastTransitionTime"] == T0
        assert condition["observedGeneration"] == 3
    assert DIGEST in conditions["ManifestResolved"]["message"]


def test_transition_time_moves_only_when_a_condition_status_changes() -> None:
    ready = status.build_status(RESOLVED, previous={}, generation=1, now=T0, resolved_source=SOURCE)
    again = status.build_status(
        RESOLVED, previous=ready, generation=2, now=T1, resolved_source=SOURCE
    )
    assert all(c["lastTransitionTime"] == T0 for c in again["conditions"])
    failed = status.Failed(
        status.Phase.DEGRADED, "SourceUnreachable", "connection refused", reachable=False
    )
    degraded = status.build_status(
        failed, previous=again, generation=2, now=T1, resolved_source=SOURCE
    )
    assert {c["type"]: c["lastTransitionTime"] for c in degraded["conditions"]} == {
        "SourceReachable": T1,
        "ManifestResolved": T1,
        "Ready": T1,
    }


def test_failure_keeps_the_previous_pin_and_attached_pods() -> None:
    ready = status.build_status(RESOLVED, previous={}, generation=1, now=T0, resolved_source=SOURCE)
    ready["attachedPods"] = 4
    failed = status.Failed(status.Phase.DEGRADED, "SourceUnreachable", "timed out", reachable=False)
    degraded = status.build_status(
        failed, previous=ready, generation=1, now=T1, resolved_source=SOURCE
    )
    assert degraded["phase"] == "Degraded"
    assert degraded["manifestDigest"] == DIGEST
    assert degraded["attachedPods"] == 4
    conditions = by_type(degraded)
    assert conditions["SourceReachable"]["status"] == "False"
    assert conditions["Ready"]["reason"] == "SourceUnreachable"
    assert conditions["Ready"]["message"] == "timed out"


def test_invalid_spec_leaves_source_reachability_unknown() -> None:
    failed = status.Failed(
        status.Phase.INVALID, "InvalidSpec", "spec.source.uri: ...", reachable=None
    )
    st = status.build_status(failed, previous={}, generation=1, now=T0, resolved_source=None)
    assert st["phase"] == "Invalid"
    assert by_type(st)["SourceReachable"]["status"] == "Unknown"
    assert "manifestDigest" not in st


def test_a_resolved_status_without_a_mixture_deletes_the_stored_pins() -> None:
    pins = [{"name": "code", "manifestDigest": DIGEST, "shards": 1, "rows": 1, "bytes": 1}]
    mixed = status.build_status(
        RESOLVED, previous={}, generation=1, now=T0, resolved_source=SOURCE, mixture=pins
    )
    single = status.build_status(
        RESOLVED, previous=mixed, generation=2, now=T1, resolved_source=SOURCE
    )
    # None, not left out: the handlers' merge patch keeps a key it does not name.
    assert "mixture" in single and single["mixture"] is None
    never = status.build_status(RESOLVED, previous={}, generation=1, now=T0, resolved_source=SOURCE)
    assert "mixture" not in never


def test_status_schema_lists_every_key_the_builder_writes() -> None:
    ready = status.build_status(RESOLVED, previous={}, generation=1, now=T0, resolved_source=SOURCE)
    ready["attachedPods"] = 0
    properties = status.schema()["properties"]
    assert set(ready) <= set(properties)
    condition_keys = set(properties["conditions"]["items"]["properties"])
    assert all(set(c) <= condition_keys for c in ready["conditions"])


def test_backoff_doubles_and_is_capped() -> None:
    backoff = reconcile.Backoff(initial_seconds=2, max_seconds=30)
    assert [backoff.delay(r) for r in range(6)] == [2, 4, 8, 16, 30, 30]


def test_events_are_posted_on_changes_not_on_repeated_failures() -> None:
    failed = status.Failed(status.Phase.DEGRADED, "SourceUnreachable", "refused", reachable=False)
    first = status.build_status(failed, previous={}, generation=1, now=T0, resolved_source=None)
    assert reconcile._events(failed, {}) == (
        reconcile.Event("Warning", "SourceUnreachable", "refused"),
    )
    assert reconcile._events(failed, first) == ()
    (event,) = reconcile._events(RESOLVED, first)
    assert (event.type, event.reason) == ("Normal", "ManifestPinned")


def test_failed_reachability_check_keeps_manifest_resolved() -> None:
    ready = status.build_status(RESOLVED, previous={}, generation=1, now=T0, resolved_source=SOURCE)
    failed = status.Failed(
        status.Phase.DEGRADED, "SourceUnreachable", "refused", reachable=False, keeps_pin=True
    )
    degraded = status.build_status(
        failed, previous=ready, generation=1, now=T1, resolved_source=SOURCE
    )
    conditions = by_type(degraded)
    assert conditions["ManifestResolved"] == by_type(ready)["ManifestResolved"]
    assert conditions["Ready"]["status"] == "False"
    assert conditions["Ready"]["lastTransitionTime"] == T1
    assert degraded["manifestDigest"] == DIGEST


def test_failure_flags_must_be_named_at_the_call_site() -> None:
    with pytest.raises(TypeError):
        status.Failed(status.Phase.DEGRADED, "SourceGone", "gone", True, True)  # type: ignore[misc]


def test_phases_keep_their_wire_strings_and_status_holds_plain_strings() -> None:
    assert [p.value for p in status.Phase] == [
        "Pending",
        "Ready",
        "Degraded",
        "Invalid",
        "Terminating",
    ]
    assert status.schema()["properties"]["phase"]["enum"] == [p.value for p in status.Phase]
    failed = status.Failed(status.Phase.DEGRADED, "SourceUnreachable", "refused", reachable=False)
    for outcome in (RESOLVED, failed):
        st = status.build_status(outcome, previous={}, generation=1, now=T0, resolved_source=None)
        # Plain str, not the enum: the status is also written as YAML (safe_dump).
        assert type(st["phase"]) is str
        assert yaml.safe_load(yaml.safe_dump(st)) == st
