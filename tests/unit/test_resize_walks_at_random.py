"""Elastic resumes among everything else a training loop does, at random, row by row.

A walk over two epochs: ranks of one world size read batches of sizes that divide
nothing (each rank its own count and size: not in lockstep), with and without
`drop_last`, skip batches, save; the next world size (or the same one, each rank from
its own state or from the list) loads the states and does the same; resizes chain
within the epoch (4 -> 3 -> 5), and the next epoch starts from the states the last
ranks saved and resizes again. In block mode, sample mode (windows that straddle the
shards and the cuts) and manifest order, gathering inline and ahead.

Every batch is checked against a model of docs/reading-plan.md written here from its
rules, not from `shardcache.elastic`: a rank's stream is a list of positions of the
epoch's global sequence S (read whole by a world-size-1 reader), rule 5 cuts S, rule 8
cuts what the ranks left (in S's order) into near-equal parts and records the
smallest, `drop_last` ends batches at the last whole one within it and passes over the
rest as consumed. So: every row of every epoch is consumed exactly once (read,
skipped or trimmed), every batch holds exactly the rows the model says in its order,
and ranks at one step with `drop_last` yield the same count. Tests the combinations
test_elastic.py, test_drop_last_even_batches.py and test_dataset_elastic.py check
alone. Also a list of states of two resizes (one rank's from after a resize, the
others' from before it) is refused rather than read twice (`elastic.gather`).
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hypothesis
import hypothesis.strategies as st
import pytest

import shardcache
from shardcache import errors
from tests.support import datasets

pytestmark = pytest.mark.unit

#: Empty shards, a one-row shard, one shard alone, equal shards.
SHARD_SETS = [(7, 0, 13, 1, 9, 20), (5, 5, 5), (30,), (2, 0, 0, 3, 17, 4, 11)]


@dataclasses.dataclass(frozen=True)
class Plan:
    shards: tuple[int, ...]
    shuffle: bool | str
    window: int
    block_size: int
    seed: int

    @property
    def rows(self) -> int:
        return sum(self.shards)


@dataclasses.dataclass
class Rank:
    """The model of one rank in an epoch: the positions of S its stream reads, in
    order, how many it consumed, and where `drop_last` ends its batches."""

    stream: list[int]
    position: int
    least: int


class Walker:
    """Opens the datasets of a walk and reads S, each dataset written once."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.uris: dict[tuple[int, ...], str] = {}
        self.sequences: dict[tuple[Plan, int], list[int]] = {}

    def open(self, plan: Plan, rank: int, world: int, threads: int) -> shardcache.Dataset:
        if plan.shards not in self.uris:
            path = self.root / f"ds-{len(self.uris)}"
            self.uris[plan.shards] = datasets.write_local(path, list(plan.shards))[0]
        return shardcache.open(
            self.uris[plan.shards], cache_dir=self.root / "cache", rank=rank, world_size=world,
            seed=plan.seed, shuffle=plan.shuffle, window=plan.window,
            block_size=plan.block_size, gather_threads=threads,
        )  # fmt: skip

    def sequence(self, plan: Plan, epoch: int) -> list[int]:
        """The epoch's global sequence S: what one rank of world size 1 reads."""
        if (plan, epoch) not in self.sequences:
            with self.open(plan, 0, 1, 0) as ds:
                ds.set_epoch(epoch)
                self.sequences[plan, epoch] = uids(ds.batches(64))
        return self.sequences[plan, epoch]


@pytest.fixture(scope="module")
def walker(tmp_path_factory: pytest.TempPathFactory) -> Walker:
    return Walker(tmp_path_factory.mktemp("resize-walks"))


def uids(batches: Iterator[Any]) -> list[int]:
    return [u for b in batches for u in b.column("uid").to_pylist()]


