"""Resume at random: any (epoch, rank, position, batch sizes), embedded and through a
real sidecar, compared row by row, in order, with the uninterrupted stream.

Also the load path's refusals: a position past the end of the epoch, a state missing a
key, a state saved by another rank; and the epoch a state carries is the one resumed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import hypothesis
import hypothesis.strategies as st
import pyarrow.fs as pafs
import pytest

import shardcache
from shardcache import errors, plans, sidecar_client
from tests.support import datasets
from tests.support.sidecar import SidecarProcess

pytestmark = pytest.mark.integration

# Zeros and a one-row shard among them: runs and shard boundaries at odd places.
SHARDS = [90, 0, 41, 1, 120, 67]
SEED = 11
BLOCK = 16
# Each example opens real datasets (and, through the sidecar, registers readers): a
# few dozen examples cover the boundaries without slowing `make test`.
BOUNDED = hypothesis.settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture],
)

Opener = Callable[[plans.PlanParams], shardcache.Dataset]


@pytest.fixture(scope="module")
def local_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("state") / "ds"
    datasets.write_dataset(pafs.LocalFileSystem(), str(root), SHARDS)
    return f"file://{root}"


@pytest.fixture(scope="module")
def embedded(local_uri: str, tmp_path_factory: pytest.TempPathFactory) -> Opener:
    cache = tmp_path_factory.mktemp("state-cache")

    def open_one(params: plans.PlanParams) -> shardcache.Dataset:
        ds = shardcache.open(
            local_uri,
            cache_dir=cache,
            seed=params.seed,
            rank=params.rank,
            world_size=params.world_size,
            block_size=params.block_size,
        )
        ds.set_epoch(params.epoch)
        return ds

    return open_one


@pytest.fixture(scope="module")
def through_sidecar(local_uri: str) -> Iterator[Opener]:
    proc = SidecarProcess(local_uri)
    proc.start(wait="ready")
    try:

        def open_one(params: plans.PlanParams) -> shardcache.Dataset:
            shards = sidecar_client.SidecarProvider.from_env(environ=proc.client_env())
            return shardcache.Dataset(shards, params)

        yield open_one
    finally:
        proc.cleanup()


def uids(ds: shardcache.Dataset, batch_size: int) -> list[int]:
    return [u for b in ds.batches(batch_size) for u in b.column("uid").to_pylist()]


@st.composite
def resume_cases(draw: st.DrawFn) -> tuple[plans.PlanParams, float, int, int]:
    world = draw(st.integers(min_value=1, max_value=4))
    params = plans.PlanParams(
        seed=SEED,
        epoch=draw(st.integers(min_value=0, max_value=5)),
        rank=draw(st.integers(min_value=0, max_value=world - 1)),
        world_size=world,
        block_size=BLOCK,
    )
    # Where to stop, as a fraction of the rank's epoch: 0 and 1 (the very end) included.
    where = draw(st.sampled_from([0.0, 1.0]) | st.floats(min_value=0, max_value=1))
    return params, where, draw(st.integers(1, 50)), draw(st.integers(1, 50))


def check_resume(open_one: Opener, case: tuple[plans.PlanParams, float, int, int]) -> None:
    params, where, before_size, after_size = case
    with open_one(params) as ds:
        full = uids(ds, 64)
    stop_at = round(where * len(full))
    with open_one(params) as ds:
        taken: list[int] = []
        stream = ds.batches(before_size)
        # Whole batches: the state lands mid-shard, mid-block, mid-batch of the resume.
        while len(taken) < stop_at:
            taken += next(stream).column("uid").to_pylist()
        stream.close()
        state = ds.state_dict()
    assert state["position"] == len(taken) and state["epoch"] == params.epoch
    # A fresh dataset at epoch 0: the state alone carries the epoch.
    with open_one(plans.PlanParams(**{**vars(params), "epoch": 0})) as resumed:
        resumed.load_state_dict(state)
        assert resumed.epoch == params.epoch
        rest = uids(resumed, after_size)
    assert taken + rest == full, f"resume at {len(taken)} of epoch {params.epoch} diverged"


@BOUNDED
@hypothesis.given(case=resume_cases())
def test_embedded_resume_at_random_points_yields_the_uninterrupted_stream(
    embedded: Opener, case: tuple[plans.PlanParams, float, int, int]
) -> None:
    check_resume(embedded, case)


@BOUNDED
@hypothesis.given(case=resume_cases())
def test_sidecar_resume_at_random_points_yields_the_uninterrupted_stream(
    through_sidecar: Opener, case: tuple[plans.PlanParams, float, int, int]
) -> None:
    check_resume(through_sidecar, case)


def some_state(open_one: Opener, params: plans.PlanParams, rows: int) -> dict[str, Any]:
    with open_one(params) as ds:
        stream = ds.batches(rows)
        next(stream)
        stream.close()
        return ds.state_dict()


def test_a_position_past_the_end_of_the_epoch_is_refused(embedded: Opener) -> None:
    params = plans.PlanParams(seed=SEED, rank=1, world_size=2, block_size=BLOCK)
    state = some_state(embedded, params, 5)
    with embedded(params) as ds:
        end = len(ds)
        ds.load_state_dict({**state, "position": end})  # the very end is a valid place
        assert uids(ds, 8) == []
        with pytest.raises(errors.StateMismatchError, match=f"position {end + 1} is past the end"):
            ds.load_state_dict({**state, "position": end + 1})
        with pytest.raises(errors.StateMismatchError, match="epoch must be an integer >= 0"):
            ds.load_state_dict({**state, "epoch": -1})


@pytest.mark.parametrize("key", ["position", "epoch", "digest", "rank"])
def test_a_state_missing_a_key_is_refused_naming_it(embedded: Opener, key: str) -> None:
    params = plans.PlanParams(seed=SEED, block_size=BLOCK)
    state = some_state(embedded, params, 5)
    del state[key]
    with embedded(params) as ds, pytest.raises(errors.StateMismatchError, match=repr(key)):
        ds.load_state_dict(state)


def test_a_state_saved_by_another_rank_is_refused_and_leaves_the_position(
    embedded: Opener,
) -> None:
    rank0 = plans.PlanParams(seed=SEED, rank=0, world_size=2, block_size=BLOCK)
    state = some_state(embedded, rank0, 9)
    with embedded(plans.PlanParams(**{**vars(rank0), "rank": 1})) as other:
        with pytest.raises(
            errors.StateMismatchError, match="rank: state has 0, this dataset has 1"
        ):
            other.load_state_dict(state)
        assert (other.epoch, other.position) == (0, 0)


def test_the_epoch_of_a_state_is_the_epoch_resumed(embedded: Opener) -> None:
    later = plans.PlanParams(seed=SEED, epoch=3, block_size=BLOCK)
    state = some_state(embedded, later, 30)
    with embedded(later) as ds:
        want = uids(ds, 64)[30:]
    with embedded(plans.PlanParams(seed=SEED, block_size=BLOCK)) as fresh:
        fresh.load_state_dict(state)
        fresh.set_epoch(3)  # the usual call at the top of the loop keeps the position
        assert (fresh.epoch, fresh.position) == (3, 30)
        assert uids(fresh, 7) == want
