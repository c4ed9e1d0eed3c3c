from __future__ import annotations

import re
from typing import Any

import pytest

from shardcache import errors, plans, streams

pytestmark = pytest.mark.unit

ROWS = [100, 0, 37, 250, 8, 64, 1]


def rows_of(runs: list[plans.Run]) -> list[tuple[int, int]]:
    return [(r.shard, i) for r in runs for i in range(r.start, r.stop)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("epoch", [0, 1])
def test_every_row_appears_exactly_once_across_ranks(world_size: int, epoch: int) -> None:
    seen: list[tuple[int, int]] = []
    sizes = []
    for rank in range(world_size):
        params = plans.PlanParams(
            seed=5, epoch=epoch, rank=rank, world_size=world_size, block_size=16
        )
        got = rows_of(plans.rank_runs(ROWS, "sha256:x", params))
        sizes.append(len(got))
        seen += got
    assert len(seen) == sum(ROWS)
    assert set(seen) == {(s, i) for s, n in enumerate(ROWS) for i in range(n)}
    assert max(sizes) - min(sizes) <= 1


def test_same_inputs_give_the_same_order() -> None:
    p = plans.PlanParams(seed=3, epoch=2, rank=1, world_size=2, block_size=10)
    assert plans.rank_runs(ROWS, "d", p) == plans.rank_runs(ROWS, "d", p)


@pytest.mark.parametrize(
    "other",
    [
        plans.PlanParams(seed=3, epoch=3, block_size=10),
        plans.PlanParams(seed=4, epoch=2, block_size=10),
    ],
)
def test_another_epoch_or_seed_gives_another_order(other: plans.PlanParams) -> None:
    base = plans.PlanParams(seed=3, epoch=2, block_size=10)
    assert rows_of(plans.rank_runs(ROWS, "d", base)) != rows_of(plans.rank_runs(ROWS, "d", other))


def test_another_digest_gives_another_order() -> None:
    p = plans.PlanParams(seed=3, block_size=10)
    assert rows_of(plans.rank_runs(ROWS, "a", p)) != rows_of(plans.rank_runs(ROWS, "b", p))


def test_without_shuffle_single_rank_reads_manifest_order() -> None:
    p = plans.PlanParams(shuffle=False)
    assert rows_of(plans.rank_runs(ROWS, "d", p)) == [
        (s, i) for s, n in enumerate(ROWS) for i in range(n)
    ]


def test_blocks_keep_rows_in_order_inside_a_block() -> None:
    p = plans.PlanParams(seed=1, block_size=16)
    for run in plans.rank_runs(ROWS, "d", p):
        # Every run is one block or adjacent blocks: it starts on a block boundary
        # (or the shard end) and spans at most the shard.
        assert run.start % 16 == 0
        assert run.stop <= ROWS[run.shard]


def test_each_shard_is_read_in_one_contiguous_span() -> None:
    # One lease per shard: a shard's blocks are never interleaved with another's.
    p = plans.PlanParams(seed=9, block_size=8)
    order = [r.shard for r in plans.rank_runs(ROWS, "d", p)]
    spans = [s for i, s in enumerate(order) if i == 0 or order[i - 1] != s]
    assert len(spans) == len(set(spans))


def test_skip_resumes_at_the_exact_row() -> None:
    runs = plans.rank_runs(ROWS, "d", plans.PlanParams(seed=2, block_size=7))
    full = rows_of(runs)
    for position in [0, 1, 6, 7, 8, 99, 100, 101, len(full) - 1, len(full)]:
        assert rows_of(list(plans.skip(runs, position))) == full[position:]


def test_upcoming_shards_follow_the_plan_from_a_position() -> None:
    runs = plans.rank_runs(ROWS, "d", plans.PlanParams(seed=2, block_size=1000))
    order = plans.shard_order(runs)
    assert plans.upcoming_shards(runs, 0) == order
    first = runs[0]
    assert plans.upcoming_shards(runs, len(first)) == order[1:]


def test_global_index_and_locate_are_inverse() -> None:
    offsets = plans.shard_offsets(ROWS)
    for shard, n in enumerate(ROWS):
        for row in range(n):
            assert plans.locate(offsets, plans.global_index(offsets, shard, row)) == (shard, row)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0}, "world_size must be >= 1, got 0"),
        ({"rank": 4, "world_size": 4}, "rank must be in [0, world_size=4), got 4"),
        ({"block_size": 0}, "block_size must be >= 1"),
        ({"epoch": -1}, "epoch must be >= 0"),
    ],
)
def test_bad_plan_parameters_name_what_is_wrong(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(errors.InputError, match=re.escape(message)):
        plans.PlanParams(**kwargs)


def test_plan_parameters_given_as_numpy_integers_are_kept_as_plain_ints() -> None:
    import numpy as np

    # Typed Any: the signatures say int, which is what a caller's numpy integer becomes.
    given: dict[str, Any] = {
        "seed": np.int64(-3),
        "epoch": np.int32(2),
        "rank": np.uint8(1),
        "world_size": np.int64(2),
        "block_size": np.int64(8),
        "window": np.uint64(16),
    }
    params = plans.PlanParams(**given)
    assert [type(getattr(params, f)) for f in given] == [int] * len(given)
    assert params == plans.PlanParams(
        seed=-3, epoch=2, rank=1, world_size=2, block_size=8, window=16
    )
    later: Any = np.int64(5)
    assert type(params.with_epoch(later).epoch) is int


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"epoch": 1.5}, "epoch: expected an int, found float 1.5"),
        ({"epoch": 1.0}, "epoch: expected an int, found float 1.0"),
        ({"epoch": "1"}, "epoch: expected an int, found str '1'"),
        ({"rank": True, "world_size": 2}, "rank: expected an int, found bool True"),
        ({"block_size": 64.0}, "block_size: expected an int, found float 64.0"),
        ({"window": None}, "window: expected an int, found NoneType None"),
    ],
)
def test_plan_parameters_of_another_type_are_refused_naming_the_field(
    kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(errors.InputError, match=re.escape(message)):
        plans.PlanParams(**kwargs)


@pytest.mark.parametrize("count", [0, 1, 2, 5, 100])
def test_next_shards_agrees_with_upcoming_shards_at_every_position(count: int) -> None:
    runs = plans.rank_runs(ROWS, "d", plans.PlanParams(seed=4, block_size=9))
    ends = plans.run_ends(runs)
    for position in range(sum(len(r) for r in runs) + 1):
        assert (
            plans.next_shards(runs, ends, position, count)
            == (plans.upcoming_shards(runs, position)[:count])
        )


def _sliced_global_order(
    shard_rows: list[int], digest: str, params: plans.PlanParams
) -> list[plans.Run]:
    # The definition `rank_runs` must equal: the rank's ranges of the whole epoch order.
    ranges = plans.stream_ranges(sum(shard_rows), params)
    return plans.runs_of(plans.global_runs(shard_rows, digest, params), ranges) if ranges else []


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("block_size", [1, 5, 16, 64, 1000])
@pytest.mark.parametrize(
    "shard_rows",
    [ROWS, [0, 0, 7], [4096] * 12, [1], [0, 3, 0, 0, 9, 0]],
    ids=["mixed", "leading-empty", "even", "one-row", "gaps"],
)
def test_a_rank_computing_only_its_shards_gets_exactly_its_slice_of_the_epoch_order(
    shuffle: bool, block_size: int, shard_rows: list[int]
) -> None:
    for world_size in (1, 2, 3, 5, 16):
        for rank in range(world_size):
            for epoch in (0, 3):
                params = plans.PlanParams(
                    seed=11,
                    epoch=epoch,
                    rank=rank,
                    world_size=world_size,
                    shuffle=shuffle,
                    block_size=block_size,
                )
                assert plans.rank_runs(shard_rows, "sha256:p", params) == _sliced_global_order(
                    shard_rows, "sha256:p", params
                )


def test_an_elastic_rank_gets_exactly_its_segments_of_the_epoch_order() -> None:
    total = sum(ROWS)
    for ranges in [((3, 9),), ((9, 10), (20, 25)), ((0, total),), ((total - 1, total),)]:
        params = plans.PlanParams(
            seed=2,
            epoch=1,
            block_size=7,
            segments=streams.Segments(1, ranges),
        )
        assert plans.rank_runs(ROWS, "sha256:e", params) == _sliced_global_order(
            ROWS, "sha256:e", params
        )
