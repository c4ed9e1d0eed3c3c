"""RFC 3339 times read in one place (`rfc3339.parse`) and written in one (`rfc3339.format`),
and status.resolvedAt read in one place (`status.resolved_at`): job pins, the pod
counts, the sidecar check and `status.build_status` use them."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
from shardcache_operator import handlers, job_pins, rfc3339, sidecar_health, skips, status

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


@pytest.mark.parametrize(
    ("when", "written"),
    [
        (datetime.datetime(2026, 11, 28, 10, 5, 7, tzinfo=UTC), "2026-11-28T10:05:07Z"),
        # Another offset is written in UTC; sub-second digits are not written.
        (
            datetime.datetime(
                2026,
                11,
                28,
                11,
                5,
                7,
                999_999,
                tzinfo=datetime.timezone(datetime.timedelta(hours=1)),
            ),
            "2026-11-28T10:05:07Z",
        ),
    ],
)
def test_a_time_is_written_in_utc_whole_seconds_and_parse_reads_it_back(
    when: datetime.datetime, written: str
) -> None:
    assert rfc3339.format(when) == written
    assert rfc3339.parse(written) == when.replace(microsecond=0)
    assert rfc3339.format(rfc3339.parse(written) or when) == written


def test_a_naive_time_is_refused_saying_what_was_expected() -> None:
    with pytest.raises(ValueError, match=r"needs an aware datetime .* got the naive"):
        rfc3339.format(datetime.datetime(2026, 11, 28, 10))


def test_the_times_the_operator_writes_now_are_what_parse_reads() -> None:
    """handlers (status times, conditions) and the sidecar check write through
    `rfc3339.now`: one format, read back by `rfc3339.parse`."""
    for text in (handlers.now_text(), rfc3339.now()):
        found = rfc3339.parse(text)
        assert found is not None
        assert rfc3339.format(found) == text
    assert skips._time(1764324000) == rfc3339.format(
        datetime.datetime.fromtimestamp(1764324000, UTC)
    )


def _kept_pin_status(resolved_at: object) -> dict[str, Any]:
    return {
        "phase": "Ready",
        "manifestDigest": "sha256:" + "ab" * 32,
        "resolvedAt": resolved_at,
        "conditions": [],
    }


def _kept_pin() -> status.Resolved:
    return status.Resolved(
        digest="sha256:" + "ab" * 32, format="parquet", shards=1, rows=1, bytes=1, reused=True
    )


def test_a_kept_pin_keeps_a_readable_resolved_at() -> None:
    built = status.build_status(
        _kept_pin(),
        previous=_kept_pin_status("2026-11-28T11:00:00+01:00"),
        generation=1,
        now="2026-11-28T12:00:00Z",
        resolved_source=None,
    )
    assert built["resolvedAt"] == "2026-11-28T11:00:00+01:00"


@pytest.mark.parametrize("stored", ["yesterday", "2026-13-40T99:00:00Z", 1764324000, None])
def test_an_unreadable_resolved_at_is_not_copied_forward(stored: object) -> None:
    """The old build_status copied status.resolvedAt as stored. A kept pin writes the
    time of this reconcile instead (job pins then call the pods created before it
    unknown: the safe side); a failure deletes it (None in the merge patch)."""
    kept = status.build_status(
        _kept_pin(),
        previous=_kept_pin_status(stored),
        generation=1,
        now="2026-11-28T12:00:00Z",
        resolved_source=None,
    )
    assert kept["resolvedAt"] == "2026-11-28T12:00:00Z"
    failed = status.build_status(
        status.Failed(status.Phase.DEGRADED, "SourceUnreachable", "down", reachable=False),
        previous=_kept_pin_status(stored),
        generation=1,
        now="2026-11-28T12:00:00Z",
        resolved_source=None,
    )
    assert "resolvedAt" in failed and failed["resolvedAt"] is None
