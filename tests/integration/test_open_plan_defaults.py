"""In a pod, `shardcache.open()` reads with its DatasetMount's plan (issue 19).

The env comes from the webhook's own injection (`shardcache_operator.injection`) of a
mount whose `spec.sharding` sets seed, shuffle and block size: the sidecar process gets
the sidecar container's plan variables, the trainer (this process) the trainer
container's env, pointed at the sidecar's run directory. Without plan arguments the
trainer reads the mount's plan, the one the sidecar's startup reader warmed up; given
arguments win.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from shardcache_operator import injection, specs

import shardcache
from shardcache import contract, plans, sidecar_client, windows
from tests.support import datasets
from tests.support.sidecar import MOUNT, SidecarProcess

pytestmark = pytest.mark.integration

SHARDS = [40, 25, 33]
SHARDING = {"seed": 7, "shuffle": True, "blockSize": 8}
PLAN_ENV = (
    contract.ENV_SEED,
    contract.ENV_SHUFFLE,
    contract.ENV_BLOCK_SIZE,
    contract.ENV_SHUFFLE_GRANULARITY,
    contract.ENV_SHUFFLE_WINDOW,
)

Factory = Callable[..., SidecarProcess]


def injected_env(spec: dict[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
    """(sidecar env, trainer env) as the webhook writes them for a pod of mount `MOUNT`."""
    mount = injection.Mount(MOUNT, specs.parse_spec(spec), None)
    pod = {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "trainer"}]}}
    stored = injection.inject(pod, [mount], defaults=injection.SidecarDefaults(image="s:1"))
    (sidecar,) = stored["spec"]["initContainers"]
    (trainer,) = stored["spec"]["containers"]
    return (
        {e["name"]: e["value"] for e in sidecar["env"] if "value" in e},
        {e["name"]: e["value"] for e in trainer["env"]},
    )


def start_pod(
    tmp_path: Path,
    sidecar_factory: Factory,
    monkeypatch: pytest.MonkeyPatch,
    sharding: dict[str, Any],
) -> tuple[SidecarProcess, str]:
    """A sidecar serving `MOUNT` with `sharding` as its spec's plan, and this process as
    its trainer."""
    uri, _ = datasets.write_local(tmp_path / "ds", SHARDS)
    sidecar_env, trainer_env = injected_env({"source": {"uri": uri}, "sharding": sharding})
    proc = sidecar_factory(uri, env={n: sidecar_env[n] for n in PLAN_ENV})
    proc.start(wait="ready")
    for name in (contract.ENV_SOCKET, contract.ENV_CHECKPOINT_DIR):
        monkeypatch.delenv(name, raising=False)
    for name, value in {**trainer_env, contract.ENV_RUN_DIR: str(proc.run_dir)}.items():
        monkeypatch.setenv(name, value)
    return proc, uri


@pytest.fixture
def pod(
    tmp_path: Path, sidecar_factory: Factory, monkeypatch: pytest.MonkeyPatch
) -> tuple[SidecarProcess, str]:
    return start_pod(tmp_path, sidecar_factory, monkeypatch, SHARDING)


def read_uids(ds: shardcache.Dataset, proc: SidecarProcess) -> tuple[list[int], set[Any]]:
    """The uids `ds` yields, and the plans the sidecar's readers had after the first
    batch (the trainer registers its reader when it starts reading)."""
    batches = ds.batches(16)
    uids = next(batches).column("uid").to_pylist()
    seen = set(registered_plans(proc))
    uids += [u for b in batches for u in b.column("uid").to_pylist()]
    return uids, seen


def plan_order(digest: str, params: plans.PlanParams) -> list[int]:
    offsets = plans.shard_offsets(SHARDS)
    runs = plans.rank_runs(SHARDS, digest, params)
    return [
        plans.global_index(offsets, r.shard, row) for r in runs for row in range(r.start, r.stop)
    ]


def registered_plans(proc: SidecarProcess) -> list[tuple[int, bool, int]]:
    provider = sidecar_client.SidecarProvider.from_env(environ=proc.client_env())
    try:
        readers = provider.status()["readers"]
    finally:
        provider.close()
    return [(r["seed"], r["shuffle"], r["block_size"]) for r in readers]


def test_open_without_plan_arguments_reads_the_mounts_plan_the_sidecar_warmed(
    pod: tuple[SidecarProcess, str],
) -> None:
    proc, _ = pod
    # Before the trainer reads: the sidecar's startup reader, with the mount's plan.
    assert registered_plans(proc) == [(7, True, 8)]
    with shardcache.open() as ds:
        assert (ds.params.seed, ds.params.shuffle, ds.params.block_size) == (7, True, 8)
        expected = plan_order(ds.manifest.digest, ds.params)
        # Another block size gives another order: the check below can tell them apart.
        library = plans.PlanParams()
        assert plan_order(ds.manifest.digest, library) != expected
        uids, seen = read_uids(ds, proc)
        assert uids == expected
        # The trainer's reader (the startup one gives way to it) has the same plan.
        assert seen == {(7, True, 8)}


def test_explicit_open_arguments_win_over_the_mounts_plan(
    pod: tuple[SidecarProcess, str],
) -> None:
    proc, _ = pod
    assert registered_plans(proc) == [(7, True, 8)]
    with shardcache.open(seed=3, block_size=16) as ds:
        # shuffle was left out: the mount's.
        assert (ds.params.seed, ds.params.shuffle, ds.params.block_size) == (3, True, 16)
        uids, seen = read_uids(ds, proc)
        assert uids == plan_order(ds.manifest.digest, ds.params)
        # The sidecar is told the plan the trainer reads with, and follows that one.
        assert seen == {(3, True, 16)}


def test_embedded_mode_in_the_same_pod_keeps_the_library_defaults(
    pod: tuple[SidecarProcess, str], tmp_path: Path
) -> None:
    _, uri = pod
    with shardcache.open(uri, cache_dir=tmp_path / "cache") as ds:
        assert ds.params == plans.PlanParams()


#: A sample-mode mount: windows of 30 rows over 98 rows, so windows span shards.
SAMPLE_SHARDING = {"seed": 7, "granularity": "sample", "window": 30, "blockSize": 8}
EMBEDDED_SAMPLE: dict[str, Any] = {"shuffle": "sample", "seed": 7, "window": 30, "block_size": 8}


def test_a_sample_mode_mount_warms_its_windows_and_open_reads_the_embedded_sample_plan(
    tmp_path: Path, sidecar_factory: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    proc, uri = start_pod(tmp_path, sidecar_factory, monkeypatch, SAMPLE_SHARDING)
    provider = sidecar_client.SidecarProvider.from_env(environ=proc.client_env())
    try:
        (startup,) = provider.status()["readers"]
        manifest = provider.manifest
    finally:
        provider.close()
    # The sidecar's own reader has the mount's sample-mode plan...
    assert (startup["granularity"], startup["window"], startup["block_size"]) == ("sample", 30, 8)
    startup_plan = plans.PlanParams(seed=7, block_size=8, granularity="sample", window=30)
    wins = windows.rank_windows(manifest.shard_rows, manifest.digest, startup_plan)
    # ...and, once ready, every shard of its first window is resident: the shards a
    # sample-mode reader leases for its first batch (a block-mode warm-up of two shards
    # could miss one when the window spans three).
    resident = {
        s for s in range(len(SHARDS)) if (proc.memory_dir / manifest.decoded_key(s)).exists()
    }
    assert set(wins[0].shards) <= resident
    with shardcache.open() as ds:
        # No plan arguments: the mount's granularity and window.
        assert ds.params == startup_plan
        uids, seen = read_uids(ds, proc)
    with shardcache.open(uri, cache_dir=tmp_path / "cache", **EMBEDDED_SAMPLE) as local:
        embedded = [u for b in local.batches(16) for u in b.column("uid").to_pylist()]
    assert uids == embedded
    assert sorted(uids) == list(range(sum(SHARDS)))
    assert seen == {(7, True, 8)}
