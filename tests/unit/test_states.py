"""The data state dict: versions, skips, and the agent's skip cut at the epoch's end."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import pytest

from shardcache import errors, plans, states, streams

pytestmark = pytest.mark.unit


def state(**changes: object) -> dict[str, object]:
    base: dict[str, object] = {
        "version": 3, "plan_version": 2, "digest": "sha256:d", "seed": 0, "shuffle": True,
        "granularity": "block", "window": 65536, "block_size": 8, "world_size": 2, "rank": 1,
        "epoch": 1, "position": 40,
        "batch_size": 8, "skips": [{"epoch": 1, "start": 8, "stop": 16}],
        "segments": {"epoch": 1, "ranges": [[0, 30], [50, 60]]},
    }  # fmt: skip
    base.update(changes)
    return base


def test_a_state_round_trips_and_older_versions_read_without_what_they_lack() -> None:
    parsed = states.parse(state())
    assert parsed.to_json() == state()
    assert parsed.params.segments is not None and len(parsed.params.segments) == 40
    v2 = states.parse({**state(segments=None), "version": 2})
    assert v2.params.segments is None and v2.skips == parsed.skips
    old = {k: v for k, v in state().items() if k not in ("batch_size", "skips")}
    old["version"] = 1
    v1 = states.parse(old)
    assert (v1.skips, v1.batch_size, v1.position) == ((), None, 40)


def test_a_state_is_written_as_version_4_only_when_its_segments_carry_least() -> None:
    """Version 4 is version 3 with `least`: a shardcache that reads 3 only refuses it by
    number instead of ending drop_last batches at the rank's own rows (a rank with one
    batch more than its peers waits in a collective they never join)."""
    with_least = {"epoch": 1, "ranges": [[0, 30], [50, 60]], "least": 39}
    # Written by the clients between `least` and version 4: read, and saved again as 4.
    v3_least = states.parse(state(segments=with_least))
    assert v3_least.params.segments is not None and v3_least.params.segments.least == 39
    assert v3_least.to_json() == state(version=4, segments=with_least)
    assert states.parse(state(version=4, segments=with_least)) == v3_least
    # Nothing that needs 4: still 3, so an older shardcache keeps loading it.
    assert states.parse(state()).to_json()["version"] == 3
    assert states.parse(state(segments=None)).to_json()["version"] == 3
    assert states.parse(state(version=4)).to_json()["version"] == 3
    with pytest.raises(errors.StateMismatchError, match=r"state version 5 is not supported: "
                       r"expected one of \[1, 2, 3, 4\]"):  # fmt: skip
        states.parse(state(version=5))


def test_a_plan_version_1_state_reads_as_block_mode_and_resumes_a_block_mode_dataset() -> None:
    old = {k: v for k, v in state().items() if k not in ("granularity", "window")}
    old["plan_version"] = 1
    v1 = states.parse(old)
    assert (v1.plan_version, v1.params.granularity, v1.params.sampled) == (1, "block", False)
    block = states.DataState("sha256:d", v1.params, 0)
    assert states.mismatches(v1, block) == []
    sample = states.DataState(
        "sha256:d", plans.PlanParams(**{**v1.params.__dict__, "granularity": "sample"}), 0
    )
    assert states.mismatches(v1, sample) == [
        "granularity: state has 'block', this dataset has 'sample'"
    ]
    # A window of the sample-mode dataset's own is not named against one the state
    # never had (it saved none: block mode).
    windowed = states.DataState("sha256:d", dataclasses.replace(sample.params, window=128), 0)
    assert states.mismatches(v1, windowed) == [
        "granularity: state has 'block', this dataset has 'sample'"
    ]


def test_a_sample_mode_state_carries_its_window_and_a_different_window_is_refused() -> None:
    saved = states.parse(state(granularity="sample", window=64))
    assert saved.params.sampled and saved.to_json()["window"] == 64
    other = states.DataState(
        "sha256:d", plans.PlanParams(**{**saved.params.__dict__, "window": 128}), 0
    )
    assert states.mismatches(saved, other) == ["window: state has 64, this dataset has 128"]


def test_an_unknown_plan_version_or_granularity_is_refused() -> None:
    with pytest.raises(errors.StateMismatchError, match="plan version 3 is not supported"):
        states.parse(state(plan_version=3))
    with pytest.raises(errors.StateMismatchError, match="granularity must be one of"):
        states.parse(state(granularity="row"))


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"version": 5}, "state version 5 is not supported"),
        ({"segments": {"epoch": 1, "ranges": [[5, 5]]}}, "0 <= a < b"),
        ({"segments": {"epoch": 1, "ranges": [[9, 12], [0, 3]]}}, "increasing order"),
        ({"segments": [[0, 3]]}, "expected"),
        ({"position": -1}, "position must be an integer >= 0"),
        ({"rank": 2}, "rank must be in"),
        ({"skips": [{"epoch": 1, "start": 5, "stop": 5}]}, "must end after it starts"),
        ({"skips": "x"}, "skips must be a list"),
        ({"batch_size": 0}, "batch_size must be an integer >= 1"),
    ],
)
def test_a_bad_state_is_refused_with_what_is_wrong(
    changes: dict[str, object], message: str
) -> None:
    with pytest.raises(errors.StateMismatchError, match=message):
        states.parse(state(**changes))


def test_skips_are_sorted_and_adjacent_ranges_merged() -> None:
    merged = states.normalise(
        [
            states.Skip(1, 16, 24),
            states.Skip(0, 4, 8),
            states.Skip(1, 8, 16),
            states.Skip(1, 30, 32),
        ]
    )
    assert merged == (states.Skip(0, 4, 8), states.Skip(1, 8, 24), states.Skip(1, 30, 32))


def test_skip_batches_moves_the_position_and_records_the_range() -> None:
    new, skip = states.skip_batches(states.parse(state()), 3, batch_size=None, rank_samples=100)
    assert skip == states.Skip(1, 40, 64)
    assert new.position == 64 and new.skips[-1] == skip
    cut, skip = states.skip_batches(states.parse(state()), 30, batch_size=None, rank_samples=50)
    assert skip == states.Skip(1, 40, 50) and cut.position == 50


def test_skip_batches_takes_numpy_counts_as_ints_and_refuses_other_types() -> None:
    import numpy as np

    two: Any = np.int64(2)
    four: Any = np.int32(4)
    new, skip = states.skip_batches(states.parse(state()), two, batch_size=four, rank_samples=100)
    assert skip == states.Skip(1, 40, 48)
    assert json.loads(json.dumps(new.to_json()))["batch_size"] == 4
    assert type(new.position) is int and type(new.batch_size) is int
    with pytest.raises(
        errors.InputError, match=re.escape("batch_size: expected an int >= 1, found float 2.5")
    ):
        states.skip_batches(states.parse(state()), 1, batch_size=2.5, rank_samples=100)  # type: ignore[arg-type]
    with pytest.raises(
        errors.InputError, match=re.escape("batches: expected an int >= 1, found bool True")
    ):
        states.skip_batches(states.parse(state()), True, batch_size=None, rank_samples=100)


def test_a_skip_past_the_end_that_the_agent_applied_is_cut_when_loaded() -> None:
    applied, _ = states.skip_batches(states.parse(state()), 100, batch_size=None, rank_samples=None)
    assert applied.position == 840
    loaded = states.clamp(applied, 50)
    assert loaded.position == 50 and loaded.skips[-1] == states.Skip(1, 40, 50)
    at_end = states.clamp(states.parse(state(position=50, skips=[])), 50)
    assert at_end.position == 50
    # A position past the end that no skip explains is left for the loader to refuse.
    assert states.clamp(states.parse(state(position=60, skips=[])), 50).position == 60


def test_steps_count_only_batches_handed_out() -> None:
    skips = [states.Skip(0, 16, 40)]
    assert states.step_of(skips, 15, 8) == 1
    assert states.step_of(skips, 40, 8) == 2
    assert states.kept(skips, 0, 48) == [(0, 16), (40, 48)]
    assert states.positions_of(skips, 48, 12, 8) == [(12, 16), (40, 44)]


def test_plan_params_come_back_as_saved() -> None:
    parsed = states.parse(state(seed=7, shuffle=False))
    assert parsed.params == plans.PlanParams(
        seed=7, epoch=1, rank=1, world_size=2, shuffle=False, block_size=8,
        segments=streams.Segments(1, ((0, 30), (50, 60))),
    )  # fmt: skip


def test_a_mixtures_state_is_named_and_points_at_its_sources_states() -> None:
    mixed: dict[str, Any] = {"version": 1, "kind": "mixture", "seed": 0, "step": 6, "batch_size": 4,
             "weights": [[0, {"a": 1.0, "b": 1.0}]], "sources": {"b": state(), "a": state()}}  # fmt: skip
    with pytest.raises(errors.StateMismatchError) as info:
        states.parse(mixed, where="--data-state m.json")
    message = str(info.value)
    assert message.startswith("--data-state m.json: this is a mixture's state")
    assert "sources ['a', 'b']" in message and "state['sources']['a']" in message
    assert "lacks" not in message
    # What it points at is a state the tools read.
    assert states.parse(mixed["sources"]["a"]).position == 40


def test_a_state_lacking_keys_names_each_once() -> None:
    with pytest.raises(errors.StateMismatchError) as info:
        states.parse({"version": 3}, where="s.json")
    missing = re.search(r"lacks (\[.*\])", str(info.value))
    assert missing is not None
    names = json.loads(missing.group(1).replace("'", '"'))
    assert len(names) == len(set(names)) and "digest" in names and "seed" in names


def test_a_bad_segments_field_is_prefixed_with_where_once() -> None:
    with pytest.raises(errors.StateMismatchError) as info:
        states.parse(state(segments={"epoch": 1, "ranges": "bad"}), where="--data-state s.json")
    assert str(info.value) == ("--data-state s.json: segments: ranges must be a list, found 'bad'")
