"""Admission warns a pod whose local ranks' evicted-but-mapped shards would not fit in
the run volume's headroom over the memory tier (`volume_room`; explorer report D1: 8
ranks deadlocked on the volume the webhook sized)."""

from __future__ import annotations

from typing import Any

import pytest
from shardcache_operator import admission, injection, specs, volume_room

pytestmark = pytest.mark.unit

MiB = 1 << 20
DIGEST = "sha256:" + "0f" * 32
DEFAULTS = injection.SidecarDefaults(image="shardcache-sidecar:test")


def mount_spec(memory: str = "2Gi", **extra: Any) -> specs.DatasetMountSpec:
    body = {"source": {"uri": "s3://data/web/"}, "cache": {"memory": memory}, **extra}
    return specs.load(
        {
            "apiVersion": "shardcache.io/v1alpha1",
            "kind": "DatasetMount",
            "metadata": {"name": "web"},
            "spec": body,
        }
    ).spec


def gpu_pod(gpus: int, ranks: str | None = None) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "spec": {
            "containers": [
                {"name": "trainer", "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}
            ]
        }
    }
    if ranks is not None:
        pod["metadata"] = {"annotations": {injection.ANNOTATION_LOCAL_RANKS: ranks}}
    return pod


def pinned(shards: int, shard_bytes: int) -> dict[str, int]:
    return {"shards": shards, "rows": shards * 1000, "bytes": shards * shard_bytes}


def test_eight_ranks_of_shards_larger_than_an_eighth_of_the_headroom_are_warned() -> None:
    # 2Gi tier, 2560Mi volume: 512Mi of headroom; 8 ranks of 100 MiB shards need 800Mi.
    said = volume_room.warning(
        "DatasetMount ml/web", mount_spec(), pinned(48, 100 * MiB), gpu_pod(8)
    )
    assert said is not None
    assert said.startswith("DatasetMount ml/web: the pod's run volume (2.5Gi: ")
    assert "spec.cache.memory 2Gi plus 512Mi of headroom" in said
    assert "8 ranks (one per accelerator the pod asks for) each keep one" in said
    assert "at least 100Mi" in said and "800Mi or more in all" in said
    assert "Raise spec.cache.memory to at least 3.1Gi" in said  # 4 x 800Mi
    assert injection.ANNOTATION_LOCAL_RANKS in said


def test_the_memory_named_gives_headroom_for_every_ranks_shard() -> None:
    for ranks, shard in [(8, 100 * MiB), (3, 7_654_321), (1, 1)]:
        memory = volume_room.memory_needed(ranks, shard)
        assert volume_room.headroom(memory) >= ranks * shard
        assert memory % MiB == 0
    assert volume_room.memory_needed(8, 100 * MiB) == 3200 * MiB


def test_no_warning_where_the_shards_fit_the_headroom() -> None:
    # The docs' assumption: a tier of four or more shards per rank.
    assert volume_room.warning("m", mount_spec(), pinned(48, 64 * MiB), gpu_pod(8)) is None
    assert volume_room.warning("m", mount_spec(), pinned(48, 100 * MiB), gpu_pod(8, "1")) is None
    assert volume_room.warning("m", mount_spec(), pinned(48, 100 * MiB), gpu_pod(0)) is None


def test_the_local_ranks_annotation_counts_instead_of_the_accelerators() -> None:
    said = volume_room.warning("m", mount_spec(), pinned(48, 100 * MiB), gpu_pod(0, "6"))
    assert said is not None
    assert "6 ranks (as its shardcache.io/local-ranks annotation says)" in said


def test_no_estimate_without_a_pin_and_the_largest_source_of_a_mixture_counts() -> None:
    assert volume_room.warning("m", mount_spec(), {}, gpu_pod(8)) is None
    spec = mount_spec(
        mixture={
            "sources": [
                {"name": "code", "uri": "s3://data/code/", "weight": 1},
                {"name": "math", "uri": "s3://data/math/", "weight": 1},
            ]
        }
    )
    status = {
        "mixture": [
            {"name": "code", **pinned(10, 10 * MiB)},
            {"name": "math", **pinned(10, 100 * MiB)},
        ]
    }
    assert volume_room.average_shard_bytes(spec, status) == 100 * MiB
    assert volume_room.average_shard_bytes(spec, {"mixture": status["mixture"][:1]}) is None


def test_admission_admits_the_pod_and_carries_the_warning() -> None:
    mount = {
        "apiVersion": "shardcache.io/v1alpha1",
        "kind": "DatasetMount",
        "metadata": {"name": "web", "namespace": "ml", "generation": 1},
        "spec": {"source": {"uri": "s3://data/web/"}},
        "status": {
            "phase": "Ready",
            "observedGeneration": 1,
            "manifestDigest": DIGEST,
            **pinned(48, 100 * MiB),
        },
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "t-0", "namespace": "ml", "labels": {injection.LABEL_MOUNT: "web"}},
        **gpu_pod(8),
    }
    pod["spec"]["containers"][0]["image"] = "python:3.11"
    decision = admission.decide(
        pod, namespace="ml", lookup=lambda ns, name: mount, defaults=DEFAULTS
    )
    assert decision.allowed and decision.injected == ("web",)
    assert [w.split(":")[0] for w in decision.warnings] == ["DatasetMount ml/web"]
    assert "the pod's run volume" in decision.warnings[0]
