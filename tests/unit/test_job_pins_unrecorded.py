"""Job pins where the job's pods carry no pin the webhook wrote (`job_pins`).

Pods injected by a webhook from before job pins carry no `shardcache.io/pins`: a later
rank of such a job must not silently get the mount's current pin when its siblings may
read an earlier one. And a pin a pod's author wrote on a pod admitted without the cache
must never be served to the job's later pods.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from shardcache_operator import (
    admission,
    injection,
    job_pins,
    metrics,
    mounts,
    pod_counts,
    pod_watch,
)

from shardcache import contract
from tests.unit.test_injection import DEFAULTS, dsm, lookup_of
from tests.unit.test_job_pins import JOB_UID, NEW, OLD, edited, injected_from, job_pod, sidecar_env

pytestmark = pytest.mark.unit

RESOLVED_AT = "2026-11-28T10:00:00Z"
BEFORE = "2026-11-28T09:00:00Z"
AFTER = "2026-11-28T11:00:00Z"


def mount(digest: str = NEW, uri: str = "s3://data/imagenet/") -> dict[str, Any]:
    """The DatasetMount `imagenet` pinned to `digest`, resolved at RESOLVED_AT."""
    obj = edited(dsm("imagenet"), uri, digest)
    obj["status"]["resolvedAt"] = RESOLVED_AT
    return obj


def pre_pin(obj: dict[str, Any], created: str) -> dict[str, Any]:
    """`obj` as a webhook from before job pins left it: injected, no pins annotation."""
    stored = json.loads(json.dumps(obj))
    del stored["metadata"]["annotations"][job_pins.ANNOTATION_PINS]
    stored["metadata"]["creationTimestamp"] = created
    return stored


def watched(*pods: dict[str, Any]) -> pod_watch.Index:
    """The pod watch's index after an ADDED event of each pod (metadata only)."""
    watcher = pod_watch.Watcher(pod_watch.Index(), metrics.Metrics(), lambda: None)
    for obj in pods:
        watcher.apply("ADDED", {"metadata": obj["metadata"], "status": {"phase": "Running"}})
    return watcher.index


def admit_later_rank(index: pod_watch.Index, now: dict[str, Any]) -> admission.Decision:
    """A later rank of the job admitted as the webhook does (`webhook.decide`)."""
    later = job_pod(name="train-3-ddddd")
    job = job_pins.job_of(later["metadata"])
    assert job is not None
    return admission.decide(
        later,
        namespace="ml",
        lookup=lookup_of(now),
        defaults=DEFAULTS,
        siblings={"imagenet": index.jobs.pins("ml", job.key, "imagenet")},
        unpinned={"imagenet": index.jobs.unpinned("ml", job.key, "imagenet")},
    )


# -- the decision ------------------------------------------------------------------------


def test_pods_without_a_pin_created_after_the_resolve_read_the_current_pin() -> None:
    found = job_pins.unpinned(
        {"a": AFTER, "b": "2026-11-28T10:00:30Z", "c": BEFORE, "d": None, "e": "yesterday"},
        RESOLVED_AT,
    )
    assert found.current == {"a"}
    # Within the margin of the resolve, before it, or of no readable time: not known.
    assert found.unknown == {"b", "c", "d", "e"}
    assert job_pins.unpinned({"a": AFTER}, None).unknown == {"a"}
    assert job_pins.unpinned({}, RESOLVED_AT) == job_pins.Unpinned(resolved_at=RESOLVED_AT)


# -- through the pod watch and the admission ---------------------------------------------


def test_a_later_rank_of_a_job_injected_before_pins_and_before_the_resolve_is_refused() -> None:
    earlier = pre_pin(injected_from(mount(OLD), job_pod(name="train-0-aaaaa")), BEFORE)
    now = mount(NEW, "s3://data/imagenet-v2/")
    decision = admit_later_rank(watched(earlier), now)
    assert not decision.allowed
    assert "train-0-aaaaa" in decision.message and "Job train" in decision.message
    assert RESOLVED_AT in decision.message and "create a new one" in decision.message
    assert [(name, reason) for name, reason, _ in decision.events] == [
        ("imagenet", admission.REASON_JOB_PIN_UNKNOWN)
    ]
    assert admission.REASON_JOB_PIN_UNKNOWN not in admission.NORMAL_REASONS


