"""An epoch read twice (a second pass from its start, `shardcache.lineage.history`):
the run's skips, and a resize in the later pass, per pass.

`History.skips` (what `reads_json`'s `run.skips` and `shardcache diff` take) was the
newest checkpoint's, which a later pass over an epoch has dropped the earlier pass's
skips of that epoch from; and in the epoch of an elastic resize the old generation was
taken to have stopped at its position in the later pass in every pass, so the rows its
first pass read past that position were said to be the new ranks' (and in pass 1)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pyarrow.fs as pafs
import pytest

import shardcache.numpy
from shardcache import cli, elastic, plans, states
from shardcache.checkpoint import layout
from shardcache.lineage import history, queries
from tests.support import datasets

pytestmark = pytest.mark.unit


def state(
    epoch: int, position: int, *skips: states.Skip, rank: int = 0, world: int = 1
) -> states.DataState:
    return states.DataState(
        digest="sha256:x",
        params=plans.PlanParams(
            seed=0, epoch=epoch, rank=rank, world_size=world, shuffle=False, block_size=8
        ),
        position=position,
        batch_size=10,
        skips=skips,
    )


def test_history_skips_keep_an_earlier_passs_skips_with_their_pass() -> None:
    first, second = states.Skip(0, 10, 30), states.Skip(0, 40, 50)
    chains = {
        0: [
            history.Checkpoint(1, state(0, 30, first)),
            history.Checkpoint(2, state(0, 50, second)),  # the second pass, at its end
        ]
    }
    hist = history.build("sha256:x", [50], chains)
    assert hist.skips(0) == ((0, first), (1, second))
    run = queries.reads_json(hist, "", [], False, [])["run"]
    assert run["skips"] == {
        "0": [
            {**first.to_json(), "pass_index": 0, "generation": 0},
            {**second.to_json(), "pass_index": 1, "generation": 0},
        ]
    }


def test_a_resize_in_a_second_pass_leaves_the_first_pass_to_the_old_ranks() -> None:
    """World size 2 reads epoch 0 (100 rows, 50 a rank) to position 30, then (a second
    pass) to position 10, and resizes to 1 there; the new rank reads 20 of its segments."""
    old = {
        r: [
            history.Checkpoint(1, state(0, 30, rank=r, world=2)),
            history.Checkpoint(2, state(0, 10, rank=r, world=2)),
        ]
        for r in (0, 1)
    }
    [new] = elastic.resize([c[-1].state for c in old.values()], total_rows=100, world_size=1)
    chains = {**old}
    chains[0] = [*old[0], history.Checkpoint(3, dataclasses.replace(new, position=20))]
    hist = history.build("sha256:x", [100], chains)

    got = queries.reads(hist, range(100))
    first = {r.index: (r.generation, r.status, r.after, r.before) for r in got if r.pass_index == 0}
    # The first pass is the old ranks': every row read, before step 1 or between 1 and 2.
    assert first == {
        i: (0, "read", None if i % 50 < 30 else 1, 1 if i % 50 < 30 else 2) for i in range(100)
    }
    later = {r.index: (r.generation, r.status) for r in got if r.pass_index == 1}
    assert len(later) == 100 and len([r for r in got if r.pass_index > 1]) == 0
    # The second pass: the old ranks' first 10 rows each, then the new rank's segments.
    assert {i for i, v in later.items() if v == (0, "read")} == {*range(10), *range(50, 60)}
    segs = [i for lo, hi in new.params.segments.ranges for i in range(lo, hi)]  # type: ignore[union-attr]
    assert {i for i, v in later.items() if v == (1, "read")} == set(segs[:20])
    assert {i for i, v in later.items() if v == (1, "pending")} == set(segs[20:])
    g0, g1 = hist.generations
    assert (g0.ended, g0.ended_pass, g1.first_pass) == ({0: (0, 10), 1: (0, 10)}, {0: 1, 1: 1}, 1)


def run_with_a_second_pass(tmp_path: Path) -> tuple[str, list[dict[str, object]]]:
    """Epoch 0 of 50 rows, batches of 10: a batch, a skip of 2 (positions [10, 30)),
    a batch, state 1; the rest of the epoch, then a second pass of 2 batches, state 2."""
    uri, _ = datasets.write_local(tmp_path / "ds", [25, 25])
    with shardcache.numpy.Batches(
        uri, batch_size=10, columns=["uid"], cache_dir=tmp_path / "cache", rank=0, world_size=1
    ) as batches:
        it = iter(batches)
        next(it)
        batches.dataset.skip_batches(2)
        next(it)
        at_1 = batches.state_dict()["dataset"]
        for _ in it:
            pass
        again = iter(batches)
        next(again), next(again)
        at_2 = batches.state_dict()["dataset"]
    return uri, [at_1, at_2]


def publish(store: Path, step: int, state: dict[str, object]) -> None:
    manifest = layout.CheckpointManifest(
        step=step, name=f"step-{step}", files=(), data_state=state, created_at=float(step)
    )
    prefix = str(store / "rank-0")
    layout.write_json(
        pafs.LocalFileSystem(), layout.manifest_path(prefix, step), manifest.to_json()
    )


def test_diff_compares_an_epoch_read_twice_pass_by_pass(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Run A skipped [10, 30) in its first pass over epoch 0, then read it again; its
    newest state has no skip. Against a run with no skip, diff said the runs were
    identical (the first pass's skip was gone); it names pass 1, step 1 and the skip."""
    uri, (at_1, at_2) = run_with_a_second_pass(tmp_path)
    publish(tmp_path / "a", 1, at_1)
    publish(tmp_path / "a", 2, at_2)
    a = ["--a-checkpoint-uri", (tmp_path / "a").as_uri()]
    status = cli.main(["diff", uri, *a, "--b-batch-size", "10", "--json"])
    found = json.loads(capsys.readouterr().out)
    assert status == 1
    assert (found["epoch"], found["pass_index"], found["passes"], found["step"]) == (0, 0, 2, 1)
    assert found["reasons"] == [
        "a skip: rank 0 in epoch 0 pass 1 skipped positions [10, 30) in A, none in B"
    ]

    # B made the same first pass (its checkpoint 1), and no second: the runs first
    # differ at pass 2's step 0, which only A read.
    publish(tmp_path / "b", 1, at_1)
    b = ["--b-checkpoint-uri", (tmp_path / "b").as_uri()]
    assert cli.main(["diff", uri, *a, *b]) == 1
    out = capsys.readouterr().out
    assert out.startswith("first difference: epoch 0 pass 2 of 2 step 0 rank 0\n")
    assert (
        "because of a pass: rank 0 read epoch 0 twice in A, once in B (again from its start); pass 2 is only in A"
        in out
    )
    assert "run B reads nothing" in out
