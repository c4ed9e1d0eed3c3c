"""`shardcache diff` of runs that resized (an elastic resume: generations of world
sizes, `shardcache.lineage.history`). It refused any run whose checkpoints changed world
size; it now walks both runs' generations in reading order, compares per rank where
both read, and names the first point where their generations part (a resize one run
made and the other did not, or to another world size, or from other positions)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from shardcache import cli, elastic, manifests, plans, states
from shardcache.checkpoint import layout
from shardcache.lineage import diff, history
from tests.support import datasets
from tests.unit.test_lineage_diff import manifest

pytestmark = pytest.mark.unit

M = manifest([30, 30, 36, 24])  # 120 rows: 30 a rank at world size 4
BATCH = 4
PARAMS = plans.PlanParams(seed=1, world_size=4, block_size=6)


def state(
    m: manifests.Manifest, rank: int, position: int, *skips: states.Skip, world: int = 4
) -> states.DataState:
    params = dataclasses.replace(PARAMS, rank=rank, world_size=world)
    return states.DataState(m.digest, params, position, batch_size=BATCH, skips=skips)


def elastic_chains(
    m: manifests.Manifest,
    *,
    at: int = 8,
    world: int = 3,
    later: int = 12,
    skips: Mapping[int, Sequence[states.Skip]] | None = None,
) -> dict[int, list[history.Checkpoint]]:
    """World size 4 to position `at` (step 1), then resized to `world` (the states
    `elastic.resize` makes of step 1's), each new rank at `later` with `skips` (step 2)."""
    old = {r: [history.Checkpoint(1, state(m, r, at))] for r in range(4)}
    new = elastic.resize([c[0].state for c in old.values()], total_rows=120, world_size=world)
    for r, s in enumerate(new):
        moved = dataclasses.replace(s, position=later, skips=tuple((skips or {}).get(r, ())))
        old[r].append(history.Checkpoint(2, moved))
    return old


def run_of(chains: Mapping[int, Sequence[history.Checkpoint]]) -> diff.RunPlan:
    hist = history.build(M.digest, M.shard_rows, chains)
    assert len(hist.generations) == 2
    return diff.RunPlan(M, hist.params, BATCH, generations=hist.generations)


def rows(params: plans.PlanParams, start: int) -> tuple[tuple[str, int], ...]:
    """The batch of `params.rank` from position `start`, straight from the plan."""
    every = [
        (M.shards[r.shard].path, row)
        for r in plans.rank_runs(M.shard_rows, M.digest, params)
        for row in range(r.start, r.stop)
    ]
    return tuple(every[start : start + BATCH])


def test_two_identical_elastic_runs_are_identical() -> None:
    a, b = run_of(elastic_chains(M)), run_of(elastic_chains(M))
    assert diff.first_difference(a, b, range(3)) is None


def test_a_resize_against_a_run_that_stayed_is_a_difference_at_the_resize() -> None:
    a = run_of(elastic_chains(M))
    stayed = diff.RunPlan(M, PARAMS, BATCH)
    found = diff.first_difference(a, stayed, range(2))
    assert found is not None
    # Each old rank read positions [0, 8): the first 2 batches agree; step 2 is where
    # A's rank 0 is the resized rank 0 and B's reads on.
    assert (found.epoch, found.step, found.rank, found.pass_index) == (0, 2, 0, 0)
    assert found.reasons == (
        "an elastic resize: A went from world size 4 to 3 after step 1, B went on at 4",
    )
    resized = elastic.resize([state(M, r, 8) for r in range(4)], total_rows=120, world_size=3)
    assert found.a == rows(resized[0].params, 0)
    assert found.b == rows(dataclasses.replace(PARAMS, rank=0), 8)
    assert (found.generation_a, found.world_size_a) == (0, 4)
    assert (found.generation_b, found.world_size_b) == (0, 4)
    assert found.to_json()["generation_a"] == 0
    # The other way round names B's resize.
    back = diff.first_difference(stayed, a, range(2))
    assert back is not None and back.reasons == (
        "an elastic resize: B went from world size 4 to 3 after step 1, A went on at 4",
    )


def test_a_skip_after_the_same_resize_is_found_in_the_new_generation() -> None:
    a = run_of(elastic_chains(M))
    b = run_of(elastic_chains(M, skips={1: [states.Skip(0, 4, 8)]}))
    found = diff.first_difference(a, b, range(2))
    assert found is not None
    assert (found.epoch, found.step, found.rank) == (0, 1, 1)
    assert (found.generation_a, found.generation_b) == (1, 1)
    assert (found.world_size_a, found.world_size_b) == (3, 3)
    assert found.reasons == ("a skip: rank 1 in epoch 0 skipped positions none in A, [4, 8) in B",)


@pytest.mark.parametrize(
    ("other", "why", "step"),
    [
        (
            {"world": 2},
            "an elastic resize: A went from world size 4 to 3 after step 1, B resized to 2 "
            "after step 1",
            2,
        ),
        (
            {"at": 12},
            "an elastic resize: both resized to 3, from other positions: segments differ (A "
            "went from world size 4 to 3 after step 1, B went from world size 4 to 3 after "
            "step 1)",
            2,
        ),
    ],
    ids=["to another world size", "from other positions"],
)
def test_runs_that_resized_differently_differ_where_the_first_resized(
    other: dict[str, int], why: str, step: int
) -> None:
    a = run_of(elastic_chains(M))
    b = run_of(elastic_chains(M, **other))  # type: ignore[arg-type]
    found = diff.first_difference(a, b, range(2))
    assert found is not None
    assert (found.epoch, found.step, found.rank) == (0, step, 0)
    assert found.reasons == (why,)
    assert found.generation_a == found.generation_b == 0


def publish(store: Path, chains: Mapping[int, Sequence[history.Checkpoint]]) -> str:
    fs = pafs.LocalFileSystem()
    for rank, chain in chains.items():
        for c in chain:
            ckpt = layout.CheckpointManifest(
                step=c.step,
                name=f"step-{c.step}",
                files=(),
                data_state=c.state.to_json(),
                created_at=float(c.step),
            )
            layout.write_json(
                fs, layout.manifest_path(str(store / f"rank-{rank}"), c.step), ckpt.to_json()
            )
    return store.as_uri()


def test_diff_compares_a_published_elastic_run_with_one_that_stayed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    uri, _ = datasets.write_local(tmp_path / "ds", [60, 60])
    m = manifests.resolve(uri)
    shared = [uri, "--seed", "1", "--block-size", "6"]

    def chains(world: int) -> dict[int, list[history.Checkpoint]]:
        old = {r: [history.Checkpoint(1, state(m, r, 8))] for r in range(4)}
        new = elastic.resize([c[0].state for c in old.values()], total_rows=120, world_size=world)
        for r, s in enumerate(new):
            old[r].append(history.Checkpoint(2, dataclasses.replace(s, position=12)))
        return old

    a = ["--a-checkpoint-uri", publish(tmp_path / "a", chains(3))]
    same = ["--b-checkpoint-uri", publish(tmp_path / "same", chains(3))]
    assert cli.main(["diff", *shared, *a, *same]) == 0
    assert capsys.readouterr().out == ""

    # B never resized (plan only, world size 4): the resize is the difference.
    assert cli.main(["diff", *shared, *a, "--b-world-size", "4", "--b-batch-size", "4"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("first difference: epoch 0 step 2 rank 0\n")
    assert "  in run A's generation 0 (world size 4), run B's generation 0 (world size 4)\n" in out
    assert "because of an elastic resize: A went from world size 4 to 3 after step 1" in out

    status = cli.main(
        ["diff", *shared, *a, "--b-checkpoint-uri", publish(tmp_path / "two", chains(2)), "--json"]
    )
    found = json.loads(capsys.readouterr().out)
    assert status == 1
    assert (found["step"], found["rank"], found["world_size_a"], found["world_size_b"]) == (
        2,
        0,
        4,
        4,
    )
    assert found["reasons"] == [
        "an elastic resize: A went from world size 4 to 3 after step 1, B resized to 2 after step 1"
    ]


def test_a_world_size_option_is_checked_against_the_first_generation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    uri, _ = datasets.write_local(tmp_path / "ds", [60, 60])
    m = manifests.resolve(uri)
    old = {r: [history.Checkpoint(1, state(m, r, 8))] for r in range(4)}
    new = elastic.resize([c[0].state for c in old.values()], total_rows=120, world_size=3)
    for r, s in enumerate(new):
        old[r].append(history.Checkpoint(2, s))
    store = publish(tmp_path / "a", old)
    status = cli.main(["diff", uri, "--a-checkpoint-uri", store, "--a-world-size", "3"])
    err = capsys.readouterr().err
    assert status == 2
    assert (
        "--a-world-size 3 contradicts run A's checkpoints (4, its first generation's world size): leave it out"
        in err
    )
    # The first generation's world size is taken.
    assert (
        cli.main(
            [
                "diff",
                uri,
                "--seed",
                "1",
                "--block-size",
                "6",
                "--a-checkpoint-uri",
                store,
                "--a-world-size",
                "4",
                "--b-checkpoint-uri",
                store,
            ]
        )
        == 0
    )


def test_a_difference_before_the_resize_is_reported_instead_of_the_resize() -> None:
    a = run_of(elastic_chains(M))
    skipped = diff.RunPlan(M, PARAMS, BATCH, skips={3: [states.Skip(0, 4, 8)]})
    found = diff.first_difference(a, skipped, range(2))
    assert found is not None
    assert (found.epoch, found.step, found.rank) == (0, 1, 3)
    assert found.reasons == ("a skip: rank 3 in epoch 0 skipped positions none in A, [4, 8) in B",)


def test_a_resize_in_a_second_pass_against_a_run_that_read_the_epoch_once() -> None:
    """World size 2 reads epoch 0 to 30, again from its start to 10, and resizes to 1
    there. Against a run that read the epoch once at world size 2, pass 2 is only A's."""
    m = manifest([50, 50])
    flat = plans.PlanParams(seed=0, world_size=2, shuffle=False, block_size=8)

    def at(rank: int, position: int) -> states.DataState:
        return states.DataState(m.digest, dataclasses.replace(flat, rank=rank), position, 10)

    chains = {
        r: [history.Checkpoint(1, at(r, 30)), history.Checkpoint(2, at(r, 10))] for r in (0, 1)
    }
    [new] = elastic.resize([at(0, 10), at(1, 10)], total_rows=100, world_size=1)
    chains[0].append(history.Checkpoint(3, dataclasses.replace(new, position=20)))
    hist = history.build(m.digest, m.shard_rows, chains)
    a = diff.RunPlan(m, hist.params, 10, generations=hist.generations)
    assert diff.first_difference(a, a, range(2)) is None
    found = diff.first_difference(a, diff.RunPlan(m, flat, 10), range(2))
    assert found is not None
    assert (found.epoch, found.pass_index, found.passes, found.step, found.rank) == (0, 1, 2, 0, 0)
    assert found.reasons == (
        "a pass: rank 0 read epoch 0 twice in A, once in B (again from its start); pass 2 is "
        "only in A",
    )
    assert (found.generation_a, found.generation_b) == (0, None)
