from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest

from shardcache import elastic, errors, plans, sequences, states
from shardcache.inspect import locate
from tests.support import sightings

pytestmark = pytest.mark.unit

ROWS = [100, 0, 37, 250, 8, 64, 1]
DIGEST = "sha256:test"


def stream(query: locate.Query) -> list[int]:
    """Reference: the rank's whole epoch as global indices, straight from the plans."""
    offsets = plans.shard_offsets(ROWS)
    runs = plans.rank_runs(ROWS, DIGEST, query.params())
    return [offsets[r.shard] + i for r in runs for i in range(r.start, r.stop)]


@pytest.mark.parametrize("world_size,rank", [(1, 0), (3, 0), (3, 2), (4, 1), (7, 6)])
@pytest.mark.parametrize("batch_size", [1, 16, 33])
def test_steps_concatenated_are_the_ranks_stream_in_batches(
    world_size: int, rank: int, batch_size: int
) -> None:
    q = locate.Query(
        epoch=1, rank=rank, world_size=world_size, batch_size=batch_size, seed=9, block_size=16
    )
    expected = stream(q)
    steps = locate.step_count(ROWS, q)
    assert steps == -(-len(expected) // batch_size)
    got: list[list[int]] = [
        [p.index for p in locate.step_rows(ROWS, DIGEST, q.replace(step=s))] for s in range(steps)
    ]
    assert [i for batch in got for i in batch] == expected
    assert all(len(b) == batch_size for b in got[:-1])
    assert 1 <= len(got[-1]) <= batch_size


def test_provenance_names_shard_row_and_position() -> None:
    q = locate.Query(world_size=2, rank=1, step=3, batch_size=10, seed=2, block_size=16)
    offsets = plans.shard_offsets(ROWS)
    for slot, p in enumerate(locate.step_rows(ROWS, DIGEST, q)):
        assert p.index == offsets[p.shard] + p.row
        assert 0 <= p.row < ROWS[p.shard]
        assert p.position == 30 + slot


def test_every_sample_is_sighted_where_its_step_holds_it() -> None:
    q = locate.Query(epoch=2, world_size=3, batch_size=7, seed=4, block_size=16)
    sightings.assert_sighted_where_their_steps_hold_them(ROWS, DIGEST, q)


def test_step_past_the_end_says_how_many_steps_there_are() -> None:
    q = locate.Query(world_size=2, rank=0, batch_size=100, step=3)
    # Rank 0 of 2 reads 230 of 460 samples: steps 0, 1, 2.
    with pytest.raises(errors.InputError, match=re.escape("expected 0 <= step < 3 (230 samples")):
        locate.step_rows(ROWS, DIGEST, q)


def test_rank_at_or_beyond_world_size_is_refused() -> None:
    with pytest.raises(errors.InputError, match=re.escape("expected 0 <= rank < world size 4")):
        locate.Query(rank=4, world_size=4)


def test_sample_index_out_of_range_is_refused() -> None:
    with pytest.raises(errors.InputError, match="the dataset has 460 samples"):
        locate.sightings(ROWS, DIGEST, locate.Query(), [460])


# --- a run's data states: elastic-resume segments and skips -----------------------

MODES = {"block": (True, plans.BLOCK), "sample": (True, plans.SAMPLE), "off": (False, plans.BLOCK)}
OLD_POSITIONS = (30, 77, 5)  # where the 3 old ranks stopped in epoch 1, then 2 resume


def resumed_run(mode: str) -> tuple[locate.Query, list[states.DataState], locate.States]:
    """Epoch 1 of a 3-rank run (rank 0 skipped 7 samples), resumed at world size 2
    (`elastic.resize`); new rank 0 then skips 2 batches of 7 at its position 14. The
    query of the new plan, the old states and the new ranks' states."""
    shuffle, granularity = MODES[mode]
    q = locate.Query(
        epoch=1, world_size=2, batch_size=7, seed=9, block_size=16, shuffle=shuffle,
        granularity=granularity, window=70,
    )  # fmt: skip
    old = []
    for rank, position in enumerate(OLD_POSITIONS):
        params = dataclasses.replace(q.params(), rank=rank, world_size=3)
        skips = (states.Skip(1, 7, 14),) if rank == 0 else ()
        old.append(states.DataState(DIGEST, params, position, batch_size=7, skips=skips))
    new = elastic.resize(old, total_rows=sum(ROWS), world_size=2)
    new[0], _ = states.skip_batches(
        dataclasses.replace(new[0], position=14), 2, batch_size=7, rank_samples=None
    )
    return q, old, {s.rank: s for s in new}


def read_stream(params: plans.PlanParams, skips: list[states.Skip]) -> list[int]:
    """Reference: the manifest indices a rank is handed in the epoch, straight from the
    plan's sequence along its segments (`plans.stream_ranges`), less its skips."""
    seq = sequences.Sequence(ROWS, DIGEST, params)
    whole = [
        i for a, b in plans.stream_ranges(seq.total, params) for i in seq.indices(a, b).tolist()
    ]
    return [i for p, i in enumerate(whole) if not states.is_skipped(skips, p)]


@pytest.mark.parametrize("mode", MODES)
def test_a_resumed_ranks_steps_are_its_segments_less_its_skips(mode: str) -> None:
    q, _, run = resumed_run(mode)
    for rank, state in run.items():
        for epoch in (1, 2):  # the resize's epoch, then rule 5 at the new world size
            rq = q.replace(rank=rank, epoch=epoch)
            params = dataclasses.replace(rq.params(), segments=state.params.segments)
            expected = read_stream(params, state.skips_in(epoch))
            steps = locate.step_count(ROWS, rq, run)
            got = [
                p.index
                for s in range(steps)
                for p in locate.step_rows(ROWS, DIGEST, rq.replace(step=s), run)
            ]
            assert got == expected, (rank, epoch)
            assert steps == -(-len(expected) // 7)
    # The resized epoch is shorter than rule 5's range, which the plan alone gives.
    assert locate.step_count(ROWS, q, run) < locate.step_count(ROWS, q)


@pytest.mark.parametrize("mode", MODES)
def test_sightings_follow_a_resumed_run_and_mark_what_the_earlier_ranks_consumed(
    mode: str,
) -> None:
    q, old, run = resumed_run(mode)
    others = sightings.assert_sighted_where_their_steps_hold_them(ROWS, DIGEST, q, run)
    before = [s for s in others if s.before_resize]
    assert len(before) == sum(OLD_POSITIONS)
    assert all((s.rank, s.step, s.slot) == (None, None, None) for s in before)
    assert len([s for s in others if s.skipped]) == 14  # new rank 0's 2 batches of 7
    # What the old ranks consumed (read or skipped) is what the new states leave out.
    consumed = {i for s in old for i in read_stream(s.params, [])[: s.position]}
    assert {s.index for s in before} == consumed
    # Epochs after the resize: every sample read by a rank of world size 2.
    assert not sightings.assert_sighted_where_their_steps_hold_them(
        ROWS, DIGEST, q.replace(epoch=2), run
    )


def test_a_rank_without_its_state_in_a_resized_epoch_is_refused() -> None:
    q, _, run = resumed_run("block")
    only_rank_0 = {0: run[0]}
    with pytest.raises(errors.InputError, match="rank 1's stream in epoch 1 is not known"):
        locate.step_rows(ROWS, DIGEST, q.replace(rank=1), only_rank_0)
    with pytest.raises(errors.InputError, match=re.escape("give rank 1's data state")):
        locate.sightings(ROWS, DIGEST, q, [0], only_rank_0)
    # Another epoch follows rule 5 whoever gave a state.
    assert locate.step_rows(ROWS, DIGEST, q.replace(rank=1, epoch=2), only_rank_0)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"world_size": 3}, "world_size: state has 2, the inspector has 3"),
        ({"seed": 8}, "seed: state has 9, the inspector has 8"),
        ({"shuffle": False}, "shuffle: state has True, the inspector has False"),
        ({"block_size": 8}, "block_size: state has 16, the inspector has 8"),
        (
            {"granularity": plans.SAMPLE},
            "granularity: state has 'block', the inspector has 'sample'",
        ),
    ],
)
def test_a_state_of_another_plan_is_named_with_both_values(
    change: dict[str, Any], named: str
) -> None:
    q, _, run = resumed_run("block")
    assert locate.state_mismatches(DIGEST, q, run[1]) == []
    assert locate.state_mismatches(DIGEST, q.replace(**change), run[1]) == [named]
    assert locate.state_mismatches("sha256:other", q, run[1]) == [
        f"digest: state has {DIGEST!r}, the inspector has 'sha256:other'"
    ]


def test_a_state_recording_another_batch_size_is_named_with_both_values() -> None:
    q, _, run = resumed_run("block")
    state = dataclasses.replace(run[1], batch_size=7)
    assert locate.state_mismatches(DIGEST, q.replace(batch_size=7), state) == []
    assert locate.state_mismatches(DIGEST, q.replace(batch_size=8), state) == [
        "batch_size: state has 7, the inspector has 8"
    ]


def test_a_rank_without_samples_is_told_so() -> None:
    # Not "expected 0 <= step < 0".
    with pytest.raises(errors.InputError, match="rank 1 is handed no samples in epoch 0"):
        locate.step_rows([0, 0], DIGEST, locate.Query(world_size=2, rank=1))
