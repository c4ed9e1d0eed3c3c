"""Admission refuses what would give a pod author more than the platform granted.

Each test is a row of issue 13's table (docs/security.md, "pod author").
"""

from __future__ import annotations

import base64
import json

import jsonpatch
import pytest
from shardcache_operator import admission

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
