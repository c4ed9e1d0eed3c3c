"""Admission refuses what would give a pod author more than the platform granted.

Each test is a row of issue 13's table (docs/security.md, "pod author").
"""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import jsonpatch
import pytest
from shardcache_operator import admission, configuration, context, injection, webhook

from shardcache import contract
from tests.unit.test_injection import DEFAULTS, admit, dsm, env_of, pod, review_request, sidecars

pytestmark = pytest.mark.unit


def test_inspector_gets_its_own_loopback_port_declared_on_no_container() -> None:
    response, stored = admit(pod(label="imagenet_captions"), dsm("imagenet"), dsm("captions"))
    assert response["allowed"] is True
    first, second = sidecars(stored)
    ui_ports = {int(env_of(s)[contract.ENV_UI_PORT]) for s in (first, second)}
    declared = {p["containerPort"] for s in (first, second) for p in s["ports"]}
    assert len(ui_ports) == 2
    # Only the probe port is on the pod IP; the inspector's is never declared.
    assert not ui_ports & declared
    assert contract.DEFAULT_UI_PORT in ui_ports


def test_host_network_pod_is_refused_with_a_message() -> None:
    response, _ = admit(pod(hostNetwork=True), dsm("imagenet"))
    assert response["allowed"] is False
    message = response["status"]["message"]
    assert "hostNetwork" in message and "imagenet" in message


def test_host_network_false_is_admitted() -> None:
    response, _ = admit(pod(hostNetwork=False), dsm("imagenet"))
    assert response["allowed"] is True


def test_host_pid_pod_is_refused_unless_the_mount_allows_it() -> None:
    """The trainer of a hostPID pod sees the sidecar's /proc/<pid>/environ as it would
    with shareProcessNamespace: the same refusal, the same way out."""
    response, _ = admit(pod(hostPID=True), dsm("imagenet"))
    assert response["allowed"] is False
    message = response["status"]["message"]
    assert "cannot set hostPID" in message and "allowShareProcessNamespace" in message
    allowed = dsm("imagenet", admission={"allowShareProcessNamespace": True})
    response, _ = admit(pod(hostPID=True), allowed)
    assert response["allowed"] is True


def test_disk_tier_is_partitioned_per_namespace() -> None:
    """Issue 13, row 2: one tenant's sidecars never read what another's wrote."""
    dirs = set()
    for namespace in ("team-a", "team-b"):
        reply = admission.review(
            review_request(pod(), namespace=namespace),
            lookup=lambda _ns, name: {**dsm(name), "metadata": {"name": name}},
            defaults=DEFAULTS,
        )
        stored = jsonpatch.apply_patch(
            pod(), json.loads(base64.b64decode(reply["response"]["patch"]))
        )
        (sidecar,) = sidecars(stored)
        dirs.add(env_of(sidecar)[contract.ENV_DISK_DIR])
    assert dirs == {
        f"{contract.DEFAULT_DISK_DIR}/ns-team-a",
        f"{contract.DEFAULT_DISK_DIR}/ns-team-b",
    }


def _mounting(key: str, field: str, volume: str) -> dict[str, Any]:
    """A labelled pod whose container in `key` uses `volume` through `field`."""
    entry = {"name": volume}
    entry |= {"mountPath": "/loot", "subPath": "ns-team-a"} if field == "volumeMounts" else {}
    entry |= {"devicePath": "/dev/loot"} if field == "volumeDevices" else {}
    body = pod()
    container = {"name": "intruder", "image": "python:3.11", field: [entry]}
    if key == "containers":
        body["spec"]["containers"][0] |= {
            field: [entry],
            "securityContext": {"runAsUser": 65532, "runAsGroup": 65532},
        }
    else:
        body["spec"][key] = [container]
    return body


@pytest.mark.parametrize("key", ["containers", "initContainers", "ephemeralContainers"])
@pytest.mark.parametrize("field", ["volumeMounts", "volumeDevices"])
def test_a_container_using_the_injected_disk_volume_by_name_is_refused(
    key: str, field: str
) -> None:
    """The API server validates the pod after the webhooks, so a mount of the volume the
    injection is about to add passed: a trainer got the node disk tier, and with a
    subPath another namespace's directory in it, as the sidecar's user."""
    response, stored = admit(_mounting(key, field, "shardcache-imagenet-disk"), dsm("imagenet"))
    assert response["allowed"] is False
    assert "patch" not in response
    message = response["status"]["message"]
    assert f"spec.{key}[0].{field} of container " in message
    assert "names volume 'shardcache-imagenet-disk', which the pod does not declare" in message
    assert "expected one of its spec.volumes (none)" in message
    assert "volumes" not in stored["spec"]


@pytest.mark.parametrize("volume", ["shardcache-imagenet-run", "shardcache-imagenet-ckpt"])
def test_a_container_using_any_other_injected_volume_by_name_is_refused(volume: str) -> None:
    mount = dsm("imagenet", checkpoint={"uri": "s3://ckpt/imagenet/"})
    response, _ = admit(_mounting("initContainers", "volumeMounts", volume), mount)
    assert response["allowed"] is False
    assert (
        f"names volume {volume!r}, which the pod does not declare"
        in (response["status"]["message"])
    )


