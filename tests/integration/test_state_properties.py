"""Resume at random: any (epoch, rank, position, batch sizes), embedded and through a
real sidecar, compared row by row, in order, with the uninterrupted stream.

Also the load path's refusals: a position past the end of the epoch, a state missing a
key, a state saved by another rank, each changing nothing; and the epoch a state
carries is the one resumed. And what the state counts when the position moves under an
open iterator (`set_epoch` between two batches, in every mode), and that numpy integers
given for the epoch or the batch size leave a state that is JSON and loads.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import hypothesis
import hypothesis.strategies as st
import numpy as np
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


def test_a_state_refused_for_its_position_changes_nothing_and_the_iterator_reads_on(
    embedded: Opener,
) -> None:
    params = plans.PlanParams(seed=SEED, block_size=BLOCK)
    with embedded(params) as ds:
        whole = uids(ds, 10)
    with embedded(params) as ds:
        it = ds.batches(10)
        got = [u for _ in range(3) for u in next(it).column("uid").to_pylist()]
        before = ds.state_dict()
        # Another epoch, and a position no epoch of this rank reaches.
        with pytest.raises(errors.StateMismatchError, match="past the end of epoch 4"):
            ds.load_state_dict({**before, "epoch": 4, "position": 10_000})
        assert ds.state_dict() == before
        got += [u for b in it for u in b.column("uid").to_pylist()]
    assert got == whole


#: Every mode, and sample mode both gathering inline and ahead on threads.
MOVES = [("block", 0), (False, 0), ("sample", 0), ("sample", 2)]


def open_mode(uri: str, cache: Path, mode: str | bool, threads: int) -> shardcache.Dataset:
    return shardcache.open(
        uri,
        cache_dir=cache,
        shuffle=mode,
        seed=SEED,
        block_size=BLOCK,
        window=50,
        gather_threads=threads,
    )


def epoch_one(uri: str, tmp_path: Path, mode: str | bool, threads: int) -> list[int]:
    """Epoch 1's uids in batches of 7, read from its start by a dataset of its own."""
    with open_mode(uri, tmp_path, mode, threads) as ds:
        ds.set_epoch(1)
        return uids(ds, 7)


@pytest.mark.parametrize(("mode", "threads"), MOVES)
def test_set_epoch_between_two_batches_reads_on_from_the_new_epochs_start(
    local_uri: str, tmp_path: Path, mode: str | bool, threads: int
) -> None:
    epoch1 = epoch_one(local_uri, tmp_path, mode, threads)
    with open_mode(local_uri, tmp_path, mode, threads) as ds:
        it = ds.batches(7)
        next(it)
        next(it)
        ds.set_epoch(1)
        got = [u for _ in range(3) for u in next(it).column("uid").to_pylist()]
        state = ds.state_dict()
        got += [u for b in it for u in b.column("uid").to_pylist()]
    assert got == epoch1, "the open iterator did not read epoch 1 from its start"
    assert (state["epoch"], state["position"]) == (1, 21)
    with open_mode(local_uri, tmp_path, mode, threads) as resumed:
        resumed.load_state_dict(state)
        assert uids(resumed, 7) == epoch1[21:]


@pytest.mark.parametrize(("mode", "threads"), MOVES)
def test_set_epoch_after_the_epochs_last_batch_reads_the_new_epoch_from_the_same_iterator(
    local_uri: str, tmp_path: Path, mode: str | bool, threads: int
) -> None:
    epoch1 = epoch_one(local_uri, tmp_path, mode, threads)
    with open_mode(local_uri, tmp_path, mode, threads) as ds:
        it = ds.batches(7)
        for _ in range(-(-len(ds) // 7)):  # every batch of epoch 0, the short last one too
            next(it)
        ds.set_epoch(1)
        got = [u for b in it for u in b.column("uid").to_pylist()]
        assert (ds.epoch, ds.position) == (1, len(epoch1))
    assert got == epoch1


@pytest.mark.parametrize(("mode", "threads"), MOVES)
def test_numpy_integers_for_the_epoch_and_batch_size_leave_a_json_state_that_loads(
    local_uri: str, tmp_path: Path, mode: str | bool, threads: int
) -> None:
    # Typed Any: the signatures say int, which is what a numpy integer becomes.
    one: Any = np.arange(1, 2)[0]
    five: Any = np.int64(5)
    with open_mode(local_uri, tmp_path, mode, threads) as ds:
        ds.set_epoch(1)
        want = uids(ds, 5)
    with open_mode(local_uri, tmp_path, mode, threads) as ds:
        ds.set_epoch(one)
        it = ds.batch_pieces(five)
        got = [u for _ in range(2) for p in next(it) for u in p.column("uid").to_pylist()]
        it.close()
        state = json.loads(json.dumps(ds.state_dict()))
    assert (state["epoch"], state["position"], state["batch_size"]) == (1, 10, 5)
    with open_mode(local_uri, tmp_path, mode, threads) as resumed:
        resumed.load_state_dict(state)
        assert got + uids(resumed, 5) == want


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda ds: next(ds.batches(2.5)), "batch_size: expected an int >= 1, found float 2.5"),
        (lambda ds: next(ds.batches("4")), "batch_size: expected an int >= 1, found str '4'"),
        (lambda ds: next(ds.batches(True)), "batch_size: expected an int >= 1, found bool True"),
        (
            lambda ds: next(ds.batch_pieces(2.0)),
            "batch_size: expected an int >= 1, found float 2.0",
        ),
        (lambda ds: ds.set_epoch("1"), "epoch: expected an int, found str '1'"),
        (lambda ds: ds.set_epoch(1.5), "epoch: expected an int, found float 1.5"),
        (lambda ds: ds.set_epoch(0.0), "epoch: expected an int, found float 0.0"),
        (lambda ds: ds.set_epoch(-1), "epoch must be >= 0, got -1"),
    ],
)
@pytest.mark.parametrize(("mode", "threads"), [("block", 0), ("sample", 2)])
def test_an_epoch_or_batch_size_of_another_type_is_refused_naming_it(
    local_uri: str,
    tmp_path: Path,
    mode: str | bool,
    threads: int,
    call: Callable[[Any], object],
    message: str,
) -> None:
    with open_mode(local_uri, tmp_path, mode, threads) as ds:
        with pytest.raises(errors.InputError, match=re.escape(message)):
            call(ds)
        assert (ds.epoch, ds.position, ds.state_dict()["batch_size"]) == (0, 0, None)
