"""Bounded fuzzing of the spec parser and the admission path (issue 13, "Tests").

The invariant: any input gets a value or a clear refusal (`InputError`, an
AdmissionReview with `allowed: false` and a message), never another exception, which
the webhook would answer as a 500.
"""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

import jsonpatch
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shardcache_operator import admission, specs

from shardcache import errors
from tests.unit.test_injection import DEFAULTS, dsm, lookup_of, pod, review_request

pytestmark = pytest.mark.unit

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.sampled_from(["1e5000", "1e30", "-1Gi", "2Gi", "s3://k:s@b/x", "/", "..", "\x00", "8Ei"]),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=12,
)

SPEC_PATHS = [
    ("source", "uri"),
    ("source", "format"),
    ("source", "version"),
    ("source", "secretRef"),
    ("cache", "memory"),
    ("cache", "disk"),
    ("cache", "medium"),
    ("cache", "nodePath"),
    ("prefetch", "depth"),
    ("prefetch", "concurrency"),
    ("sharding", "seed"),
    ("sharding", "blockSize"),
    ("sharding", "worldSize"),
    ("sharding", "rankFrom"),
    ("sharding", "rank"),
    ("checkpoint", "uri"),
    ("checkpoint", "size"),
    ("sidecar", "image"),
    ("sidecar", "resources"),
    ("admission", "policy"),
    ("admission", "allowShareProcessNamespace"),
]


def mutated_spec(changes: list[tuple[tuple[str, str], Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = {"source": {"uri": "s3://bucket/train/"}}
    for (section, field), value in changes:
        part = spec.setdefault(section, {})
        if isinstance(part, dict):
            part[field] = value
    if "checkpoint" in spec:
        spec["checkpoint"].setdefault("uri", "s3://bucket/ckpt/")
    return spec


@FUZZ
@given(json_values)
def test_spec_parser_refuses_anything_with_an_input_error(data: Any) -> None:
    try:
        specs.parse_spec(data)
    except errors.InputError as exc:
        assert str(exc).startswith("spec")


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(SPEC_PATHS), json_values), max_size=5))
def test_spec_fields_with_hostile_values_parse_or_are_refused(
    changes: list[tuple[tuple[str, str], Any]],
) -> None:
    try:
        specs.parse_spec(mutated_spec(changes))
    except errors.InputError as exc:
        assert str(exc).startswith("spec")


def _review(obj: Any, *mounts: dict[str, Any]) -> dict[str, Any]:
    reply = admission.review(review_request(obj), lookup=lookup_of(*mounts), defaults=DEFAULTS)
    response = reply["response"]
    assert isinstance(response["allowed"], bool)
    if not response["allowed"]:
        assert response["status"]["code"] == 403 and response["status"]["message"]
    return response


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(SPEC_PATHS), json_values), max_size=4))
def test_admission_answers_any_datasetmount_spec(
    changes: list[tuple[tuple[str, str], Any]],
) -> None:
    mount = dsm("imagenet")
    mount["spec"] = {**mount["spec"], **mutated_spec(changes)}
    _review(pod(), mount)


@FUZZ
@given(
    st.dictionaries(
        st.sampled_from(
            [
                "hostNetwork",
                "shareProcessNamespace",
                "containers",
                "initContainers",
                "volumes",
                "ephemeralContainers",
            ]
        ),
        json_values,
        max_size=4,
    ),
    st.dictionaries(
        st.sampled_from(
            [
                "shardcache.io/injected",
                "shardcache.io/mounts",
                "shardcache.io/containers",
                "shardcache.io/world-size",
                "batch.kubernetes.io/job-completion-index",
            ]
        ),
        st.text(max_size=30),
        max_size=3,
    ),
    st.text(max_size=40),
)
def test_admission_answers_any_pod(
    spec: dict[str, Any], annotations: dict[str, str], label: str
) -> None:
    obj = pod(label=label or "imagenet")
    obj["spec"].update(copy.deepcopy(spec))
    obj["metadata"]["annotations"] = annotations
    _review(obj, dsm("imagenet"), dsm("captions"))


container_fields = st.dictionaries(
    st.sampled_from(["name", "volumeMounts", "volumeDevices", "env", "targetContainerName"]),
    json_values,
    max_size=4,
)


@FUZZ
@given(
    st.sampled_from(["containers", "initContainers", "ephemeralContainers"]),
    container_fields,
    st.one_of(json_values, st.just([{"name": "scratch", "emptyDir": {}}])),
)
def test_admission_answers_any_use_of_volumes_by_containers(
    key: str, container: dict[str, Any], volumes: Any
) -> None:
    obj = pod()
    obj["spec"].setdefault(key, []).append(copy.deepcopy(container))
    obj["spec"]["volumes"] = copy.deepcopy(volumes)
    _review(obj, dsm("imagenet"))


def _update_review(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    request = review_request(new)
    request["request"] |= {"operation": "UPDATE", "oldObject": old}
    response: dict[str, Any] = admission.review(request, lookup=lookup_of(), defaults=DEFAULTS)[
        "response"
    ]
    assert isinstance(response["allowed"], bool) and "patch" not in response
    if not response["allowed"]:
        assert response["status"]["code"] == 403 and response["status"]["message"]
    return response


@FUZZ
@given(
    st.sampled_from(["initContainers", "ephemeralContainers", "containers"]),
    container_fields,
    json_values,
)
def test_update_reviews_answer_any_change_of_an_injected_pod(
    key: str, container: dict[str, Any], replaced: Any
) -> None:
    """An UPDATE review never raises: a 500 would block the update (failurePolicy Fail)."""
    old = _review(pod(), dsm("imagenet"))
    stored = jsonpatch.apply_patch(pod(), json.loads(base64.b64decode(old["patch"])))
    new = copy.deepcopy(stored)
    new["spec"].setdefault(key, []).append(copy.deepcopy(container))
    _update_review(stored, new)
    new["spec"]["initContainers"][0] = copy.deepcopy(replaced)
    assert _update_review(stored, new)["allowed"] is False