def test_mounts_of_the_pods_own_volumes_are_admitted() -> None:
    body = pod(volumes=[{"name": "scratch", "emptyDir": {}}])
    body["spec"]["containers"][0]["volumeMounts"] = [{"name": "scratch", "mountPath": "/tmp"}]
    response, stored = admit(body, dsm("imagenet"))
    assert response["allowed"] is True
    (trainer,) = stored["spec"]["containers"]
    assert [m["name"] for m in trainer["volumeMounts"]] == ["scratch", "shardcache-imagenet-run"]


def test_the_sidecar_mounts_only_its_namespaces_directory_of_the_node_path() -> None:
    """Anything that runs in the sidecar container (an exec into it, a process hostile
    data compromised) sees its namespace's disk tier, never another's."""
    reply = admission.review(
        review_request(pod(), namespace="team-a"),
        lookup=lambda _ns, name: {**dsm(name), "metadata": {"name": name}},
        defaults=DEFAULTS,
    )
    stored = jsonpatch.apply_patch(pod(), json.loads(base64.b64decode(reply["response"]["patch"])))
    (sidecar,) = sidecars(stored)
    volumes = {v["name"]: v for v in stored["spec"]["volumes"]}
    (disk,) = [m for m in sidecar["volumeMounts"] if "hostPath" in volumes[m["name"]]]
    assert volumes[disk["name"]]["hostPath"]["path"] == contract.DEFAULT_DISK_DIR
    assert disk["subPath"] == "ns-team-a"
    assert disk["mountPath"] == env_of(sidecar)[contract.ENV_DISK_DIR]


FIRST = "0b6c1f2e-3d4a-4b5c-8d6e-7f8091a2b3c4"
AGAIN = "9e8d7c6b-5a49-4382-b716-0a1b2c3d4e5f"


class Namespaces:
    """The API as the webhook sees it: the DatasetMount is watched; each GET of the
    namespace answers `uid` (or raises `fail`), and may be held until released."""

    def __init__(self, uid: str | None = FIRST, fail: Exception | None = None) -> None:
        self.uid = uid
        self.fail = fail
        self.reads = 0
        self.hold: asyncio.Event | None = None

    async def read_namespace_uid(self, name: str) -> str | None:
        self.reads += 1
        if self.hold is not None:
            await self.hold.wait()
        if self.fail is not None:
            raise self.fail
        return self.uid


def memo_of(api: Namespaces) -> context.Context:
    settings = configuration.Settings(sidecar_image="sidecar:test")
    memo = context.Context(settings=settings, api=api)  # type: ignore[arg-type]
    memo.mounts.listed([dsm("imagenet")])
    return memo


async def admitted(memo: context.Context, namespace: str = "ml") -> dict[str, Any]:
    """The webhook's answer to a pod's CREATE in `namespace`, as the API server stores it."""
    body = pod()
    body["metadata"]["namespace"] = namespace
    response = (await webhook.answer(review_request(body, namespace=namespace), memo))["response"]
    assert response["allowed"] is True, response
    patch = json.loads(base64.b64decode(response["patch"]))
    stored: dict[str, Any] = jsonpatch.apply_patch(body, patch)
    return stored


def node_directory(stored: dict[str, Any]) -> str:
    """The directory of the node path the pod's sidecar mounts (its subPath)."""
    (sidecar,) = sidecars(stored)
    volumes = {v["name"]: v for v in stored["spec"]["volumes"]}
    (disk,) = [m for m in sidecar["volumeMounts"] if "hostPath" in volumes[m["name"]]]
    assert disk["mountPath"] == env_of(sidecar)[contract.ENV_DISK_DIR]
    return str(disk["subPath"])


async def test_a_namespace_created_again_with_the_same_name_gets_another_node_directory() -> None:
    """Deleted and created again before a reclaim round: the earlier tenant's entries
    stay in a directory the new namespace's sidecars never mount (nor an exec into one)."""
    api = Namespaces(uid=FIRST)
    memo = memo_of(api)
    before = node_directory(await admitted(memo))
    api.uid = AGAIN  # `ml` deleted and created again: the API server gives a new UID
    after = node_directory(await admitted(memo))
    assert before != after
    assert (before, after) == (f"ns-ml.{FIRST}", f"ns-ml.{AGAIN}")


@pytest.mark.parametrize("index", ["\u00b2", "\u0663", "1\u00b9", "-1", "1.0", ""])
def test_a_completion_index_in_other_than_ascii_digits_is_refused_with_a_message(
    index: str,
) -> None:
    """'²'.isdigit() is True but int('²') raises: the webhook answered 500."""
    body = pod()
    body["metadata"]["annotations"] = {injection.ANNOTATION_JOB_INDEX: index}
    response, _ = admit(body, dsm("imagenet", sharding={"worldSize": 4}))
    assert response["allowed"] is False
    message = response["status"]["message"]
    assert f"annotation {injection.ANNOTATION_JOB_INDEX}: expected the Job's completion" in message
    assert f"found {index!r}" in message


def test_a_completion_index_in_ascii_digits_is_still_checked_against_the_world_size() -> None:
    body = pod()
    body["metadata"]["annotations"] = {injection.ANNOTATION_JOB_INDEX: "7"}
    response, _ = admit(body, dsm("imagenet", sharding={"worldSize": 4}))
    assert response["allowed"] is False
    assert "the pod's rank is 7" in response["status"]["message"]


def test_an_inspector_port_in_unicode_digits_in_a_containers_env_is_no_500() -> None:
    body = pod()
    body["spec"]["containers"][0]["env"] = [{"name": contract.ENV_UI_PORT, "value": "\u00b2"}]
    response, _ = admit(body, dsm("imagenet"))
    assert response["allowed"] is True
