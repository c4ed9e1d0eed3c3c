"""Admission refuses what would give a pod author more than the platform granted.

Each test is a row of issue 13's table (docs/security.md, "pod author").
"""

from __future__ import annotations

import pytest

from shardcache import contract
from tests.unit.test_injection import admit, dsm, env_of, pod, sidecars

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
