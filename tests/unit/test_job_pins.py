"""Every pod of one job reads the dataset its job's other pods read (`job_pins`).

A DatasetMount's `spec.source` edited while a Job runs pins a new digest; a rank's pod
replaced after that (preemption, node loss, a backoffLimit retry) must get the digest and
source its job's live pods were given, never the new ones: two datasets in one job.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from shardcache_operator import admission, job_pins, metrics, mounts, pod_counts, pod_watch, specs

from shardcache import contract, errors
from tests.unit.test_injection import DEFAULTS, DIGEST, dsm, env_of, lookup_of, pod, sidecars

pytestmark = pytest.mark.unit

OLD = "sha256:" + "0a" * 32
NEW = DIGEST
JOB_UID = "5b3c0b5e-0000-4000-8000-000000000001"


def job_pod(uid: str = JOB_UID, *, name: str = "train-1-abcde", **labels: str) -> dict[str, Any]:
    obj = pod()
    obj["metadata"]["name"] = name
    obj["metadata"]["labels"].update(
        {"batch.kubernetes.io/controller-uid": uid, "batch.kubernetes.io/job-name": "train"}
    )
    obj["metadata"]["labels"].update(labels)
    return obj


def injected_from(mount: dict[str, Any], obj: dict[str, Any]) -> dict[str, Any]:
    """`obj` as the webhook injects it today, from `mount` as it is now."""
    decision = admission.decide(obj, namespace="ml", lookup=lookup_of(mount), defaults=DEFAULTS)
    assert decision.allowed, decision.message
    return decision.pod


def siblings_of(*pods: dict[str, Any]) -> job_pins.Siblings:
    """The pod watch's view of `pods` (metadata only, as it lists them)."""
    index = pod_watch.Index()
    for obj in pods:
        metadata = obj["metadata"]
        job, pins = pod_watch.job_facts(metadata)
        index.set("ml", metadata["name"], pod_watch.mounts_of(obj), job, pins)
    return index.jobs


def edited(mount: dict[str, Any], uri: str, digest: str) -> dict[str, Any]:
    moved = json.loads(json.dumps(mount))
    moved["spec"]["source"]["uri"] = uri
    moved["status"]["manifestDigest"] = digest
    return moved


def sidecar_env(obj: dict[str, Any]) -> dict[str, Any]:
    (sidecar,) = sidecars(obj)
    return env_of(sidecar)


# -- which job a pod belongs to ---------------------------------------------------------


@pytest.mark.parametrize(
    ("labels", "key"),
    [
        ({"batch.kubernetes.io/controller-uid": "u1"}, "batch.kubernetes.io/controller-uid=u1"),
        ({"controller-uid": "u1"}, "batch.kubernetes.io/controller-uid=u1"),
        (
            {"jobset.sigs.k8s.io/jobset-uid": "js", "batch.kubernetes.io/controller-uid": "u1"},
            "jobset.sigs.k8s.io/jobset-uid=js",
        ),
        ({"jobset.sigs.k8s.io/jobset-name": "big"}, "jobset.sigs.k8s.io/jobset-name=big"),
        (
            {"leaderworkerset.sigs.k8s.io/group-key": "g0"},
            "leaderworkerset.sigs.k8s.io/group-key=g0",
        ),
        (
            {
                "training.kubeflow.org/operator-name": "pytorchjob-controller",
                "training.kubeflow.org/job-name": "llm",
            },
            "training.kubeflow.org/operator-name=pytorchjob-controller,"
            "training.kubeflow.org/job-name=llm",
        ),
        (
            {"shardcache.io/job": "run-7", "batch.kubernetes.io/controller-uid": "u1"},
            "shardcache.io/job=run-7",
        ),
    ],
)
def test_a_pods_job_is_named_by_its_controllers_labels_the_explicit_one_first(
    labels: dict[str, str], key: str
) -> None:
    job = job_pins.job_of({"labels": labels})
    assert job is not None and job.key == key


