"""A rank may read an epoch again from its start (the numpy batches or the torch dataset
iterated again after a pass reached the epoch's end, as a validation loop does). The
later pass drops the epoch's skips and records its own, so a checkpoint taken in it is
behind an earlier checkpoint of the pass before and lacks that checkpoint's skip of the
epoch: `shardcache lineage` refused the two as a rewind ("the run was rewound and the
abandoned checkpoints kept"). It is one run: the first pass read on to the epoch's end,
the second from its start, and each pass is reported with its own reads and skips."""

from __future__ import annotations

from pathlib import Path

import pytest

import shardcache.numpy
from shardcache import errors, states
from shardcache.lineage import cli, history, queries
from tests.support import datasets

pytestmark = pytest.mark.unit


def uids(batch: dict[str, object]) -> list[int]:
    return [int(u) for u in batch["uid"]]  # type: ignore[attr-defined]


def test_lineage_reads_a_checkpoint_mid_second_pass_as_a_later_pass_not_a_rewind(
    tmp_path: Path,
) -> None:
    uri, _ = datasets.write_local(tmp_path / "ds", [25, 25])
    with shardcache.numpy.Batches(
        uri, batch_size=10, columns=["uid"], cache_dir=tmp_path / "cache", rank=0, world_size=1
    ) as batches:
        it = iter(batches)
        before_1 = uids(next(it))
        skip = batches.dataset.skip_batches(2)
        before_1 += uids(next(it))
        at_1 = states.parse(batches.state_dict()["dataset"])  # after the skip
        rest_of_first = [u for b in it for u in uids(b)]
        again = iter(batches)  # the first pass reached the epoch's end: a second pass
        second = uids(next(again)) + uids(next(again))
        at_2 = states.parse(batches.state_dict()["dataset"])  # mid second pass
        digest = batches.dataset.manifest.digest
    assert skip == states.Skip(0, 10, 30) and at_1.skips == (skip,)
    assert (at_2.epoch, at_2.position, at_2.skips) == (0, 20, ())

    chains = {0: [history.Checkpoint(1, at_1), history.Checkpoint(2, at_2)]}
    hist = history.build(digest, [25, 25], chains)  # was refused as a rewind

    got = queries.reads(hist, range(50))
    first = {r.index: r for r in got if r.pass_index == 0}
    later = {r.index: r for r in got if r.pass_index == 1}
    assert len(first) == len(later) == 50
    # The first pass: the skip as checkpoint 1 has it, every other row read.
    assert {i for i, r in first.items() if r.status == "skipped"} == set(range(50)) - set(
        before_1 + rest_of_first
    )
    assert all(first[i].skip == skip for i in first if first[i].status == "skipped")
    assert {i: (r.after, r.before) for i, r in first.items() if r.status == "read"} == {
        **{u: (None, 1) for u in before_1},
        **{u: (1, 2) for u in rest_of_first},
    }
    # The second pass read the rows the first skipped; the rest is still to come.
    assert {i: (r.after, r.before) for i, r in later.items() if r.status == "read"} == {
        u: (1, 2) for u in second
    }
    assert {i for i, r in later.items() if r.status == "pending"} == set(range(50)) - set(second)
    assert [later[u].step for u in second] == [0] * 10 + [1] * 10
    text = cli.reads_text(queries.reads_json(hist, "uid >= 0", list(range(50)), False, got))
    assert f"index {second[0]}: epoch 0 rank 0 pass 2 step 0 (row 0 of the batch): read " in text

    report = queries.consumed(hist, 2)["ranks"][0]
    consumed = [i for e in report["epochs"] for lo, hi in e["ranges"] for i in range(lo, hi)]
    assert consumed == rest_of_first + second
    assert report["samples"] == 30 and report["skips"] == [] and report["read_again"] == 0


def state(epoch: int, position: int, *skips: states.Skip) -> states.DataState:
    return states.DataState(
        digest="sha256:x",
        params=shardcache.plans.PlanParams(
            seed=0, epoch=epoch, rank=0, world_size=1, shuffle=False, block_size=8
        ),
        position=position,
        skips=skips,
    )


def test_lineage_reads_a_second_pass_past_the_earlier_checkpoint_without_its_skip() -> None:
    """Ahead of the earlier checkpoint but without its skip of the epoch: refused
    before ("lacks skips that step 1 carries"); a second pass that read past it."""
    skip = states.Skip(0, 10, 30)
    chains = {0: [history.Checkpoint(1, state(0, 30, skip)), history.Checkpoint(2, state(0, 40))]}
    hist = history.build("sha256:x", [50], chains)
    got = queries.reads(hist, range(50))
    by_pass = {
        n: {r.position: (r.status, r.after, r.before) for r in got if r.pass_index == n}
        for n in (0, 1)
    }
    assert by_pass[0] == {
        **{p: ("read", None, 1) for p in range(10)},
        **{p: ("skipped", None, None) for p in range(10, 30)},
        **{p: ("read", 1, 2) for p in range(30, 50)},
    }
    assert by_pass[1] == {
        **{p: ("read", 1, 2) for p in range(40)},
        **{p: ("pending", None, None) for p in range(40, 50)},
    }
    assert hist.generations[0].pass_skips(0, 0) == [(skip,), ()]


def test_a_chain_back_to_an_earlier_epoch_is_still_refused_as_a_rewind() -> None:
    back = {0: [history.Checkpoint(10, state(1, 40)), history.Checkpoint(20, state(0, 80))]}
    with pytest.raises(errors.InputError, match="the run was rewound"):
        history.build("sha256:x", [100], back)
