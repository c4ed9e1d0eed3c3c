"""`History.skips` (what `reads_json`'s `run.skips` lists) read the first generation
only: after an elastic resize the new world size's ranks' skips were missing. Now every
generation's, each entry naming its generation, so rank 1 of world size 4 and rank 1 of
world size 3 are not conflated."""

from __future__ import annotations

import dataclasses

import pytest

from shardcache import elastic, plans, states
from shardcache.lineage import history, queries

pytestmark = pytest.mark.unit

TOTAL = 120


def state(position: int, *skips: states.Skip, rank: int, world: int) -> states.DataState:
    return states.DataState(
        digest="sha256:x",
        params=plans.PlanParams(
            seed=0, epoch=0, rank=rank, world_size=world, shuffle=False, block_size=8
        ),
        position=position,
        batch_size=4,
        skips=skips,
    )


def four_to_three() -> tuple[history.History, states.Skip, states.Skip]:
    """World size 4 reads 10 positions of epoch 0 a rank (old rank 1 skipping [2, 4))
    and publishes step 1; world size 3 resumes from step 1, new rank 1 skips [4, 8) of
    its segments, and every new rank publishes step 2 at position 12."""
    old_skip, new_skip = states.Skip(0, 2, 4), states.Skip(0, 4, 8)
    old = {
        r: [history.Checkpoint(1, state(10, *([old_skip] if r == 1 else []), rank=r, world=4))]
        for r in range(4)
    }
    resumed = elastic.resize([c[-1].state for c in old.values()], total_rows=TOTAL, world_size=3)
    chains = {r: list(c) for r, c in old.items()}
    for r, s in enumerate(resumed):
        skips = (new_skip,) if r == 1 else ()
        at_2 = dataclasses.replace(s, position=12, skips=skips)
        chains[r].append(history.Checkpoint(2, at_2))
    return history.build("sha256:x", [TOTAL], chains), old_skip, new_skip


def test_reads_json_run_skips_include_a_new_generations_skip_with_its_generation() -> None:
    hist, old_skip, new_skip = four_to_three()
    assert [g.world_size for g in hist.generations] == [4, 3]
    run = queries.reads_json(hist, "", [], False, [])["run"]
    assert run["skips"] == {
        "0": [],
        "1": [
            {**old_skip.to_json(), "pass_index": 0, "generation": 0},
            {**new_skip.to_json(), "pass_index": 0, "generation": 1},
        ],
        "2": [],
        "3": [],
    }


def test_history_skips_of_a_generation_are_that_generations_ranks() -> None:
    hist, old_skip, new_skip = four_to_three()
    # The first generation's by default: what `shardcache diff` and older callers take.
    assert hist.skips(1) == ((0, old_skip),)
    assert hist.skips(1, generation=1) == ((0, new_skip),)
    assert hist.skips(0, generation=1) == ()
    assert hist.every_skip() == [(0, 1, 0, old_skip), (1, 1, 0, new_skip)]
