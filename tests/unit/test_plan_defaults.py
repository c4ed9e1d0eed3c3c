"""`shardcache.open()`'s plan defaults: argument, then the pod's mount, then the library."""

from __future__ import annotations

import dataclasses

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
    contract.ENV_SHUFFLE_GRANULARITY: "sample",
    contract.ENV_SHUFFLE_WINDOW: "1000",
}
MOUNTS_PLAN = _plan_defaults.PlanDefaults(
    shuffle=False, seed=7, block_size=32, granularity="sample", window=1000
)


def test_library_defaults_are_the_contract_tables() -> None:
    library = _plan_defaults.LIBRARY
    assert (
        library.shuffle,
        library.seed,
        library.block_size,
        library.granularity,
        library.window,
    ) == (True, 0, plans.DEFAULT_BLOCK_SIZE, plans.BLOCK, plans.DEFAULT_WINDOW)
    assert library.mode() == (True, plans.BLOCK)


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
    assert got == dataclasses.replace(_plan_defaults.LIBRARY, seed=5)


def test_variables_set_by_hand_without_an_injected_pod_apply() -> None:
    env = {contract.ENV_SOCKET: "/run/s/control.sock", contract.ENV_BLOCK_SIZE: "16"}
    assert _plan_defaults.from_env(env, mount=None).block_size == 16


def test_explicit_arguments_win_one_by_one() -> None:
    got = _plan_defaults.resolve(MOUNTS_PLAN, shuffle=True, seed=None, block_size=8)
    assert got == dataclasses.replace(MOUNTS_PLAN, shuffle=True, block_size=8)
    got = _plan_defaults.resolve(MOUNTS_PLAN, shuffle=None, seed=None, block_size=None, window=9)
    assert got == dataclasses.replace(MOUNTS_PLAN, window=9)
    # Falsy arguments are still arguments.
    got = _plan_defaults.resolve(_plan_defaults.LIBRARY, shuffle=False, seed=0, block_size=None)
    assert (got.shuffle, got.seed) == (False, 0)


def test_a_bad_value_is_refused_naming_the_variable() -> None:
    env = {**POD_ENV, contract.ENV_BLOCK_SIZE: "0"}
    with pytest.raises(errors.InputError, match=r"\$SHARDCACHE_BLOCK_SIZE: expected"):
        _plan_defaults.from_env(env, mount=None)


def test_a_sample_mount_reads_in_sample_mode_when_shuffle_is_left_out_or_true() -> None:
    sampled = {**POD_ENV, contract.ENV_SHUFFLE: "true"}
    mount = _plan_defaults.from_env(sampled, mount=None)
    for shuffle in (None, True):
        plan = _plan_defaults.resolve(mount, shuffle=shuffle, seed=None, block_size=None)
        assert plan.mode() == (True, plans.SAMPLE)
        assert plan.window == 1000
    # A mode named explicitly wins, and shuffle off is manifest order whatever the mount.
    block = _plan_defaults.resolve(mount, shuffle="block", seed=None, block_size=None)
    assert block.mode() == (True, plans.BLOCK)
    off = _plan_defaults.resolve(mount, shuffle=False, seed=None, block_size=None)
    assert off.mode() == (False, plans.BLOCK)


def test_a_mount_without_shuffle_reads_in_manifest_order_despite_its_granularity() -> None:
    assert MOUNTS_PLAN.mode() == (False, plans.BLOCK)


def test_another_mounts_granularity_never_applies() -> None:
    plan = _plan_defaults.from_env({**POD_ENV, contract.ENV_SHUFFLE: "true"}, mount="extra")
    assert plan.mode() == (True, plans.BLOCK)
    assert plan.window == plans.DEFAULT_WINDOW


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        (contract.ENV_SHUFFLE_GRANULARITY, "rows", "expected block or sample, found 'rows'"),
        (contract.ENV_SHUFFLE_WINDOW, "0", "expected an integer >= 1, found 0"),
    ],
)
def test_a_bad_granularity_or_window_is_refused_naming_the_variable(
    name: str, value: str, expected: str
) -> None:
    with pytest.raises(errors.InputError, match=rf"\${name}: {expected}"):
        _plan_defaults.from_env({**POD_ENV, name: value}, mount=None)
