"""Pure parts of the restorer: how files are split for parallel ranged downloads, and
how a skip request changes the restored data state."""

from __future__ import annotations

import pytest
from shardcache_sidecar.checkpoint import restorer

from shardcache import errors, states
from shardcache.checkpoint import layout

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("size", [0, 1, restorer.RANGE - 1, restorer.RANGE, 3 * restorer.RANGE + 7])
def test_ranges_cover_the_file_exactly_once_in_order(size: int) -> None:
    pieces = restorer.ranges(size)
    assert all(0 <= n <= restorer.RANGE for _, n in pieces)
    covered = 0
    for offset, length in pieces:
        assert offset == covered
        covered += length
    assert covered == size


def test_an_empty_file_is_one_empty_piece() -> None:
    assert restorer.ranges(0) == [(0, 0)]


STATE = {
    "version": 2, "plan_version": 1, "digest": "sha256:d", "seed": 0, "shuffle": True,
    "block_size": 8, "world_size": 4, "rank": 2, "epoch": 0, "position": 64,
    "batch_size": 16, "skips": [],
}  # fmt: skip


def test_a_skip_request_moves_the_restored_position_and_records_the_skip() -> None:
    request = layout.SkipRequest(step=9, batches=3)
    state, applied = restorer.apply_skip(dict(STATE), request, where="t")
    assert state is not None
    parsed = states.parse(state)
    assert parsed.position == 64 + 3 * 16
    assert parsed.skips == (states.Skip(0, 64, 112),)
    assert applied == {"epoch": 0, "start": 64, "stop": 112, "batches": 3, "rank": 2}


def test_no_request_leaves_the_state_alone() -> None:
    assert restorer.apply_skip(dict(STATE), None, where="t") == (STATE, None)


@pytest.mark.parametrize(
    "state,request_size,message",
    [
        (None, None, "has no data state"),
        ({**STATE, "batch_size": None}, None, "--batch-size B"),
    ],
)
def test_a_skip_the_state_cannot_take_fails_the_restore_with_what_to_do(
    state: dict[str, object] | None, request_size: int | None, message: str
) -> None:
    request = layout.SkipRequest(step=9, batches=3, batch_size=request_size)
    with pytest.raises(errors.InputError, match=message):
        restorer.apply_skip(state, request, where="t")


def test_a_skip_request_round_trips_and_a_bad_one_is_refused() -> None:
    request = layout.SkipRequest(step=9, batches=3, batch_size=4, requested_at=1.5, reason="r")
    assert layout.SkipRequest.from_json(request.to_json(), where="t") == request
    with pytest.raises(errors.InputError, match="batches must be an integer >= 1"):
        layout.SkipRequest.from_json({**request.to_json(), "batches": 0}, where="t")
    with pytest.raises(errors.InputError, match="version 2 is not supported"):
        layout.SkipRequest.from_json({**request.to_json(), "version": 2}, where="t")


# A rank's state after an elastic resize with drop_last, as a shardcache of 2026-11-28
# before state version 4 saved it (3cdcca0): version 3 with the segments' `least`.
RESIZED_V3 = {
    "version": 3, "plan_version": 2, "digest": "sha256:d", "seed": 3, "shuffle": True,
    "granularity": "block", "window": 65536, "block_size": 64, "world_size": 2, "rank": 0,
    "epoch": 0, "position": 150, "batch_size": 50, "skips": [],
    "segments": {"epoch": 0, "ranges": [[100, 499], [599, 799]], "least": 599},
}  # fmt: skip


@pytest.mark.parametrize(
    "saved,written",
    [
        (RESIZED_V3, 3),
        ({**RESIZED_V3, "version": 4}, 4),
        ({**RESIZED_V3, "segments": None}, 3),
        (STATE, 2),
        ({k: v for k, v in STATE.items() if k not in ("skips", "batch_size")} | {"version": 1}, 2),
    ],
)
def test_a_skip_keeps_the_version_the_trainer_saved_its_state_as(
    saved: dict[str, object], written: int
) -> None:
    """The sidecar's agent is often of a newer release than the trainer: a state it
    raised to a version the trainer does not read fails that trainer's restore (3cdcca0's
    own state came back as version 4: 'state version 4 is not supported')."""
    request = layout.SkipRequest(step=9, batches=2, batch_size=50)
    state, _ = restorer.apply_skip(dict(saved), request, where="t")
    assert state is not None
    assert state["version"] == written
    parsed, before = states.parse(state), states.parse(saved)
    assert parsed.position == before.position + 100
    assert parsed.params.segments == before.params.segments
