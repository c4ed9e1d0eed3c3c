"""RFC 3339 times read in one place (`rfc3339.parse`), and status.resolvedAt read in one
place (`status.resolved_at`): job pins, the pod counts and the sidecar check use them."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
from shardcache_operator import job_pins, rfc3339, sidecar_health, status

pytestmark = pytest.mark.unit

UTC = datetime.UTC


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2026-11-28T10:00:00Z", datetime.datetime(2026, 11, 28, 10, tzinfo=UTC)),
        ("2026-11-28T11:00:00+01:00", datetime.datetime(2026, 11, 28, 10, tzinfo=UTC)),
        # No offset: taken as UTC, as the API server means it.
        ("2026-11-28T10:00:00", datetime.datetime(2026, 11, 28, 10, tzinfo=UTC)),
    ],
)
def test_an_rfc3339_time_is_read_as_an_aware_datetime(
    text: str, expected: datetime.datetime
) -> None:
    found = rfc3339.parse(text)
    assert found == expected
    assert found is not None and found.tzinfo is not None


@pytest.mark.parametrize(
    "bad", [None, "", "None", "yesterday", "2026-13-40T99:00:00Z", 1764324000, 17.5, ["x"], {}]
)
def test_what_is_not_an_rfc3339_time_reads_as_no_time(bad: object) -> None:
    assert rfc3339.parse(bad) is None


def test_a_creation_time_that_is_not_a_string_makes_the_pod_unknown_not_a_crash() -> None:
    """The old job_pins._time passed a non-string to fromisoformat: a TypeError out of
    admission instead of the pod's pin called unknown."""
    created: dict[str, Any] = {"p0": 1764324000, "p1": "2026-11-28T11:00:00Z"}
    found = job_pins.unpinned(created, "2026-11-28T10:00:00Z")
    assert found.unknown == frozenset({"p0"})
    assert found.current == frozenset({"p1"})


def test_an_unreadable_resolved_at_makes_every_pod_unknown() -> None:
    found = job_pins.unpinned({"p0": "2026-11-28T11:00:00Z"}, "not a time")
    assert found == job_pins.Unpinned(unknown=frozenset({"p0"}), resolved_at="not a time")


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({"resolvedAt": "2026-11-28T10:00:00Z"}, "2026-11-28T10:00:00Z"),
        ({"resolvedAt": 5}, None),
        ({}, None),
        (None, None),
        ("Ready", None),
    ],
)
def test_status_resolved_at_reads_a_string_or_nothing(given: object, expected: str | None) -> None:
    assert status.resolved_at(given) == expected


def test_a_sidecar_whose_start_time_is_not_a_string_has_not_settled() -> None:
    now = datetime.datetime(2026, 11, 28, 12, tzinfo=UTC)
    started = {"ready": True, "state": {"running": {"startedAt": 1764324000}}}
    assert sidecar_health._settled(started, now) is False
    long_ago = {"ready": True, "state": {"running": {"startedAt": "2026-11-28T10:00:00Z"}}}
    assert sidecar_health._settled(long_ago, now) is True
