"""`shardcache diff` of runs whose elastic resize changed the batch size a rank reads
(the global batch kept: 4 ranks of 8, then 2 of 16). Diff counted every generation's
steps, and took its samples, at the run's first batch size; each generation now counts
at its own (what its checkpoints record), as `shardcache lineage` numbers a read."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from shardcache import cli, elastic, manifests, plans, states
from shardcache.lineage import cli as cli_lineage
from shardcache.lineage import diff, history, queries
from tests.support import datasets
from tests.unit.test_lineage_diff import manifest
from tests.unit.test_lineage_diff_elastic import publish

pytestmark = pytest.mark.unit

M = manifest([64, 64, 64, 64])  # 256 rows: 64 a rank at world size 4, 96 each after
PARAMS = plans.PlanParams(seed=1, world_size=4, block_size=6)
#: Rank 1 of world size 2 skipped its third batch of 16 (positions [32, 48)).
SKIP = states.Skip(0, 32, 48)


def resized_chains(
    m: manifests.Manifest,
    *,
    old_batch: int | None = 8,
    new_batch: int | None = 16,
    skips: Mapping[int, Sequence[states.Skip]] | None = None,
) -> dict[int, list[history.Checkpoint]]:
    """World size 4 reading batches of `old_batch` to position 16 (step 1), resized to 2
    (the states `elastic.resize` makes of step 1's), each new rank reading batches of
    `new_batch` to position 64 with `skips` (step 2). A batch size of None: the states
    record none, as those saved outside `batches()` do."""
    old = {
        r: [
            history.Checkpoint(
                1,
                states.DataState(
                    m.digest, dataclasses.replace(PARAMS, rank=r), 16, batch_size=old_batch
                ),
            )
        ]
        for r in range(4)
    }
    total = sum(m.shard_rows)
    new = elastic.resize([c[0].state for c in old.values()], total_rows=total, world_size=2)
    for r, s in enumerate(new):
        moved = dataclasses.replace(
            s, position=64, batch_size=new_batch, skips=tuple((skips or {}).get(r, ()))
        )
        old[r].append(history.Checkpoint(2, moved))
    return old


def hist_of(chains: Mapping[int, Sequence[history.Checkpoint]]) -> history.History:
    hist = history.build(M.digest, M.shard_rows, chains)
    assert [g.world_size for g in hist.generations] == [4, 2]
    return hist


def run_of(hist: history.History) -> diff.RunPlan:
    # The run's batch size is its first generation's, as `diff_cli.side_plan` gives it.
    return diff.RunPlan(M, hist.params, 8, generations=hist.generations)


def stream(params: plans.PlanParams) -> list[tuple[str, int]]:
    """Every row `params.rank` is handed in `params.epoch`, straight from the plan."""
    return [
        (M.shards[r.shard].path, row)
        for r in plans.rank_runs(M.shard_rows, M.digest, params)
        for row in range(r.start, r.stop)
    ]


def index_of(sample: tuple[str, int]) -> int:
    path, row = sample
    at = next(i for i, s in enumerate(M.shards) if s.path == path)
    return sum(M.shard_rows[:at]) + row


def test_a_skip_after_a_resize_to_another_batch_size_is_at_the_step_lineage_names() -> None:
    ha, hb = hist_of(resized_chains(M)), hist_of(resized_chains(M, skips={1: [SKIP]}))
    found = diff.first_difference(run_of(ha), run_of(hb), range(1))
    assert found is not None
    # Rank 1 of world size 2 was handed positions [0, 32) alike: two batches of 16, so
    # the third (step 2) is where they part; at the first generation's 8 it was step 4.
    assert (found.epoch, found.step, found.rank) == (0, 2, 1)
    assert (found.generation_a, found.generation_b) == (1, 1)
    assert found.reasons == (
        "a skip: rank 1 in epoch 0 skipped positions none in A, [32, 48) in B",
    )
    # The samples are that step's whole batch of 16 in each run.
    rows = stream(ha.generations[1].plan(1, 0))
    assert found.a == tuple(rows[32:48])
    assert found.b == tuple(rows[48:64])
    # `shardcache lineage` names the same (generation, rank, step) for those reads.
    for hist, samples in ((ha, found.a), (hb, found.b)):
        read = queries.reads(hist, [index_of(samples[0])])[0]
        assert (read.status, read.generation, read.rank) == ("read", 1, 1)
        assert (read.epoch, read.step, read.slot) == (0, found.step, 0)
    # The runs' generations read two batch sizes: each run's there is said.
    assert (found.batch_size_a, found.batch_size_b) == (16, 16)
    assert found.to_json()["batch_size_a"] == 16


def test_a_resize_to_another_batch_size_than_the_other_runs_differs_at_its_step_0() -> None:
    kept_global = run_of(hist_of(resized_chains(M)))
    kept_local = run_of(hist_of(resized_chains(M, new_batch=8)))
    # Both hand out the same rows; from the resize on A's batches are twice as large.
    found = diff.first_difference(kept_global, kept_local, range(1))
    assert found is not None
    assert (found.epoch, found.step, found.rank) == (0, 0, 0)
    assert found.reasons == ("another batch size: 16 vs 8",)
    rows = stream(kept_global.generations[1].plan(0, 0))
    assert (found.a, found.b) == (tuple(rows[:16]), tuple(rows[:8]))
    assert (found.generation_a, found.batch_size_a) == (1, 16)
    assert (found.generation_b, found.batch_size_b) == (1, 8)


def test_runs_whose_resize_kept_the_batch_size_say_no_batch_size() -> None:
    a = run_of(hist_of(resized_chains(M, new_batch=8)))
    b = run_of(hist_of(resized_chains(M, new_batch=8, skips={1: [SKIP]})))
    found = diff.first_difference(a, b, range(1))
    assert found is not None
    assert (found.step, found.rank, found.generation_a) == (4, 1, 1)
    assert "batch_size_a" not in found.to_json()
    assert "batch_size_b" not in found.to_json()


def test_diff_of_published_runs_says_the_resized_generations_batch_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    uri, _ = datasets.write_local(tmp_path / "ds", [128, 128])
    m = manifests.resolve(uri)
    shared = [uri, "--seed", "1", "--block-size", "6"]
    a = ["--a-checkpoint-uri", publish(tmp_path / "a", resized_chains(m))]
    b = ["--b-checkpoint-uri", publish(tmp_path / "b", resized_chains(m, skips={1: [SKIP]}))]
    # --a-batch-size names the first generation's batch size, as the checkpoints do.
    assert cli.main(["diff", *shared, *a, *b, "--a-batch-size", "8"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("first difference: epoch 0 step 2 rank 1\n")
    assert (
        "  in run A's generation 1 (world size 2, batch size 16), run B's generation 1 "
        "(world size 2, batch size 16)\n" in out
    )
    assert "(16 samples)" in out
    assert cli.main(["diff", *shared, *a, *b, "--a-batch-size", "16"]) == 2
    assert (
        "--a-batch-size 16 contradicts run A's checkpoints (8): leave it out"
        in capsys.readouterr().err
    )
    assert cli.main(["diff", *shared, *a, *b, "--json"]) == 1
    found = json.loads(capsys.readouterr().out)
    assert (found["step"], found["rank"], found["batch_size_a"], found["batch_size_b"]) == (
        2,
        1,
        16,
        16,
    )
    assert len(found["a"]) == len(found["b"]) == 16


def test_lineage_text_gives_each_generations_batch_size_after_a_resize() -> None:
    hist = hist_of(resized_chains(M))
    at = index_of(stream(hist.generations[1].plan(1, 0))[32])
    got = queries.reads(hist, [at])
    text = cli_lineage.reads_text(queries.reads_json(hist, f"index == {at}", [at], False, got))
    # World size 4 read batches of 8, then 2 read batches of 16: its steps count those.
    assert "run: world size 4 -> 2 (from step 1), batch size 8 -> 16, seed 1" in text
    assert f"index {at}: epoch 0 rank 1 (world size 2) step 2 (row 0 of the batch)" in text


def test_lineage_text_gives_one_batch_size_when_the_resize_kept_it() -> None:
    hist = hist_of(resized_chains(M, new_batch=8))
    text = cli_lineage.reads_text(queries.reads_json(hist, "index == 0", [0], False, []))
    assert "run: world size 4 -> 2 (from step 1), batch size 8, seed 1" in text


def test_lineage_text_says_not_recorded_for_a_generation_without_a_batch_size() -> None:
    hist = hist_of(resized_chains(M, old_batch=None))
    text = cli_lineage.reads_text(queries.reads_json(hist, "index == 0", [0], False, []))
    assert "run: world size 4 -> 2 (from step 1), batch size not recorded -> 16, seed 1" in text


def test_lineage_text_says_not_recorded_when_no_checkpoint_records_a_batch_size() -> None:
    hist = hist_of(resized_chains(M, old_batch=None, new_batch=None))
    text = cli_lineage.reads_text(queries.reads_json(hist, "index == 0", [0], False, []))
    assert "run: world size 4 -> 2 (from step 1), batch size not recorded, seed 1" in text


def test_a_given_batch_size_counts_only_the_generations_that_record_none() -> None:
    at_16 = index_of(stream(hist_of(resized_chains(M)).generations[1].plan(1, 0))[32])
    # Recorded 8 then 16: `--batch-size 8` changes nothing; generation 1's read is at
    # its own 16's step 2, not step 4 of batches of 8.
    read = queries.reads(hist_of(resized_chains(M)), [at_16], batch_size=8)[0]
    assert (read.generation, read.rank, read.step, read.slot) == (1, 1, 2, 0)
    # Generation 1 recorded none: the given size counts its steps.
    unrecorded = hist_of(resized_chains(M, new_batch=None))
    read = queries.reads(unrecorded, [at_16], batch_size=8)[0]
    assert (read.generation, read.rank, read.step, read.slot) == (1, 1, 4, 0)
    assert queries.reads(unrecorded, [at_16])[0].step is None