def test_a_later_rank_of_a_job_injected_before_pins_after_the_resolve_gets_it_quietly() -> None:
    now = mount(NEW, "s3://data/imagenet-v2/")
    earlier = pre_pin(injected_from(now, job_pod(name="train-0-aaaaa")), AFTER)
    decision = admit_later_rank(watched(earlier), now)
    assert decision.allowed, decision.message
    assert sidecar_env(decision.pod)[contract.ENV_MANIFEST_DIGEST] == NEW
    assert not decision.events and not decision.warnings


def test_an_unpinned_pod_on_the_current_pin_beside_a_pinned_older_one_is_a_refusal() -> None:
    now = mount(NEW, "s3://data/imagenet-v2/")
    unpinned = pre_pin(injected_from(now, job_pod(name="train-0-aaaaa")), AFTER)
    pinned = injected_from(mount(OLD), job_pod(name="train-1-bbbbb"))
    decision = admit_later_rank(watched(unpinned, pinned), now)
    assert not decision.allowed
    assert f"{OLD} by train-1-bbbbb" in decision.message
    assert f"{NEW} by train-0-aaaaa" in decision.message


def test_a_jobs_pod_admitted_without_the_cache_is_no_unpinned_sibling() -> None:
    """A pod admitted without the cache (no `shardcache.io/injected`) read nothing."""
    plain = job_pod(name="train-0-aaaaa")
    plain["metadata"]["creationTimestamp"] = BEFORE
    decision = admit_later_rank(watched(plain), mount())
    assert decision.allowed, decision.message


async def test_pods_of_an_older_webhook_created_before_the_resolve_count_as_on_an_older_pin() -> (
    None
):
    now = mount(NEW, "s3://data/imagenet-v2/")
    before = pre_pin(injected_from(mount(OLD), job_pod(name="train-0-aaaaa")), BEFORE)
    after = pre_pin(injected_from(now, job_pod("other", name="eval-0-ccccc")), AFTER)
    index = watched(before, after)
    writer, meters = pod_counts.Writer(), metrics.Metrics()

    async def write(namespace: str, name: str, count: int) -> None:
        return None

    known = mounts.Store()
    known.listed([now])
    writer.touch(index, known)
    await writer.flush(write, meters)
    labels = {"namespace": "ml", "datasetmount": "imagenet"}
    assert meters.registry.get_sample_value("shardcache_operator_pods_on_older_pin", labels) == 1


# -- pins a pod's author wrote -----------------------------------------------------------


def forged(obj: dict[str, Any]) -> dict[str, Any]:
    obj["metadata"]["annotations"] = {
        job_pins.ANNOTATION_PINS: json.dumps(
            {"imagenet": {"v": 1, "uri": "s3://evil/", "format": "parquet", "digest": OLD}}
        ),
        "team": "vision",
    }
    return obj


def test_a_pod_admitted_without_the_cache_loses_the_pins_its_author_wrote() -> None:
    waiting = mount()
    waiting["status"]["phase"] = "Pending"
    waiting["spec"]["admission"] = {"policy": "Admit"}
    decision = admission.decide(
        forged(job_pod(name="train-0-aaaaa")),
        namespace="ml",
        lookup=lookup_of(waiting),
        defaults=DEFAULTS,
    )
    assert decision.allowed and not decision.injected
    assert decision.pod["metadata"]["annotations"] == {"team": "vision"}
    assert decision.patch == [
        {"op": "replace", "path": "/metadata/annotations", "value": {"team": "vision"}}
    ]


def test_a_forged_pin_on_a_pod_admitted_without_the_cache_does_not_steer_later_ranks() -> None:
    missing = forged(job_pod(name="train-0-aaaaa"))
    stored = admission.decide(
        missing, namespace="ml", lookup=lookup_of(), defaults=DEFAULTS, missing_policy="Admit"
    ).pod
    index = watched(stored)
    later = job_pod(name="train-3-ddddd")
    key = f"batch.kubernetes.io/controller-uid={JOB_UID}"
    decision = admission.decide(
        later,
        namespace="ml",
        lookup=lookup_of(mount()),
        defaults=DEFAULTS,
        siblings={"imagenet": index.jobs.pins("ml", key, "imagenet")},
    )
    assert decision.allowed, decision.message
    env = sidecar_env(decision.pod)
    assert env[contract.ENV_SOURCE_URI] == "s3://data/imagenet/"
    assert env[contract.ENV_MANIFEST_DIGEST] == NEW


def test_a_pod_with_nothing_to_strip_is_admitted_without_a_patch() -> None:
    assert injection.without_unearned_pins(job_pod()) is None
    decision = admission.decide(
        job_pod(), namespace="ml", lookup=lookup_of(), defaults=DEFAULTS, missing_policy="Admit"
    )
    assert decision.allowed and decision.patch == []
