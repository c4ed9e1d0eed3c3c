"""`shardcache.open()`'s plan defaults: argument, then the pod's mount, then the library."""

from __future__ import annotations

import pytest

from shardcache import _plan_defaults, contract, errors, plans

pytestmark = pytest.mark.unit

#: What the webhook writes into a trainer of a pod with mounts `data` then `extra`.
POD_ENV = {
    contract.ENV_MOUNT: "data",
    contract.ENV_MOUNTS: "data,extra",
    contract.ENV_SEED: "7",
    contract.ENV_SHUFFLE: "false",
    contract.ENV_BLOCK_SIZE: "32",
}
MOUNTS_PLAN = _plan_defaults.PlanDefaults(shuffle=False, seed=7, block_size=32)


def test_library_defaults_are_the_contract_tables() -> None:
    library = _plan_defaults.LIBRARY
    assert (library.shuffle, library.seed, library.block_size) == (
        True,
        0,
        plans.DEFAULT_BLOCK_SIZE,
    )


def test_the_pods_first_mount_gives_its_plan_by_default_or_by_name() -> None:
    assert _plan_defaults.from_env(POD_ENV, mount=None) == MOUNTS_PLAN
    assert _plan_defaults.from_env(POD_ENV, mount="data") == MOUNTS_PLAN


def test_another_mount_of_the_pod_never_takes_the_first_ones_plan() -> None:
    assert _plan_defaults.from_env(POD_ENV, mount="extra") == _plan_defaults.LIBRARY
    # The user pointed $SHARDCACHE_MOUNT at the second mount: same answer.
    moved = {**POD_ENV, contract.ENV_MOUNT: "extra"}
    assert _plan_defaults.from_env(moved, mount=None) == _plan_defaults.LIBRARY


def test_unset_variables_keep_the_library_default() -> None:
    env = {contract.ENV_MOUNT: "data", contract.ENV_MOUNTS: "data", contract.ENV_SEED: "5"}
    got = _plan_defaults.from_env(env, mount=None)
    assert got == _plan_defaults.PlanDefaults(
        shuffle=True, seed=5, block_size=plans.DEFAULT_BLOCK_SIZE
    )


def test_variables_set_by_hand_without_an_injected_pod_apply() -> None:
    env = {contract.ENV_SOCKET: "/run/s/control.sock", contract.ENV_BLOCK_SIZE: "16"}
    assert _plan_defaults.from_env(env, mount=None).block_size == 16


def test_explicit_arguments_win_one_by_one() -> None:
    got = _plan_defaults.resolve(MOUNTS_PLAN, shuffle=True, seed=None, block_size=8)
    assert got == _plan_defaults.PlanDefaults(shuffle=True, seed=7, block_size=8)
    # Falsy arguments are still arguments.
    got = _plan_defaults.resolve(_plan_defaults.LIBRARY, shuffle=False, seed=0, block_size=None)
    assert (got.shuffle, got.seed) == (False, 0)


def test_a_bad_value_is_refused_naming_the_variable() -> None:
    env = {**POD_ENV, contract.ENV_BLOCK_SIZE: "0"}
    with pytest.raises(errors.InputError, match=r"\$SHARDCACHE_BLOCK_SIZE: expected"):
        _plan_defaults.from_env(env, mount=None)
