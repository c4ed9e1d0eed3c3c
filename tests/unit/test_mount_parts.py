"""The webhook's cache of each mount's built volumes and sidecar (issue 18)."""

from __future__ import annotations

from typing import Any

import pytest
from shardcache_operator import injection, mount_parts, specs

pytestmark = pytest.mark.unit

DEFAULTS = injection.SidecarDefaults(image="shardcache-sidecar:test")
DIGEST = "sha256:" + "cd" * 32


def mount(name: str = "data", **spec: Any) -> injection.Mount:
    body = {"source": {"uri": f"s3://b/{name}/"}, **spec}
    return injection.Mount(name, specs.parse_spec(body), DIGEST, namespace="ml")


def pod(**annotations: str) -> dict[str, Any]:
    return {
        "metadata": {"name": "p", "annotations": dict(annotations)},
        "spec": {"containers": [{"name": "trainer", "image": "t"}]},
    }


def test_a_cached_injection_equals_an_uncached_one_pod_after_pod() -> None:
    cache = mount_parts.Cache()
    m = mount(sharding={"seed": 4}, checkpoint={"uri": "s3://c/r/"})
    for _ in range(3):
        assert injection.inject(pod(), [m], defaults=DEFAULTS, cache=cache) == injection.inject(
            pod(), [m], defaults=DEFAULTS
        )
    assert len(cache) == 1


def test_pods_of_one_mount_share_one_built_sidecar() -> None:
    cache = mount_parts.Cache()
    m = mount()
    first = injection.inject(pod(), [m], defaults=DEFAULTS, cache=cache)
    second = injection.inject(pod(), [m], defaults=DEFAULTS, cache=cache)
    assert first["spec"]["initContainers"][0] is second["spec"]["initContainers"][0]
    # Each pod's own containers are its own: the trainer env is written per pod.
    assert first["spec"]["containers"][0] is not second["spec"]["containers"][0]


def test_another_spec_object_or_pod_input_builds_anew() -> None:
    cache = mount_parts.Cache()
    m = mount()
    base = injection.inject(pod(), [m], defaults=DEFAULTS, cache=cache)
    # A new generation parses to a new spec object: never the old one's parts.
    changed = mount(prefetch={"depth": 9})
    again = injection.inject(pod(), [changed], defaults=DEFAULTS, cache=cache)
    env = {e["name"]: e.get("value") for e in again["spec"]["initContainers"][0]["env"]}
    assert env["SHARDCACHE_PREFETCH_DEPTH"] == "9"
    # The pod's own world-size annotation is part of the key.
    sized = injection.inject(
        pod(**{injection.ANNOTATION_WORLD_SIZE: "8"}), [m], defaults=DEFAULTS, cache=cache
    )
    env = {e["name"]: e.get("value") for e in sized["spec"]["initContainers"][0]["env"]}
    assert env["SHARDCACHE_WORLD_SIZE"] == "8"
    assert base["spec"]["initContainers"][0] is not sized["spec"]["initContainers"][0]
    assert len(cache) == 3


def test_the_cache_keeps_only_the_most_recently_used_entries() -> None:
    cache = mount_parts.Cache(size=2)
    mounts = [mount(f"m{i}") for i in range(3)]
    for m in mounts:
        injection.inject(pod(), [m], defaults=DEFAULTS, cache=cache)
    assert len(cache) == 2
    kept = injection.inject(pod(), [mounts[2]], defaults=DEFAULTS, cache=cache)
    assert len(cache) == 2
    assert kept == injection.inject(pod(), [mounts[2]], defaults=DEFAULTS)


def test_the_admitted_pod_itself_is_never_changed() -> None:
    cache = mount_parts.Cache()
    original = pod()
    snapshot = {
        "metadata": {"name": "p", "annotations": {}},
        "spec": {"containers": [{"name": "trainer", "image": "t"}]},
    }
    injection.inject(original, [mount()], defaults=DEFAULTS, cache=cache)
    assert original == snapshot
