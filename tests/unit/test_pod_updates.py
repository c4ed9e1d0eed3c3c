"""UPDATE reviews of opted-in pods: nothing may reach what only the injected sidecar holds
(its Secret, in its env and as files; the node disk tier) after admission, and everything else passes untouched.

AdmissionReview v1 UPDATE payloads as the API server sends them: of the pod itself
(`kubectl patch`, `kubectl set image`) and of its `ephemeralcontainers` subresource
(`kubectl debug`). docs/security.md, "A pod author".
"""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
from shardcache_operator import admission, pod_updates

from shardcache import contract
from tests.unit.test_injection import DEFAULTS, admit, dsm, pod, sidecars

pytestmark = pytest.mark.unit

UID = "0b9f3c52-5f0e-4c33-9b51-3ad0f1b2c001"


def injected(**spec: Any) -> dict[str, Any]:
    """A pod as the API server stored it after the webhook injected DatasetMount imagenet
    (with checkpoints and a secretRef, so it has a run, a disk, a checkpoint and a
    credentials volume)."""
    response, stored = admit(
        pod(**spec), dsm("imagenet", checkpoint={"uri": "s3://ckpt/imagenet/"})
    )
    assert response["allowed"] is True
    return stored


def no_lookup(_namespace: str, name: str) -> None:
    raise AssertionError(f"an UPDATE review read DatasetMount {name}")


def update(
    old: dict[str, Any], new: dict[str, Any], *, subresource: str | None = None
) -> dict[str, Any]:
    """The AdmissionReview response to the UPDATE of `old` into `new`."""
    request: dict[str, Any] = {
        "uid": UID,
        "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"},
        "namespace": "ml",
        "operation": "UPDATE",
        "userInfo": {"username": "alice"},
        "object": new,
        "oldObject": old,
        "dryRun": False,
    }
    if subresource is not None:
        request["subResource"] = subresource
    reply = admission.review(
        {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request},
        lookup=no_lookup,
        defaults=DEFAULTS,
    )
    response: dict[str, Any] = reply["response"]
    assert response["uid"] == UID
    return response


def debugged(old: dict[str, Any], **container: Any) -> dict[str, Any]:
    """`old` with an ephemeral container added, as `kubectl debug` sends it."""
    new = copy.deepcopy(old)
    body = {"name": "debugger", "image": "busybox", "command": ["sh"], **container}
    new["spec"].setdefault("ephemeralContainers", []).append(body)
    return new


def sidecar_index(stored: dict[str, Any]) -> int:
    (sidecar,) = sidecars(stored)
    index: int = stored["spec"]["initContainers"].index(sidecar)
    return index


def test_patching_the_injected_sidecars_image_is_refused_naming_the_container() -> None:
    """Issue: the sidecar's image was swappable after admission, and that image would
    run with the mount's Secret and the node disk tier."""
    old = injected()
    new = copy.deepcopy(old)
    new["spec"]["initContainers"][sidecar_index(old)]["image"] = "evil.example/dump:1"
    response = update(old, new)
    assert response["allowed"] is False
    assert response["status"]["code"] == 403
    message = response["status"]["message"]
    assert message.startswith("init container 'shardcache-imagenet' is the cache sidecar of ")
    assert "DatasetMount imagenet" in message
    assert "expected it exactly as injected, found it changed: image" in message
    assert "patch" not in response


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("command", ["sh", "-c", "cat /proc/self/environ"]),
        ("imagePullPolicy", "Always"),
        ("envFrom", [{"secretRef": {"name": "other"}}]),
        ("securityContext", {"runAsUser": 0}),
    ],
)
def test_any_other_change_to_the_injected_sidecar_is_refused(field: str, value: Any) -> None:
    old = injected()
    new = copy.deepcopy(old)
    new["spec"]["initContainers"][sidecar_index(old)][field] = value
    response = update(old, new)
    assert response["allowed"] is False
    assert f"found it changed: {field}" in response["status"]["message"]


def test_removing_the_label_in_the_same_update_does_not_free_the_sidecar() -> None:
    # The API server's objectSelector matches the old object as well; the review
    # judges the sidecar by the pod as it was, not by the label it now has.
    old = injected()
    new = copy.deepcopy(old)
    del new["metadata"]["labels"]
    new["metadata"]["annotations"] = {}
    new["spec"]["initContainers"][sidecar_index(old)]["image"] = "evil.example/dump:1"
    assert update(old, new)["allowed"] is False


def test_an_update_that_leaves_the_sidecar_alone_is_admitted_without_a_patch() -> None:
    old = injected(initContainers=[{"name": "setup", "image": "busybox:1"}])
    new = copy.deepcopy(old)
    new["spec"]["containers"][0]["image"] = "python:3.12"
    new["spec"]["initContainers"][0]["image"] = "busybox:2"  # the user's own
    new["spec"]["activeDeadlineSeconds"] = 3600
    new["metadata"]["labels"]["team"] = "vision"
    new["metadata"]["finalizers"] = []
    response = update(old, new)
    assert response == {"uid": UID, "allowed": True}