def rule5(rows: int, world: int) -> list[Rank]:
    return [Rank(list(range(rows * r // world, rows * (r + 1) // world)), 0, rows // world)
            for r in range(world)]  # fmt: skip


def rule8(old: list[Rank], world: int) -> list[Rank]:
    """What the old ranks left, in S's order, cut into `world` near-equal parts."""
    left = sorted(p for rank in old for p in rank.stream[rank.position :])
    n = len(left)
    return [Rank(left[n * r // world : n * (r + 1) // world], 0, n // world) for r in range(world)]


def read(model: Rank, size: int, count: int, drop_last: bool) -> tuple[list[int], int]:
    """The positions of S that `count` batches of `size` read from the model's
    position, and the position after them."""
    p, n = model.position, len(model.stream)
    if not drop_last:
        stop = min(n, p + count * size)
        return model.stream[p:stop], stop
    whole = max(0, min(model.least, n) - p) // size
    if count == 0:
        return [], p
    if count >= whole:  # the last whole batch handed: the rest is passed over
        return model.stream[p : p + whole * size], n
    return model.stream[p : p + count * size], p + count * size


def walk_ranks(
    walker: Walker,
    plan: Plan,
    epoch: int,
    world: int,
    models: list[Rank],
    load: list[dict[str, Any]] | None,
    rng: random.Random,
    consumed: list[int],
    *,
    last: bool,
) -> list[dict[str, Any]]:
    """Every rank of `world` loads (its own state, or the list `load`), walks, and
    saves; the model follows. The last phase of an epoch reads it to its end: from a
    common place (every rank at position 0) half the time, where `drop_last` must give
    every rank the same count."""
    s = walker.sequence(plan, epoch)
    lockstep = last and rng.random() < 0.5 and all(m.position == 0 for m in models)
    size, drop_last = rng.randint(1, 7), rng.random() < 0.5
    saved, counts = [], []
    for rank, model in enumerate(models):
        with walker.open(plan, rank, world, rng.choice([0, 2])) as ds:
            if load is not None:
                own = [state for state in load if state["rank"] == rank and len(load) == world]
                ds.load_state_dict(own[0] if own and rng.random() < 0.5 else load)
            ds.set_epoch(epoch)  # the loop's call: keeps a loaded state's place
            assert (len(ds), ds.position) == (len(model.stream), model.position)
            steps: list[tuple[str, int, int, bool]] = []
            if not lockstep:
                steps = [
                    ("read", rng.randint(0, 4), rng.randint(1, 7), rng.random() < 0.5)
                    for _ in range(rng.randint(0, 2))
                ]
                if rng.random() < 0.3:
                    steps.insert(rng.randint(0, len(steps)), ("skip", rng.randint(1, 2), rng.randint(1, 7), False))  # fmt: skip
            if last:
                steps.append(("read", len(s) + 1, size, drop_last))
            for what, count, batch, trim in steps:
                if what == "skip":
                    ds.skip_batches(count, batch_size=batch)
                    stop = min(len(model.stream), model.position + count * batch)
                else:
                    it = ds.batches(batch, drop_last=trim)
                    got = [b.column("uid").to_pylist() for b in itertools.islice(it, count)]
                    it.close()
                    want, stop = read(model, batch, count, trim)
                    assert [u for b in got for u in b] == [s[p] for p in want], (rank, what)
                    counts.append(len(got))
                consumed += model.stream[model.position : stop]
                model.position = stop
                assert ds.position == stop
            saved.append(ds.state_dict())
    if lockstep and drop_last:
        assert len(set(counts)) == 1, counts
    return saved


@hypothesis.settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture],
)
@hypothesis.given(
    shards=st.sampled_from(SHARD_SETS),
    shuffle=st.sampled_from(["block", "sample", False]),
    window=st.sampled_from([3, 8, 13]),
    block_size=st.sampled_from([2, 4, 5]),
    seed=st.integers(0, 9),
    first_epoch=st.integers(0, 2),
    worlds=st.lists(st.lists(st.integers(1, 5), min_size=1, max_size=3), min_size=2, max_size=2),
    rng=st.randoms(use_true_random=False),
)
def test_resizes_among_batches_skips_drop_last_and_epochs_consume_every_row_once(
    walker: Walker, shards: tuple[int, ...], shuffle: bool | str, window: int,
    block_size: int, seed: int, first_epoch: int, worlds: list[list[int]], rng: random.Random,
) -> None:  # fmt: skip
    plan = Plan(shards, shuffle, window, block_size, seed)
    states: list[dict[str, Any]] | None = None
    models: list[Rank] = []
    for epoch, epoch_worlds in zip(itertools.count(first_epoch), worlds, strict=False):
        consumed: list[int] = []
        if states is not None:
            # The next epoch: the last ranks resume from their own states first.
            epoch_worlds = [len(states), *epoch_worlds]
        for i, world in enumerate(epoch_worlds):
            if states is None or (i == 0 and states is not None and epoch != first_epoch):
                models = rule5(plan.rows, world)  # a fresh epoch (rules 5 and 9)
            elif len(states) != world:
                models = rule8(models, world)
            # (The same world size: each rank goes on from its own state.)
            states = walk_ranks(
                walker, plan, epoch, world, models, states, rng, consumed,
                last=i == len(epoch_worlds) - 1,
            )  # fmt: skip
        assert sorted(consumed) == list(range(plan.rows)), epoch


def test_a_list_of_states_from_before_and_after_a_resize_is_refused_and_moves_nothing(
    walker: Walker,
) -> None:
    """Rank 0's newest state is from after a 2 -> 3 resize, ranks 1 and 2 kept theirs
    from a run at 3 before it: every key agrees, but rank 0's segments hold rows rank 1
    had read. Each rank used to take its own state at 3 ranks (rows read twice), and a
    resize to 2 read them twice too; now the list is refused at any world size."""
    plan = Plan((7, 0, 13, 1, 9), "sample", 8, 4, 1)

    def one_batch(rank: int, world: int, load: list[dict[str, Any]] | None) -> dict[str, Any]:
        with walker.open(plan, rank, world, 0) as ds:
            if load is not None:
                ds.load_state_dict(load)
            next(ds.batches(3))
            return ds.state_dict()

    rank0 = one_batch(0, 3, [one_batch(r, 2, None) for r in range(2)])
    older = [one_batch(r, 3, None) for r in range(3)]
    for world in (3, 2):
        with walker.open(plan, 1, world, 0) as ds:
            ds.set_epoch(1)
            with pytest.raises(
                errors.StateMismatchError,
                match=r"ranks \[0\] read epoch 0 in the segments an elastic resume gave them, "
                r"ranks \[1, 2\] read the epoch's plain rule-5 ranges",
            ):
                ds.load_state_dict([rank0, *older[1:]])
            assert (ds.epoch, ds.position) == (1, 0)
