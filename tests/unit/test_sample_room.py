"""Sample-mode windows against the memory tier, estimated from a manifest's totals: the
bound holds against the exact windows, and admission warns a pod whose ranks would not
fit (docs/reading-plan.md, "A memory tier too small for the readers' windows")."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest
from shardcache_operator import admission, injection, reconcile, sample_room, specs

from shardcache import errors, manifests, plans, windows
from tests.support import datasets

pytestmark = pytest.mark.unit

DIGEST = "sha256:" + "0f" * 32
DEFAULTS = injection.SidecarDefaults(image="shardcache-sidecar:test")
GiB = 2**30


def most_held(shard_rows: list[int], params: plans.PlanParams) -> int:
    """The most shards the exact plan has a reader hold at once (`windows.held_at`)."""
    wins = windows.rank_windows(shard_rows, DIGEST, params)
    ends = windows.window_ends(wins)
    positions = [0, *ends]
    return max(len(windows.held_at(wins, ends, p)) for p in positions)


@pytest.mark.parametrize("seed", range(6))
def test_the_estimate_is_never_below_what_a_reader_of_equal_shards_holds(seed: int) -> None:
    rng = random.Random(seed)
    shards, rows_each = rng.randint(2, 40), rng.randint(50, 900)
    window = rng.randint(20, 2_500)
    world = rng.randint(1, 4)
    shard_rows = [rows_each] * shards
    estimate = windows.estimated_reader_bytes(
        shards=shards, rows=shards * rows_each, nbytes=shards * 1000, window=window
    )
    held = max(
        most_held(
            shard_rows,
            plans.PlanParams(
                seed=seed,
                epoch=epoch,
                rank=rank,
                world_size=world,
                block_size=64,
                granularity=plans.SAMPLE,
                window=window,
            ),
        )
        for epoch in range(3)
        for rank in range(world)
    )
    assert held * 1000 <= estimate
    # Tight: at most the shard a misaligned window adds at each end.
    assert estimate <= (held + 2) * 1000


def test_the_estimate_never_exceeds_the_whole_dataset() -> None:
    assert windows.estimated_reader_bytes(shards=3, rows=300, nbytes=3000, window=65536) == 3000
    assert windows.estimated_reader_bytes(shards=0, rows=0, nbytes=0, window=10) == 0


def test_a_pods_accelerators_are_its_containers_limits_else_requests() -> None:
    pod = {
        "spec": {
            "containers": [
                {"name": "a", "resources": {"limits": {"nvidia.com/gpu": "4", "cpu": "8"}}},
                {"name": "b", "resources": {"requests": {"nvidia.com/gpu": 2}}},
                {"name": "c", "resources": {"limits": {"memory": "1Gi"}}},
                {"name": "d"},
            ],
            "initContainers": [{"name": "i", "resources": {"limits": {"nvidia.com/gpu": "8"}}}],
        }
    }
    assert sample_room.accelerators(pod) == 6
    assert sample_room.accelerators({"spec": {"containers": []}}) == 0


def mount_spec(**sharding: Any) -> specs.DatasetMountSpec:
    body = {
        "source": {"uri": "s3://data/web/"},
        "sharding": {"granularity": "sample", **sharding},
    }
    return specs.load(
        {
            "apiVersion": "shardcache.io/v1alpha1",
            "kind": "DatasetMount",
            "metadata": {"name": "web"},
            "spec": body,
        }
    ).spec


def gpu_pod(gpus: int) -> dict[str, Any]:
    limits = {"nvidia.com/gpu": str(gpus)} if gpus else {}
    return {"spec": {"containers": [{"name": "trainer", "resources": {"limits": limits}}]}}


# 48 shards of 100,000 rows, 128 MiB each: two 65,536-row windows touch 3 shards.
STATUS = {"shards": 48, "rows": 4_800_000, "bytes": 48 * 128 * 2**20}


def test_eight_ranks_of_a_default_sample_mount_are_told_the_memory_they_need() -> None:
    said = sample_room.warning("DatasetMount ml/web", mount_spec(), STATUS, gpu_pod(8))
    assert said is not None
    assert said.startswith("DatasetMount ml/web shuffles samples")
    assert "8 ranks, one per accelerator the pod asks for" in said
    assert "about 384Mi or more" in said  # 3 shards of 128 MiB
    assert "need about 3Gi, over spec.cache.memory (2Gi)" in said
    assert "Raise spec.cache.memory to at least 3Gi" in said
    assert said.endswith(
        "(a pod that reads with one process for all its accelerators runs one rank: say so "
        'with the annotation shardcache.io/local-ranks: "1")'
    )


def annotated(pod: dict[str, Any], ranks: str) -> dict[str, Any]:
    return {**pod, "metadata": {"annotations": {injection.ANNOTATION_LOCAL_RANKS: ranks}}}


def test_the_local_ranks_annotation_counts_the_ranks_instead_of_the_accelerators() -> None:
    assert sample_room.warning("m", mount_spec(), STATUS, annotated(gpu_pod(8), "1")) is None
    said = sample_room.warning("m", mount_spec(), STATUS, annotated(gpu_pod(0), "6"))
    assert said is not None
    assert "6 ranks, as its shardcache.io/local-ranks annotation says, need about 2.2Gi" in said
    assert "accelerators" not in said


@pytest.mark.parametrize("value", ["0", "-2", "eight", ""])
def test_a_malformed_local_ranks_annotation_refuses_the_pod_naming_it(value: str) -> None:
    with pytest.raises(errors.InputError, match=r"shardcache\.io/local-ranks: expected a positive"):
        sample_room.warning("m", mount_spec(granularity="block"), STATUS, annotated({}, value))


def test_one_rank_too_large_for_the_tier_is_told_in_the_singular() -> None:
    tiny = dataclasses.replace(mount_spec(), cache=specs.CacheSpec(memory=2**20))
    said = sample_room.warning("DatasetMount ml/web", tiny, STATUS, gpu_pod(0))
    assert said is not None and "one rank needs about 384Mi" in said
    assert "accelerators" not in said


@pytest.mark.parametrize(
    ("spec", "status", "gpus"),
    [
        (mount_spec(), STATUS, 4),  # 4 x 384 MiB fit in 2 GiB
        (mount_spec(), STATUS, 0),  # one rank
        (mount_spec(window=8192), STATUS, 8),  # 2 shards a rank: 8 x 256 MiB = 2 GiB
        (mount_spec(granularity="block"), STATUS, 8),
        (mount_spec(shuffle=False), STATUS, 8),
        (mount_spec(), {"shards": 4, "rows": 400_000, "bytes": GiB}, 8),  # the whole set fits
        (mount_spec(), {"phase": "Ready"}, 8),  # no totals: nothing to estimate from
    ],
)
def test_no_warning_where_the_windows_fit_or_none_apply(
    spec: specs.DatasetMountSpec, status: dict[str, Any], gpus: int
) -> None:
    assert sample_room.warning("DatasetMount ml/web", spec, status, gpu_pod(gpus)) is None


def mixture_spec(*names: str) -> specs.DatasetMountSpec:
    sources = [{"name": name, "weight": 1, "uri": f"s3://data/{name}/"} for name in names]
    body = {
        "source": {"uri": "s3://data/web/"},
        "sharding": {"granularity": "sample"},
        "mixture": {"sources": sources},
    }
    return specs.parse_spec(body)


def test_a_mixtures_sources_each_add_their_windows() -> None:
    one = sample_room.room(mount_spec(), STATUS)
    both = sample_room.room(
        mixture_spec("code"), {**STATUS, "mixture": [dict(STATUS, name="code")]}
    )
    assert one is not None and both is not None
    assert both.per_rank == 2 * one.per_rank
    assert both.total == 2 * one.total
    assert one.fits(4) and not both.fits(4)


def test_pins_of_sources_the_spec_no_longer_has_add_no_windows() -> None:
    removed = {**STATUS, "mixture": [dict(STATUS, name="code"), dict(STATUS, name="math")]}
    assert sample_room.room(mount_spec(), removed) == sample_room.room(mount_spec(), STATUS)
    assert sample_room.room(mixture_spec("code"), removed) == sample_room.room(
        mixture_spec("code"), {**STATUS, "mixture": [dict(STATUS, name="code")]}
    )


def test_a_source_of_the_spec_without_a_pin_gives_no_estimate() -> None:
    assert sample_room.room(mixture_spec("code", "math"), {**STATUS, "mixture": []}) is None


def test_admission_admits_the_pod_and_carries_the_warning() -> None:
    mount = {
        "apiVersion": "shardcache.io/v1alpha1",
        "kind": "DatasetMount",
        "metadata": {"name": "web", "namespace": "ml", "generation": 1},
        "spec": {"source": {"uri": "s3://data/web/"}, "sharding": {"granularity": "sample"}},
        "status": {
            "phase": "Ready",
            "observedGeneration": 1,
            "manifestDigest": DIGEST,
            **STATUS,
        },
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "trainer-0",
            "namespace": "ml",
            "labels": {injection.LABEL_MOUNT: "web"},
        },
        **gpu_pod(8),
    }
    pod["spec"]["containers"][0]["image"] = "python:3.11"
    decision = admission.decide(
        pod, namespace="ml", lookup=lambda ns, name: mount, defaults=DEFAULTS
    )
    assert decision.allowed and decision.injected == ("web",)
    # And (`volume_room`) 8 ranks of 128 MiB shards beside a 2Gi tier need more than
    # the run volume's 512Mi of headroom.
    assert len(decision.warnings) == 2
    assert decision.warnings[0].startswith("DatasetMount ml/web shuffles samples")
    assert decision.warnings[1].startswith("DatasetMount ml/web: the pod's run volume")

    pod["metadata"]["annotations"] = {injection.ANNOTATION_LOCAL_RANKS: "eight"}
    refused = admission.admit(pod, namespace="ml", lookup=lambda ns, name: mount, defaults=DEFAULTS)
    assert not refused.allowed
    assert "annotation shardcache.io/local-ranks: expected a positive integer, found 'eight'" in (
        refused.message
    )


async def no_secret(namespace: str, name: str) -> dict[str, str] | None:
    raise AssertionError("no Secret is named")


def never_probe(uri: str, options: Any) -> None:
    raise AssertionError("a new pin is resolved, not probed")


def answers(uri: str, options: Any, **_: object) -> None:
    """A source that answers the reachability probe of a kept pin."""


async def test_reconcile_says_once_per_generation_how_many_ranks_windows_the_tier_holds(
    tmp_path: Path,
) -> None:
    datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / "ds"), [100] * 12)
    uri = f"file://{tmp_path / 'ds'}"
    shard = manifests.resolve(uri).total_bytes // 12
    # A window of 50 rows: two of them touch 2 shards of 100 rows.
    obj: dict[str, Any] = {
        "apiVersion": "shardcache.io/v1alpha1",
        "kind": "DatasetMount",
        "metadata": {"name": "web", "namespace": "ml", "generation": 1},
        "spec": {
            "source": {"uri": uri},
            "sharding": {"granularity": "sample", "window": 50},
            "cache": {"memory": 5 * shard},
        },
    }

    async def run(probe: reconcile.Prober = never_probe) -> reconcile.Result:
        result = await reconcile.reconcile(
            obj, read_secret=no_secret, resolve=manifests_resolve, probe=probe, now="now"
        )
        obj["status"] = result.status
        return result

    def said(result: reconcile.Result) -> list[tuple[str, str]]:
        return [(e.type, e.reason) for e in result.events if "SampleWindows" in e.reason]

    first = await run()
    assert said(first) == [("Normal", "SampleWindows")]
    message = next(e.message for e in first.events if e.reason == "SampleWindows")
    assert "holds the sample-shuffle windows of about 2 ranks a pod" in message
    assert said(await run(answers)) == []  # the same generation again: nothing new

    obj["metadata"]["generation"] = 2
    obj["spec"]["cache"]["memory"] = shard
    warned = await run(answers)
    assert said(warned) == [("Warning", "SampleWindowsDoNotFit")]
    assert "cannot hold one rank's sample-shuffle windows" in warned.events[-1].message

    obj["metadata"]["generation"] = 3
    obj["spec"]["sharding"]["granularity"] = "block"
    assert said(await run(answers)) == []


def manifests_resolve(uri: str, fmt: str, options: Any) -> manifests.Manifest:
    return manifests.resolve(uri, format=fmt, storage_options=options)