def test_a_pod_of_no_job_has_no_job_key() -> None:
    assert job_pins.job_of({"labels": {"app": "x"}}) is None
    assert job_pins.job_of({}) is None
    assert job_pins.job_of({"labels": "not a map"}) is None


# -- pins -------------------------------------------------------------------------------


def test_a_pin_reads_back_as_written_and_compares_by_text() -> None:
    spec = specs.parse_spec({"source": {"uri": "s3://b/p/", "format": "arrow"}})
    pin = job_pins.pin_of(spec, OLD, {})
    assert job_pins.decode(pin.text(), "here") == pin
    assert job_pins.decode(pin.text(), "here").text() == pin.text()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("not json", "expected JSON"),
        ('{"v": 99, "uri": "s3://b/"}', "expected pin version 1, found 99"),
        ('{"v": 1, "uri": "s3://b/", "digest": "md5:1"}', "expected sha256:<64 hex>"),
        ('{"v": 1, "uri": "s3://user:pw@b/", "digest": null}', "uri"),
        ('{"v": 1, "uri": "s3://b/", "mixture": "x"}', "expected a list"),
    ],
)
def test_a_pin_that_cannot_be_read_says_what_was_expected(text: str, expected: str) -> None:
    with pytest.raises(errors.InputError, match="here") as raised:
        job_pins.decode(text, "here")
    assert expected in str(raised.value)


# -- which pin a pod of a job gets ------------------------------------------------------

JOB = job_pins.Job("k", "Job train")


def pin(uri: str, digest: str) -> job_pins.Pin:
    return job_pins.Pin((job_pins.SourcePin(uri, "parquet", None, digest),))


def test_a_job_without_live_pods_gets_the_mounts_current_pin() -> None:
    served = job_pins.serve("m", pod="p", job=JOB, current=pin("s3://new/", NEW), siblings={})
    assert served.pin is None


def test_a_job_whose_pods_read_the_current_pin_keeps_it_quietly() -> None:
    now = pin("s3://new/", NEW)
    served = job_pins.serve(
        "m", pod="p", job=JOB, current=now, siblings={now.text(): frozenset({"a"})}
    )
    assert served == job_pins.Served(None)


def test_a_job_whose_pods_read_an_older_pin_gets_that_one_and_is_told() -> None:
    old = pin("s3://old/", OLD)
    served = job_pins.serve(
        "DatasetMount ml/m",
        pod="p",
        job=JOB,
        current=pin("s3://new/", NEW),
        siblings={old.text(): frozenset({"a"})},
    )
    assert served.pin == old
    assert f"pod p of Job train gets digest {OLD}" in served.message
    assert f"DatasetMount ml/m now pins {NEW}" in served.message


def test_a_job_whose_pods_already_disagree_is_refused_naming_both() -> None:
    siblings = {
        pin("s3://old/", OLD).text(): frozenset({"a"}),
        pin("s3://new/", NEW).text(): frozenset({"b"}),
    }
    with pytest.raises(errors.InputError) as raised:
        job_pins.serve("m", pod="p", job=JOB, current=pin("s3://new/", NEW), siblings=siblings)
    message = str(raised.value)
    assert f"{OLD} by a" in message and f"{NEW} by b" in message
    assert "expected one" in message and "create a new one" in message


def test_a_job_pin_that_cannot_be_recovered_refuses_the_pod() -> None:
    with pytest.raises(errors.InputError, match="cannot be recovered"):
        job_pins.serve(
            "m",
            pod="p",
            job=JOB,
            current=pin("s3://new/", NEW),
            siblings={'{"v":2}': frozenset({"a"})},
        )


