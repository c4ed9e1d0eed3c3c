"""A run resized to more ranks (elastic resume, 2 -> 3) at another batch size: what
the lineage answers (`reads_json`, which the web inspector's lineage links read) say of
each generation. `reads_json` gave one batch size, the first generation's rank 0's, and
`run.skips` had entries only for the first generation's rank numbers; `History.chains`,
`last` and `batch_size` were the first generation's, whatever the step.

And the default view of an epoch read again (`History.newest_states` without a pass):
each rank's newest state, so a rank whose newest checkpoint was still in an earlier pass
showed that pass's skips beside the other ranks' newest pass."""

from __future__ import annotations

import dataclasses

import pytest

from shardcache import elastic, plans, states
from shardcache.lineage import history, queries

pytestmark = pytest.mark.unit

TOTAL = 120
OLD_BATCH, NEW_BATCH = 6, 4


def state(
    position: int, *skips: states.Skip, rank: int, world: int, batch: int
) -> states.DataState:
    return states.DataState(
        digest="sha256:x",
        params=plans.PlanParams(
            seed=0, epoch=0, rank=rank, world_size=world, shuffle=False, block_size=8
        ),
        position=position,
        batch_size=batch,
        skips=skips,
    )


def two_to_three() -> history.History:
    """World size 2 reads 2 batches of 6 a rank and publishes step 2; world size 3
    resumes from it and reads 2 batches of 4 a rank, new rank 2 skipping nothing, and
    publishes step 4."""
    old = {
        r: [history.Checkpoint(2, state(12, rank=r, world=2, batch=OLD_BATCH))] for r in range(2)
    }
    resumed = elastic.resize([c[-1].state for c in old.values()], total_rows=TOTAL, world_size=3)
    chains = {r: list(c) for r, c in old.items()}
    for r, s in enumerate(resumed):
        at_4 = dataclasses.replace(s, position=8, batch_size=NEW_BATCH)
        chains.setdefault(r, []).append(history.Checkpoint(4, at_4))
    return history.build("sha256:x", [TOTAL], chains)


def test_reads_json_gives_each_generation_its_own_batch_size() -> None:
    hist = two_to_three()
    run = queries.reads_json(hist, "", [], False, [])["run"]
    assert [(g["world_size"], g["batch_size"]) for g in run["generations"]] == [
        (2, OLD_BATCH),
        (3, NEW_BATCH),
    ]
    # `run`'s own plan and batch size stay the first generation's.
    assert (run["world_size"], run["batch_size"]) == (2, OLD_BATCH)


def test_a_later_generations_read_counts_its_steps_at_that_generations_batch_size() -> None:
    hist = two_to_three()
    found = [r for r in queries.reads(hist, range(TOTAL)) if r.generation == 1]
    read = [r for r in found if r.status == "read" and r.rank == 2]
    # 8 positions read at batch size 4: steps 0 and 1 (at 6 they would be 0 and 1 too,
    # but slots 0-5 and 0-1).
    assert {(r.step, r.slot) for r in read} == {(n // NEW_BATCH, n % NEW_BATCH) for n in range(8)}


def test_reads_json_run_skips_have_an_entry_for_a_rank_only_a_later_generation_has() -> None:
    run = queries.reads_json(two_to_three(), "", [], False, [])["run"]
    assert run["skips"] == {"0": [], "1": [], "2": []}


def test_generation_last_and_batch_size_are_that_generations_ranks() -> None:
    hist = two_to_three()
    old, new = hist.generations
    assert (old.batch_size(0), new.batch_size(0), new.batch_size(2)) == (
        OLD_BATCH,
        NEW_BATCH,
        NEW_BATCH,
    )
    # Rank 2 exists only at world size 3; before its first checkpoint it recorded none.
    assert (old.batch_size(2), new.batch_size(2, before=3)) == (None, None)
    last = new.last(2)
    assert last is not None and (last.world_size, last.position) == (3, 8)
    assert old.last(2) is None


def second_pass_by_one_rank() -> tuple[history.History, states.Skip, states.Skip]:
    """World size 2 over 100 rows (50 a rank): both ranks read epoch 0 to position 30,
    skipping [10, 20), and publish step 1; rank 0 then reads to the epoch's end and
    again from its start to position 10, skipping [0, 5) in that second pass, and
    publishes step 2, which rank 1 has not published yet."""
    first, second = states.Skip(0, 10, 20), states.Skip(0, 0, 5)
    chains = {
        r: [history.Checkpoint(1, state(30, first, rank=r, world=2, batch=5))] for r in range(2)
    }
    chains[0].append(history.Checkpoint(2, state(10, second, rank=0, world=2, batch=5)))
    return history.build("sha256:x", [100], chains), first, second


def test_newest_states_default_shows_the_newest_pass_for_a_rank_still_in_an_earlier_one() -> None:
    hist, first, second = second_pass_by_one_rank()
    view = hist.params
    shown = hist.newest_states(view, 0)
    assert hist.pass_note(view, 0, None).endswith("showing pass 2 (--pass / pass= selects another)")
    assert shown[0].skips == (second,)
    # Rank 1 has not begun pass 2: it skipped nothing in it yet (as --pass 2 shows),
    # not its pass-1 skip of [10, 20).
    assert shown[1].skips == ()
    assert shown == hist.newest_states(view, 0, pass_index=1)
    assert hist.newest_states(view, 0, pass_index=0)[1].skips == (first,)
