"""`shardcache inspect` names the option its states came from: a run followed with
--checkpoint-uri whose states do not match the plan said "--data-state" in its error,
an option the user never gave."""

from __future__ import annotations

import dataclasses

import pytest

from shardcache import errors, states
from shardcache.inspect import cli, locate

pytestmark = pytest.mark.unit

DIGEST = "sha256:" + "a" * 64


def _state(query: locate.Query, **changes: object) -> states.DataState:
    state = states.DataState(digest=DIGEST, params=query.params(), position=0)
    return dataclasses.replace(state, **changes)  # type: ignore[arg-type]


def test_a_plan_mismatch_of_a_followed_checkpoint_names_checkpoint_uri() -> None:
    query = locate.Query(world_size=2, rank=0, batch_size=4, seed=1, block_size=16)
    other = locate.Query(world_size=2, rank=0, batch_size=4, seed=2, block_size=16)
    loaded = {0: ("s3://ckpt/run (rank 0)", _state(other))}
    with pytest.raises(errors.StateMismatchError) as caught:
        cli.check_states(loaded, DIGEST, query, flag="--checkpoint-uri")
    message = str(caught.value)
    assert message.startswith("--checkpoint-uri s3://ckpt/run (rank 0): ")
    assert "--data-state" not in message


def test_saved_state_files_are_still_named_data_state() -> None:
    query = locate.Query(world_size=2, rank=0, batch_size=4, seed=1, block_size=16)
    loaded = {0: ("state.json", _state(query, digest="sha256:" + "b" * 64))}
    with pytest.raises(errors.StateMismatchError, match=r"^--data-state state\.json: "):
        cli.check_states(loaded, DIGEST, query)


def test_different_batch_sizes_of_a_followed_run_name_checkpoint_uri() -> None:
    query = locate.Query(world_size=2, rank=0, batch_size=4, seed=1, block_size=16)
    loaded = {
        0: ("u (rank 0)", _state(query, batch_size=4)),
        1: ("u (rank 1)", _state(query, batch_size=8)),
    }
    with pytest.raises(errors.StateMismatchError, match=r"^--checkpoint-uri: the states"):
        cli.recorded_batch_size(loaded, flag="--checkpoint-uri")
