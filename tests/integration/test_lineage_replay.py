"""Lineage equals a brute-force replay: real datasets read a small dataset over several
epochs with checkpoints, skips and a rewind, and every read they made is the one
`shardcache.lineage` reconstructs from the checkpoints' data states alone."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest

import shardcache
from shardcache import errors, lineage, plans, states
from tests.support import datasets

pytestmark = pytest.mark.integration

SHARDS = [40, 0, 23, 64, 9, 31]
TOTAL = sum(SHARDS)
BATCH = 6


@dataclasses.dataclass(frozen=True)
class Seen:
    rank: int
    epoch: int
    step: int
    slot: int
    #: The training step (from 1) in which the batch was read.
    global_step: int


class Rank:
    """One rank's reader: batches across epochs, as a training loop takes them."""

    def __init__(self, ds: shardcache.Dataset) -> None:
        self.ds = ds
        self.epoch_steps = 0
        self._it: Iterator[object] | None = None

    def next_batch(self) -> tuple[int, int, list[int]]:
        while True:
            if self._it is None:
                self._it = iter(self.ds.batches(BATCH))
            batch = next(self._it, None)
            if batch is not None:
                step = self.epoch_steps
                self.epoch_steps += 1
                return self.ds.epoch, step, batch.column("uid").to_pylist()
            self.ds.set_epoch(self.ds.epoch + 1)
            self._it, self.epoch_steps = None, 0

    def skip(self, batches: int) -> None:
        self.ds.skip_batches(batches, batch_size=BATCH)


#: Sample mode's window: spans shards, and no batch divides it.
WINDOW = 20
MODES = ["block", "sample"]


def open_rank(root: Path, rank: int, world: int, mode: str = "block") -> shardcache.Dataset:
    return shardcache.open(
        str(root / "ds"), cache_dir=root / "c", rank=rank, world_size=world, seed=9, block_size=8,
        shuffle=mode, window=WINDOW,
    )  # fmt: skip


def train(
    ranks: list[Rank],
    steps: range,
    *,
    ckpt_every: int,
    skips: dict[int, int],
    seen: dict[tuple[int, int], Seen],
    chains: dict[int, list[lineage.Checkpoint]],
) -> None:
    """Training steps `steps`: every rank reads one batch per step; after step s a skip
    of skips[s] batches, and a checkpoint every `ckpt_every` steps."""
    for g in steps:
        for r, rank in enumerate(ranks):
            epoch, step, uids = rank.next_batch()
            for slot, uid in enumerate(uids):
                assert (uid, epoch) not in seen, "a sample was read twice in an epoch"
                seen[(uid, epoch)] = Seen(r, epoch, step, slot, g)
        if g in skips:
            for rank in ranks:
                rank.skip(skips[g])
        if g % ckpt_every == 0:
            for r, rank in enumerate(ranks):
                state = json.loads(json.dumps(rank.ds.state_dict()))
                chains[r].append(lineage.Checkpoint(g, states.parse(state)))


