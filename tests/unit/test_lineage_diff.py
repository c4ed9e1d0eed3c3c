"""`diff.first_difference` equals a brute-force comparison of every batch, and says why."""

from __future__ import annotations

import dataclasses

import pytest

from shardcache import manifests, plans, states
from shardcache.lineage import diff

pytestmark = pytest.mark.unit


def manifest(
    rows: list[int], *, content: str = "v1", extra: str | None = None
) -> manifests.Manifest:
    shards = [
        manifests.ShardEntry(
            f"part-{i:02d}.parquet", 100 + n, "etag:x", n, "f", content if i == 2 else "v1"
        )
        for i, n in enumerate(rows)
    ]
    if extra is not None:
        shards.append(manifests.ShardEntry(extra, 10, "etag:x", 7, "f", "v1"))
    return manifests.Manifest.build("file:///data", "parquet", tuple(shards))


BASE = diff.RunPlan(
    manifest([23, 0, 40, 17, 9]), plans.PlanParams(seed=1, world_size=3, block_size=6), 4
)


def brute_batches(run: diff.RunPlan, rank: int, epoch: int) -> list[list[tuple[str, int]]]:
    if rank >= run.params.world_size:
        return []
    m = run.manifest
    params = dataclasses.replace(run.params, rank=rank, epoch=epoch)
    rows = [
        (m.shards[r.shard].path, m.shards[r.shard].sha256, row)
        for r in plans.rank_runs(m.shard_rows, m.digest, params)
        for row in range(r.start, r.stop)
    ]
    skips = [s for s in run.skips.get(rank, ()) if s.epoch == epoch]
    kept = [x for p, x in enumerate(rows) if not states.is_skipped(skips, p)]
    b = run.batch_size
    return [[(path, row) for path, _, row in kept[i : i + b]] for i in range(0, len(kept), b)]


def brute_first(a: diff.RunPlan, b: diff.RunPlan, epochs: int) -> tuple[int, int, int] | None:
    def full(run: diff.RunPlan, rank: int, epoch: int) -> list[list[tuple[str, str, int]]]:
        # Compare with the shard content too: a changed shard is another sample.
        m = run.manifest
        versions = {s.path: s.sha256 for s in m.shards}
        return [
            [(p, versions[p], r) for p, r in batch] for batch in brute_batches(run, rank, epoch)
        ]

    world = max(a.params.world_size, b.params.world_size)
    for epoch in range(epochs):
        per_rank = [(full(a, r, epoch), full(b, r, epoch)) for r in range(world)]
        steps = max(max(len(x), len(y)) for x, y in per_rank)
        for step in range(steps):
            for rank, (x, y) in enumerate(per_rank):
                bx = x[step] if step < len(x) else None
                by = y[step] if step < len(y) else None
                if bx != by:
                    return epoch, step, rank
    return None


CASES = {
    "identical": BASE,
    "seed": dataclasses.replace(BASE, params=dataclasses.replace(BASE.params, seed=2)),
    "world size": dataclasses.replace(BASE, params=dataclasses.replace(BASE.params, world_size=2)),
    "batch size": dataclasses.replace(BASE, batch_size=5),
    "block size": dataclasses.replace(BASE, params=dataclasses.replace(BASE.params, block_size=8)),
    "skip": dataclasses.replace(BASE, skips={1: (states.Skip(0, 8, 16),)}),
    "skip in epoch 1": dataclasses.replace(BASE, skips={2: (states.Skip(1, 4, 12),)}),
    "changed shard": dataclasses.replace(BASE, manifest=manifest([23, 0, 40, 17, 9], content="v2")),
    "added shard": dataclasses.replace(
        BASE, manifest=manifest([23, 0, 40, 17, 9], extra="z.parquet")
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_first_difference_equals_a_brute_force_comparison_of_every_batch(name: str) -> None:
    other = CASES[name]
    found = diff.first_difference(BASE, other, range(2))
    want = brute_first(BASE, other, 2)
    if want is None:
        assert found is None
        return
    assert found is not None
    assert (found.epoch, found.step, found.rank) == want
    assert found.a == tuple(brute_batches(BASE, found.rank, found.epoch)[found.step])


def test_identical_runs_are_silent_even_when_an_unused_parameter_differs() -> None:
    unshuffled = dataclasses.replace(BASE, params=dataclasses.replace(BASE.params, shuffle=False))
    reseeded = dataclasses.replace(
        unshuffled, params=dataclasses.replace(unshuffled.params, seed=99)
    )
    assert diff.first_difference(unshuffled, reseeded, range(3)) is None
    assert diff.first_difference(BASE, BASE, range(3)) is None


@pytest.mark.parametrize(
    "name,why",
    [
        ("seed", "another seed: 1 vs 2"),
        ("world size", "another world size: 3 vs 2"),
        ("batch size", "another batch size: 4 vs 5"),
        ("skip", "a skip: rank 1 in epoch 0 skipped positions none in A, [8, 16) in B"),
        ("changed shard", "shards changed: part-02.parquet"),
        ("added shard", "shards only in B: z.parquet"),
    ],
)
def test_the_reason_names_what_differs(name: str, why: str) -> None:
    found = diff.first_difference(BASE, CASES[name], range(2))
    assert found is not None
    assert any(why in r for r in found.reasons), found.reasons


def test_a_skip_first_differs_at_the_skipped_step_of_that_rank() -> None:
    found = diff.first_difference(BASE, CASES["skip"], range(1))
    assert found is not None
    assert (found.epoch, found.step, found.rank) == (0, 2, 1)