def test_a_mixture_pin_keeps_every_source_and_refuses_a_changed_source_list() -> None:
    spec = specs.parse_spec(
        {
            "source": {"uri": "s3://web/"},
            "mixture": {"sources": [{"name": "code", "weight": 1, "uri": "s3://code/"}]},
        }
    )
    old = job_pins.pin_of(spec, OLD, {"code": OLD})
    moved = specs.parse_spec(
        {
            "source": {"uri": "s3://web2/"},
            "mixture": {"sources": [{"name": "code", "weight": 2, "uri": "s3://code2/"}]},
        }
    )
    back = job_pins.apply(moved, old, "m")
    assert back.source.uri == "s3://web/"
    assert back.mixture is not None
    assert [(s.uri, s.weight) for s in back.mixture.sources] == [("s3://code/", 2)]
    more = specs.parse_spec(
        {
            "source": {"uri": "s3://web/"},
            "mixture": {
                "sources": [
                    {"name": "code", "weight": 1, "uri": "s3://code/"},
                    {"name": "math", "weight": 1, "uri": "s3://math/"},
                ]
            },
        }
    )
    with pytest.raises(errors.InputError, match=r"now has spec\.source and code, math"):
        job_pins.apply(more, old, "m")


# -- through admission ------------------------------------------------------------------


def test_a_jobs_pod_admitted_after_a_source_edit_gets_the_jobs_dataset() -> None:
    before = dsm("imagenet")
    before["status"]["manifestDigest"] = OLD
    first = injected_from(before, job_pod(name="train-0-aaaaa"))
    after = edited(before, "s3://data/imagenet-v2/", NEW)

    decision = admission.decide(
        job_pod(name="train-1-bbbbb"),
        namespace="ml",
        lookup=lookup_of(after),
        defaults=DEFAULTS,
        siblings={"imagenet": siblings_of(first).pins("ml", f"{_UID_KEY}", "imagenet")},
    )
    assert decision.allowed, decision.message
    env = sidecar_env(decision.pod)
    assert env[contract.ENV_MANIFEST_DIGEST] == OLD
    assert env[contract.ENV_SOURCE_URI] == "s3://data/imagenet/"
    assert env == sidecar_env(first)  # every injected setting, not just the digest
    ((name, reason, message),) = decision.events
    assert (name, reason) == ("imagenet", admission.REASON_JOB_PIN)
    assert f"gets digest {OLD}" in message and f"now pins {NEW}" in message
    assert any(f"gets digest {OLD}" in w for w in decision.warnings)


def test_a_jobs_pod_given_its_jobs_older_pin_is_handed_no_manifest() -> None:
    """The operator's ConfigMaps hand the mount's current pin: under the older pin's file
    names its sidecar would only find another manifest (refused with a warning), so the
    webhook mounts none; the job's first pod, and another job's, get theirs."""
    handing = dataclasses.replace(DEFAULTS, manifest_namespaces=("ml",))

    def handed_volumes(obj: dict[str, Any]) -> list[str]:
        return [v["name"] for v in obj["spec"]["volumes"] if "projected" in v]

    before = dsm("imagenet")
    before["status"]["manifestDigest"] = OLD
    first = admission.decide(
        job_pod(name="train-0-aaaaa"), namespace="ml", lookup=lookup_of(before), defaults=handing
    ).pod
    assert handed_volumes(first) == ["shardcache-imagenet-mfst"]
    after = edited(before, "s3://data/imagenet-v2/", NEW)
    known = siblings_of(first)
    later = admission.decide(
        job_pod(name="train-1-bbbbb"),
        namespace="ml",
        lookup=lookup_of(after),
        defaults=handing,
        siblings={"imagenet": known.pins("ml", f"{_UID_KEY}", "imagenet")},
    )
    assert later.allowed and sidecar_env(later.pod)[contract.ENV_MANIFEST_DIGEST] == OLD
    assert handed_volumes(later.pod) == []
    other = admission.decide(
        job_pod("another-uid", name="eval-0-ccccc"),
        namespace="ml",
        lookup=lookup_of(after),
        defaults=handing,
        siblings={
            "imagenet": known.pins(
                "ml", "batch.kubernetes.io/controller-uid=another-uid", "imagenet"
            )
        },
    )
    assert sidecar_env(other.pod)[contract.ENV_MANIFEST_DIGEST] == NEW
    assert handed_volumes(other.pod) == ["shardcache-imagenet-mfst"]