@pytest.mark.parametrize("mode", MODES)
def test_lineage_equals_a_brute_force_replay_across_checkpoints_skips_and_a_rewind(
    tmp_path: Path, mode: str
) -> None:
    datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / "ds"), SHARDS)
    world = 3
    seen: dict[tuple[int, int], Seen] = {}
    chains: dict[int, list[lineage.Checkpoint]] = {r: [] for r in range(world)}
    ranks = [Rank(open_rank(tmp_path, r, world, mode)) for r in range(world)]
    # 9 batches of 6 per rank per epoch: steps 1-9 are epoch 0.
    train(ranks, range(1, 13), ckpt_every=4, skips={6: 2}, seen=seen, chains=chains)
    # A spike after step 12: go back to checkpoint 8, skip 3 batches, train on. What
    # was read after step 8 is abandoned with the checkpoints after it.
    for rank in ranks:
        rank.ds.close()
    for r in range(world):
        chains[r] = [c for c in chains[r] if c.step <= 8]
    seen = {k: v for k, v in seen.items() if v.global_step <= 8}
    resumed = []
    for r in range(world):
        ds = open_rank(tmp_path, r, world, mode)
        ds.load_state_dict(chains[r][-1].state.to_json())
        resumed.append(Rank(ds))
    # The step counter of the epoch the checkpoint is in (a trainer knows its step).
    # A trainer knows its step in the epoch; count the batches of the kept reads.
    for r, rank in enumerate(resumed):
        epoch = chains[r][-1].state.epoch
        rank.epoch_steps = len({s.step for s in seen.values() if s.rank == r and s.epoch == epoch})
    for rank in resumed:
        rank.skip(3)
    train(resumed, range(9, 31), ckpt_every=4, skips={21: 1}, seen=seen, chains=chains)
    for rank in resumed:
        rank.ds.close()

    ds = open_rank(tmp_path, 0, world, mode)
    hist = lineage.build(ds.manifest.digest, ds.manifest.shard_rows, chains)
    ds.close()
    last = max(c.step for c in chains[0])
    got = lineage.reads(hist, range(TOTAL))
    epochs = {r.epoch for r in got}
    assert epochs == {0, 1, 2, 3}, "the run spans four epochs"
    statuses = {r.status for r in got}
    assert statuses == {"read", "skipped", "pending"}
    by_key = {(r.index, r.epoch): r for r in got}
    assert len(by_key) == TOTAL * len(epochs)
    for (uid, epoch), s in seen.items():
        got_read = by_key[(uid, epoch)]
        if s.global_step > last:
            assert got_read.status == "pending"
            continue
        before = -(-s.global_step // 4) * 4
        want = lineage.Read(
            index=uid,
            epoch=epoch,
            rank=s.rank,
            position=got_read.position,
            status="read",
            step=s.step,
            slot=s.slot,
            after=before - 4 if before > 4 else None,
            before=before,
            checkpoints=tuple(range(before, last + 1, 4)),
            world_size=world,
        )
        assert got_read == want
    # Everything lineage calls read was read, and nothing it calls skipped was.
    read = {k for k, r in by_key.items() if r.status == "read"}
    assert read == {k for k, s in seen.items() if s.global_step <= last}
    skipped = {k for k, r in by_key.items() if r.status == "skipped"}
    assert skipped and not skipped & set(seen)


def read_between(
    seen: dict[tuple[int, int], Seen], rank: int, after: int, upto: int
) -> list[tuple[int, int]]:
    """(epoch, uid) of every sample `rank` read at a global step in (`after`, `upto`],
    sorted: what a checkpoint at `upto` consumed since one at `after`."""
    return sorted(
        (s.epoch, uid)
        for (uid, _), s in seen.items()
        if s.rank == rank and after < s.global_step <= upto
    )


def consumed_samples(rank_report: dict[str, Any]) -> list[tuple[int, int]]:
    """(epoch, uid) of every sample one rank's part of a `lineage.consumed` report names,
    sorted."""
    return sorted(
        (e["epoch"], i)
        for e in rank_report["epochs"]
        for lo, hi in e["ranges"]
        for i in range(lo, hi)
    )


def test_consumed_is_what_each_rank_read_since_the_previous_checkpoint(tmp_path: Path) -> None:
    datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / "ds"), SHARDS)
    world = 2
    seen: dict[tuple[int, int], Seen] = {}
    chains: dict[int, list[lineage.Checkpoint]] = {r: [] for r in range(world)}
    ranks = [Rank(open_rank(tmp_path, r, world)) for r in range(world)]
    train(ranks, range(1, 25), ckpt_every=5, skips={7: 2, 16: 1}, seen=seen, chains=chains)
    for rank in ranks:
        rank.ds.close()
    ds = open_rank(tmp_path, 0, world)
    hist = lineage.build(ds.manifest.digest, ds.manifest.shard_rows, chains)
    ds.close()
    for step in (5, 10, 15, 20):
        report = lineage.consumed(hist, step)
        assert report["complete"]
        for rank_report in report["ranks"]:
            rank = rank_report["rank"]
            want = read_between(seen, rank, step - 5, step)
            assert consumed_samples(rank_report) == want, f"step {step} rank {rank}"
            assert rank_report["previous"] == (step - 5 or None)
    with pytest.raises(errors.InputError, match="no checkpoint with step 7"):
        lineage.consumed(hist, 7)


def state(world: int, rank: int, epoch: int, position: int) -> states.DataState:
    params = plans.PlanParams(seed=1, epoch=epoch, rank=rank, world_size=world, block_size=8)
    return states.DataState(digest="sha256:x", params=params, position=position, batch_size=4)


