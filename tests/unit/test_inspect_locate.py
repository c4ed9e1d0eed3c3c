from __future__ import annotations

import re

import pytest

from shardcache import errors, plans
from shardcache.inspect import locate
from tests.support import sightings

pytestmark = pytest.mark.unit

ROWS = [100, 0, 37, 250, 8, 64, 1]
DIGEST = "sha256:test"


def stream(query: locate.Query) -> list[int]:
    """Reference: the rank's whole epoch as global indices, straight from the plans."""
    offsets = plans.shard_offsets(ROWS)
    runs = plans.rank_runs(ROWS, DIGEST, query.params())
    return [offsets[r.shard] + i for r in runs for i in range(r.start, r.stop)]


@pytest.mark.parametrize("world_size,rank", [(1, 0), (3, 0), (3, 2), (4, 1), (7, 6)])
@pytest.mark.parametrize("batch_size", [1, 16, 33])
def test_steps_concatenated_are_the_ranks_stream_in_batches(
    world_size: int, rank: int, batch_size: int
) -> None:
    q = locate.Query(
        epoch=1, rank=rank, world_size=world_size, batch_size=batch_size, seed=9, block_size=16
    )
    expected = stream(q)
    steps = locate.step_count(ROWS, q)
    assert steps == -(-len(expected) // batch_size)
    got: list[list[int]] = [
        [p.index for p in locate.step_rows(ROWS, DIGEST, q.replace(step=s))] for s in range(steps)
    ]
    assert [i for batch in got for i in batch] == expected
    assert all(len(b) == batch_size for b in got[:-1])
    assert 1 <= len(got[-1]) <= batch_size


def test_provenance_names_shard_row_and_position() -> None:
    q = locate.Query(world_size=2, rank=1, step=3, batch_size=10, seed=2, block_size=16)
    offsets = plans.shard_offsets(ROWS)
    for slot, p in enumerate(locate.step_rows(ROWS, DIGEST, q)):
        assert p.index == offsets[p.shard] + p.row
        assert 0 <= p.row < ROWS[p.shard]
        assert p.position == 30 + slot


def test_every_sample_is_sighted_where_its_step_holds_it() -> None:
    q = locate.Query(epoch=2, world_size=3, batch_size=7, seed=4, block_size=16)
    sightings.assert_sighted_where_their_steps_hold_them(ROWS, DIGEST, q)


def test_step_past_the_end_says_how_many_steps_there_are() -> None:
    q = locate.Query(world_size=2, rank=0, batch_size=100, step=3)
    # Rank 0 of 2 reads 230 of 460 samples: steps 0, 1, 2.
    with pytest.raises(errors.InputError, match=re.escape("expected 0 <= step < 3 (230 samples")):
        locate.step_rows(ROWS, DIGEST, q)


def test_rank_at_or_beyond_world_size_is_refused() -> None:
    with pytest.raises(errors.InputError, match=re.escape("expected 0 <= rank < world size 4")):
        locate.Query(rank=4, world_size=4)


def test_sample_index_out_of_range_is_refused() -> None:
    with pytest.raises(errors.InputError, match="the dataset has 460 samples"):
        locate.sightings(ROWS, DIGEST, locate.Query(), [460])