def test_a_pod_of_another_job_gets_the_mounts_new_dataset() -> None:
    before = dsm("imagenet")
    before["status"]["manifestDigest"] = OLD
    first = injected_from(before, job_pod(name="train-0-aaaaa"))
    after = edited(before, "s3://data/imagenet-v2/", NEW)
    other = job_pod("another-uid", name="eval-0-ccccc")
    known = siblings_of(first)
    decision = admission.decide(
        other,
        namespace="ml",
        lookup=lookup_of(after),
        defaults=DEFAULTS,
        siblings={"imagenet": known.pins("ml", "batch.kubernetes.io/controller-uid=another-uid",
                                         "imagenet")},
    )  # fmt: skip
    assert decision.allowed, decision.message
    env = sidecar_env(decision.pod)
    assert env[contract.ENV_MANIFEST_DIGEST] == NEW
    assert env[contract.ENV_SOURCE_URI] == "s3://data/imagenet-v2/"
    assert not decision.events


def test_a_pods_own_pins_annotation_is_replaced_by_what_was_injected() -> None:
    forged = job_pod()
    forged["metadata"]["annotations"] = {
        job_pins.ANNOTATION_PINS: json.dumps({"imagenet": {"v": 1, "uri": "s3://evil/"}})
    }
    stored = injected_from(dsm("imagenet"), forged)
    pins = job_pins.annotation_pins(stored["metadata"]["annotations"])
    assert job_pins.decode(pins["imagenet"], "x").sources[0].uri == "s3://data/imagenet/"
    assert job_pins.decode(pins["imagenet"], "x").digest == DIGEST


def test_the_pod_watch_forgets_a_finished_pods_pin() -> None:
    first = injected_from(dsm("imagenet"), job_pod(name="train-0-aaaaa"))
    index = pod_watch.Index()
    job, pins = pod_watch.job_facts(first["metadata"])
    index.set("ml", "train-0-aaaaa", ("imagenet",), job, pins)
    assert index.jobs.pins("ml", _UID_KEY, "imagenet")
    index.set("ml", "train-0-aaaaa", ())
    assert index.jobs.pins("ml", _UID_KEY, "imagenet") == {}
    index.set("ml", "train-0-aaaaa", ("imagenet",), job, pins)
    index.replace({})
    assert index.jobs.pins("ml", _UID_KEY, "imagenet") == {}


_UID_KEY = f"batch.kubernetes.io/controller-uid={JOB_UID}"


# -- how many pods still read an older pin ----------------------------------------------


async def test_pods_still_reading_an_older_pin_are_counted_per_mount() -> None:
    before = dsm("imagenet")
    before["status"]["manifestDigest"] = OLD
    old_pod = injected_from(before, job_pod(name="train-0-aaaaa"))
    after = edited(before, "s3://data/imagenet-v2/", NEW)
    new_pod = injected_from(after, job_pod("another-uid", name="eval-0-ccccc"))
    index = pod_watch.Index()
    for obj in (old_pod, new_pod):
        job, pins = pod_watch.job_facts(obj["metadata"])
        index.set("ml", obj["metadata"]["name"], ("imagenet",), job, pins)
    index.set("ml", "legacy-0", ("imagenet",))  # injected before pins were written: unknown
    assert index.older("ml", "imagenet", NEW) == 1
    assert index.older("ml", "imagenet", OLD) == 1

    writer, meters = pod_counts.Writer(), metrics.Metrics()

    async def write(namespace: str, name: str, count: int) -> None:
        return None

    known = mounts.Store()
    known.listed([after])
    writer.touch(index, known)
    await writer.flush(write, meters)
    labels = {"namespace": "ml", "datasetmount": "imagenet"}
    sample = meters.registry.get_sample_value
    assert sample("shardcache_operator_pods_on_older_pin", labels) == 1
    index.set("ml", "train-0-aaaaa", ())  # the old Job's pod finished
    await writer.flush(write, meters)
    assert sample("shardcache_operator_pods_on_older_pin", labels) == 0