@pytest.mark.parametrize("mode", MODES)
def test_lineage_equals_a_brute_force_replay_across_a_world_size_change(
    tmp_path: Path, mode: str
) -> None:
    """3 ranks train to checkpoint 8 (with a skip), 2 ranks resume from every old rank's
    state at step 8 (elastic) and train three more epochs (with a skip): lineage says
    exactly who read each sample, and what each checkpoint consumed."""
    datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / "ds"), SHARDS)
    seen: dict[tuple[int, int], Seen] = {}
    chains: dict[int, list[lineage.Checkpoint]] = {r: [] for r in range(3)}
    old = [Rank(open_rank(tmp_path, r, 3, mode)) for r in range(3)]
    train(old, range(1, 9), ckpt_every=4, skips={6: 1}, seen=seen, chains=chains)
    for rank in old:
        rank.ds.close()
    at_8 = [c.state.to_json() for r in range(3) for c in chains[r] if c.step == 8]
    new = []
    for r in range(2):
        ds = open_rank(tmp_path, r, 2, mode)
        ds.load_state_dict(list(reversed(at_8)))
        new.append(Rank(ds))
    train(new, range(9, 41), ckpt_every=4, skips={20: 2}, seen=seen, chains=chains)
    for rank in new:
        rank.ds.close()

    ds = open_rank(tmp_path, 0, 2, mode)
    hist = lineage.build(ds.manifest.digest, ds.manifest.shard_rows, chains)
    ds.close()
    assert [(g.world_size, g.start_epoch, g.resumed_from) for g in hist.generations] == [
        (3, 0, None),
        (2, 0, 8),
    ]
    got = lineage.reads(hist, range(TOTAL))
    by_key: dict[tuple[int, int], list[lineage.Read]] = {}
    for found in got:
        by_key.setdefault((found.index, found.epoch), []).append(found)
    # Every sample of every epoch is reached exactly once, by one generation's rank.
    assert all(len(v) == 1 for v in by_key.values())
    assert len(by_key) == TOTAL * len({e for _, e in by_key})
    for (uid, epoch), s in seen.items():
        (read,) = by_key[(uid, epoch)]
        before = -(-s.global_step // 4) * 4
        world = 3 if s.global_step <= 8 else 2
        assert (read.status, read.rank, read.world_size, read.generation) == (
            "read", s.rank, world, 0 if world == 3 else 1,
        ), (uid, epoch)  # fmt: skip
        assert (read.step, read.slot, read.before) == (s.step, s.slot, before)
        assert read.after == (before - 4 if before > 4 else None)
        assert read.checkpoints == tuple(range(before, 41, 4))
    read_keys = {k for k, v in by_key.items() if v[0].status == "read"}
    assert read_keys == set(seen)
    skipped = {k for k, v in by_key.items() if v[0].status == "skipped"}
    assert skipped and not skipped & set(seen)
    # The reverse query across the resize: checkpoint 12 is the first of world size 2.
    for step in (8, 12, 24):
        report = lineage.consumed(hist, step)
        assert report["complete"]
        for rank_report in report["ranks"]:
            rank = rank_report["rank"]
            world = 3 if step <= 8 else 2
            want = read_between(seen, rank, step - 4, step)
            assert consumed_samples(rank_report) == want, f"step {step} rank {rank}"
            assert rank_report["previous"] == step - 4
            assert rank_report["world_size"] == world


def test_a_world_size_change_that_is_no_elastic_resume_is_refused() -> None:
    # World size 4 at step 20 without the segments a resume of step 10 gives.
    chains = {
        r: [lineage.Checkpoint(10, state(2, r, 0, 40)), lineage.Checkpoint(20, state(4, r, 0, 20))]
        for r in range(2)
    }
    chains.update({r: [lineage.Checkpoint(20, state(4, r, 0, 20))] for r in (2, 3)})
    with pytest.raises(errors.InputError, match="does not resume the world size 2 run") as info:
        lineage.build("sha256:x", [100, 100], chains)
    assert "newest complete step 10" in str(info.value)
    mixed = {
        0: [lineage.Checkpoint(10, state(2, 0, 0, 40))],
        1: [lineage.Checkpoint(10, state(3, 1, 0, 40))],
    }
    with pytest.raises(errors.InputError, match=r"step 10 is published at world sizes \[2, 3\]"):
        lineage.build("sha256:x", [100, 100], mixed)


def test_a_chain_that_goes_backwards_or_lacks_a_rank_is_refused() -> None:
    back = {
        0: [lineage.Checkpoint(10, state(1, 0, 1, 40)), lineage.Checkpoint(20, state(1, 0, 0, 80))]
    }
    with pytest.raises(errors.InputError, match="rewound"):
        lineage.build("sha256:x", [100, 100], back)
    partial = {0: [lineage.Checkpoint(10, state(2, 0, 0, 40))]}
    with pytest.raises(errors.InputError, match=r"ranks \[1\] have no checkpoint"):
        lineage.build("sha256:x", [100, 100], partial)