def test_an_update_of_a_pod_without_an_injected_sidecar_is_admitted_at_once() -> None:
    # A labelled pod admitted without the cache (policy Admit), or before it opted in.
    old = pod(initContainers=[{"name": "setup", "image": "busybox:1"}])
    new = copy.deepcopy(old)
    new["spec"]["initContainers"][0]["image"] = "busybox:2"
    assert update(old, new) == {"uid": UID, "allowed": True}
    assert pod_updates.injected_containers(old) == {}


def test_a_debug_container_targeting_the_sidecar_is_refused() -> None:
    """kubectl debug --target=<sidecar>: the debug container would share the sidecar's
    process namespace and read its /proc/<pid>/environ, the Secret."""
    old = injected()
    new = debugged(old, targetContainerName="shardcache-imagenet")
    response = update(old, new, subresource=pod_updates.EPHEMERAL_SUBRESOURCE)
    assert response["allowed"] is False
    message = response["status"]["message"]
    assert message.startswith(
        "ephemeral container 'debugger' (spec.ephemeralContainers[0]) targets "
        "'shardcache-imagenet', the cache sidecar of DatasetMount imagenet"
    )
    assert "expected a target among the pod's containers (trainer), or none" in message


@pytest.mark.parametrize("field", ["volumeMounts", "volumeDevices"])
def test_a_debug_container_mounting_the_node_disk_tier_is_refused(field: str) -> None:
    old = injected()
    entry = {"name": "shardcache-imagenet-disk"}
    entry |= {"mountPath": "/loot"} if field == "volumeMounts" else {"devicePath": "/dev/x"}
    new = debugged(old, **{field: [entry]})
    response = update(old, new, subresource=pod_updates.EPHEMERAL_SUBRESOURCE)
    assert response["allowed"] is False
    message = response["status"]["message"]
    assert "mounts 'shardcache-imagenet-disk', a volume only the cache sidecar mounts" in message


def test_a_debug_container_mounting_the_sources_credentials_is_refused() -> None:
    """The Secret's files (`pod_volumes.credentials_volume`) are the sidecar's alone, as
    its env is: a debug container may not mount them, whatever it targets."""
    old = injected()
    (sidecar,) = sidecars(old)
    assert "shardcache-imagenet-cred" in {m["name"] for m in sidecar["volumeMounts"]}
    for target in ({}, {"targetContainerName": "trainer"}):
        entry = {"name": "shardcache-imagenet-cred", "mountPath": "/loot"}
        new = debugged(old, volumeMounts=[entry], **target)
        response = update(old, new, subresource=pod_updates.EPHEMERAL_SUBRESOURCE)
        assert response["allowed"] is False
        message = response["status"]["message"]
        assert message.startswith(
            "ephemeral container 'debugger' (spec.ephemeralContainers[0]) mounts "
            "'shardcache-imagenet-cred', a volume only the cache sidecar mounts"
        )
        assert "the source's credentials" in message


def test_a_debug_container_of_the_trainer_may_mount_what_the_trainer_mounts() -> None:
    """The memory tier and the checkpoints are the trainer's too: a debug container
    that looks at them gets nothing the pod's own containers do not have."""
    old = injected()
    (trainer,) = old["spec"]["containers"]
    new = debugged(old, targetContainerName="trainer", volumeMounts=trainer["volumeMounts"])
    response = update(old, new, subresource=pod_updates.EPHEMERAL_SUBRESOURCE)
    assert response == {"uid": UID, "allowed": True}


def test_debug_containers_already_in_the_pod_are_not_judged_again() -> None:
    # Added before the webhook saw UPDATEs: refusing every later update for it would
    # only block the pod, and the API server never changes an existing one.
    before = debugged(injected(), targetContainerName="shardcache-imagenet")
    after = copy.deepcopy(before)
    after["spec"]["containers"][0]["image"] = "python:3.12"
    assert update(before, after)["allowed"] is True


def test_the_sidecar_is_recognised_by_its_env_not_by_the_annotation() -> None:
    old = injected()
    old["metadata"]["annotations"] = {}
    (sidecar,) = sidecars(old)
    assert set(pod_updates.injected_containers(old)) == {sidecar["name"]}
    assert any(e["name"] == contract.ENV_MOUNT for e in sidecar["env"])
    # Trainers carry the mount's name too, but are never init containers.
    assert all(
        c["name"] not in pod_updates.injected_containers(old) for c in old["spec"]["containers"]
    )


def _mangled(value: Any, rng: random.Random, depth: int = 0) -> Any:
    """`value` with some of its parts replaced by values of other types."""
    if depth > 6 or rng.random() < 0.08:
        return rng.choice([None, 0, "x", [], {}, [None], {"name": 1}, True, ["shardcache"]])
    if isinstance(value, dict):
        return {k: _mangled(v, rng, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [_mangled(v, rng, depth + 1) for v in value]
    return value


def test_update_reviews_of_any_shape_answer_and_never_raise() -> None:
    """A 500 would block the update (failurePolicy Fail); a decision never raises."""
    base = debugged(injected(), targetContainerName="trainer")
    rng = random.Random(13)
    for _ in range(1000):
        old, new = _mangled(base, rng), _mangled(base, rng)
        response = update(
            old if isinstance(old, dict) else {}, new if isinstance(new, dict) else {}
        )
        assert response["allowed"] in (True, False)
