"""The sidecars' probe/metrics ports stay inside the range the chart's NetworkPolicy
opens (networkPolicy.metricsPorts, 8470-8479 by default).

The webhook took the first free port from 8470 with no upper bound: a pod whose own
containers used 8470-8479 got a sidecar on 8480, which the NetworkPolicy keeps
Prometheus and the operator's stall check from reaching, silently. Now the operator
takes the range from the chart (the same values render both), allocates inside it, and
a mount with no port left there follows its spec.admission.policy, as a mount that is
not Ready does: Refuse (the default) refuses the pod naming the range and the fix, Admit
starts it without that cache with an admission warning; a Warning Event on the
DatasetMount says it either way.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from shardcache_operator import admission, configuration, context, injection, pod_names, webhook

from shardcache import contract, errors
from tests.unit.test_chart_operator_render import (
    CHART,
    helm_template,
    operator_container,
    rendered,
)
from tests.unit.test_injection import admit, dsm, pod, sidecars

pytestmark = pytest.mark.unit

#: The namespace's UID as the API server would give it.
NAMESPACE_UID = "4f9c2a6e-1b3d-4c5e-8f70-9a1b2c3d4e5f"

FIRST = contract.DEFAULT_METRICS_PORT
ADMIT = {"admission": {"policy": "Admit"}}


def busy_pod(ports: range, label: str = "imagenet") -> dict[str, Any]:
    obj = pod(label=label)
    obj["spec"]["containers"][0]["ports"] = [
        {"name": f"p{port}", "containerPort": port} for port in ports
    ]
    return obj


def test_a_pod_using_the_whole_range_is_refused_naming_the_range_and_the_fix() -> None:
    response, _stored = admit(busy_pod(range(FIRST, FIRST + 10)), dsm("imagenet"))
    assert response["allowed"] is False
    message = response["status"]["message"]
    assert "DatasetMount ml/imagenet: no free port for its sidecar's probes and metrics" in message
    assert f"in {FIRST}-{FIRST + 9}" in message
    assert "networkPolicy.metricsPorts" in message
    assert "spec.admission.policy: Admit" in message


def test_an_admit_mount_with_no_port_left_starts_the_pod_without_it_and_warns() -> None:
    response, stored = admit(busy_pod(range(FIRST, FIRST + 10)), dsm("imagenet", **ADMIT))
    assert response["allowed"] is True
    assert sidecars(stored) == []  # not a sidecar on 8480 that nobody can scrape
    (warning,) = response["warnings"]
    assert "DatasetMount ml/imagenet: no free port for its sidecar's probes and metrics" in warning
    assert f"in {FIRST}-{FIRST + 9}" in warning
    assert "networkPolicy.metricsPorts" in warning
    assert "admitted without the cache for imagenet" in warning


def test_the_mounts_that_fit_get_the_last_free_ports_and_the_rest_a_warning() -> None:
    obj = busy_pod(range(FIRST, FIRST + 9), label="imagenet_captions")
    response, stored = admit(obj, dsm("imagenet"), dsm("captions", **ADMIT))
    assert response["allowed"] is True
    (sidecar,) = sidecars(stored)
    assert sidecar["name"] == "shardcache-imagenet"
    assert sidecar["ports"][0]["containerPort"] == FIRST + 9
    (warning,) = response["warnings"]
    assert warning.startswith("DatasetMount ml/captions: no free port")


def test_the_decision_names_the_event_to_post_on_the_mount() -> None:
    decision = admission.decide(
        busy_pod(range(FIRST, FIRST + 10)),
        namespace="ml",
        lookup=lambda ns, name: dsm(name, **ADMIT),
        defaults=injection.SidecarDefaults(image="img"),
    )
    assert decision.allowed and not decision.patch
    ((name, reason, message),) = decision.events
    assert (name, reason) == ("imagenet", admission.REASON_NO_METRICS_PORT)
    assert message == decision.warnings[0]


class Events:
    """The API as the webhook sees it: the mount is watched, Events are recorded."""

    def __init__(self, fail: bool = False) -> None:
        self.posted: list[dict[str, Any]] = []
        self.fail = fail

    async def read_namespace_uid(self, name: str) -> str | None:
        return NAMESPACE_UID

    async def post_event(self, body: Mapping[str, Any]) -> None:
        if self.fail:
            raise RuntimeError("403 Forbidden")
        self.posted.append(dict(body))


async def test_the_webhook_posts_a_warning_event_on_the_datasetmount() -> None:
    obj = dsm("imagenet", **ADMIT)
    obj["metadata"]["uid"] = "u-1"
    api = Events()
    memo = context.Context(settings=configuration.Settings(), api=api)  # type: ignore[arg-type]
    memo.mounts.listed([obj])
    decision = await webhook.decide(busy_pod(range(FIRST, FIRST + 10)), "ml", memo)
    assert decision.allowed and not decision.patch
    (event,) = api.posted
    assert event["involvedObject"] == {
        "apiVersion": "shardcache.io/v1alpha1",
        "kind": "DatasetMount",
        "name": "imagenet",
        "namespace": "ml",
        "uid": "u-1",
    }
    assert (event["type"], event["reason"]) == ("Warning", admission.REASON_NO_METRICS_PORT)
    assert event["message"] == decision.warnings[0]
    assert event["metadata"]["namespace"] == "ml"
    # An API that refuses the Event does not refuse the pod.
    memo = context.Context(settings=configuration.Settings(), api=Events(fail=True))  # type: ignore[arg-type]
    memo.mounts.listed([obj])
    decision = await webhook.decide(busy_pod(range(FIRST, FIRST + 10)), "ml", memo)
    assert decision.allowed and decision.warnings


def test_a_narrower_range_from_the_settings_bounds_the_allocation() -> None:
    settings = configuration.from_env(
        {
            "SHARDCACHE_OPERATOR_METRICS_PORT_FIRST": "9000",
            "SHARDCACHE_OPERATOR_METRICS_PORT_LAST": "9001",
        }
    )
    defaults = webhook.defaults_of(settings)
    assert (defaults.metrics_port, defaults.metrics_port_last) == (9000, 9001)
    assert injection.metrics_ports_free(busy_pod(range(9000, 9001)), defaults) == 1
    taken = pod_names.Taken(containers=[], init_containers=[], ephemeral=[], volumes=[])
    for expected in (9000, 9001):
        names = taken.allocate("m", first_port=9000, last_port=9001, first_ui_port=8490,
                               checkpoints=False)  # fmt: skip
        assert names.port == expected
    with pytest.raises(errors.InputError, match=r"no free port .* in 9000-9001"):
        taken.allocate("m", first_port=9000, last_port=9001, first_ui_port=8490,
                       checkpoints=False)  # fmt: skip


def test_a_range_whose_first_port_is_above_its_last_is_refused_naming_both() -> None:
    with pytest.raises(errors.InputError) as raised:
        configuration.from_env(
            {
                "SHARDCACHE_OPERATOR_METRICS_PORT_FIRST": "8479",
                "SHARDCACHE_OPERATOR_METRICS_PORT_LAST": "8470",
            }
        )
    text = str(raised.value)
    assert "$SHARDCACHE_OPERATOR_METRICS_PORT_FIRST" in text
    assert "$SHARDCACHE_OPERATOR_METRICS_PORT_LAST" in text
    assert "found 8479-8470" in text


def test_the_chart_gives_the_operator_the_range_its_network_policy_opens(tmp_path: Path) -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())["networkPolicy"]
    default = values["metricsPorts"]
    # One range: the chart's default is the operator's own.
    assert (default["first"], default["last"]) == (
        configuration.Settings.metrics_port_first,
        configuration.Settings.metrics_port_last,
    )
    args = (
        "--set=networkPolicy.enabled=true,networkPolicy.namespaces={ml}",
        "--set=networkPolicy.metricsPorts.first=9100,networkPolicy.metricsPorts.last=9103",
    )
    env = {e["name"]: e.get("value") for e in operator_container(tmp_path, *args)["env"]}
    settings = configuration.from_env({k: v for k, v in env.items() if v is not None})
    assert (settings.metrics_port_first, settings.metrics_port_last) == (9100, 9103)
    (policy,) = [d for d in rendered(tmp_path, *args) if d["kind"] == "NetworkPolicy"]
    opened = {(p["port"], p["endPort"]) for rule in policy["spec"]["ingress"]
              for p in rule.get("ports", [])}  # fmt: skip
    assert opened == {(9100, 9103)}


def test_the_podmonitor_keeps_the_port_names_the_webhook_gives(tmp_path: Path) -> None:
    """pod_names writes `shardcache`, `shardcache-2`, ...; the chart's PodMonitor keeps
    the targets whose port name matches its regex: the two must agree."""
    docs = rendered(tmp_path, "--set=monitoring.podMonitor.enabled=true")
    (monitor,) = [
        d for d in docs if d["kind"] == "PodMonitor" and d["metadata"]["name"].endswith("sidecars")
    ]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    (keep,) = [r for r in endpoint["relabelings"] if r.get("action") == "keep"]
    assert keep["sourceLabels"] == ["__meta_kubernetes_pod_container_port_name"]
    # Prometheus anchors relabelling regexes at both ends.
    regex = re.compile(keep["regex"])
    taken = pod_names.Taken(containers=[], init_containers=[], ephemeral=[], volumes=[])
    given = [
        taken.allocate(f"m{i}", first_port=FIRST, first_ui_port=8490, checkpoints=False).port_name
        for i in range(10)
    ]
    assert given[:2] == ["shardcache", "shardcache-2"]
    assert all(regex.fullmatch(name) for name in given), given
    assert not regex.fullmatch("metrics") and not regex.fullmatch("http")


def test_the_chart_refuses_a_range_whose_first_port_is_above_its_last(tmp_path: Path) -> None:
    result = helm_template(
        tmp_path, "--set=networkPolicy.metricsPorts.first=8479,networkPolicy.metricsPorts.last=8470"
    )
    assert result.returncode != 0
    assert "networkPolicy.metricsPorts: expected first <= last, found 8479-8470" in result.stderr


async def test_a_refused_pod_leaves_the_event_on_the_datasetmount_too() -> None:
    # A controller's pod refused at admission shows only in the controller's events:
    # the mount's own Event is where `kubectl describe dsm` finds it.
    obj = dsm("imagenet")
    obj["metadata"]["uid"] = "u-1"
    api = Events()
    memo = context.Context(settings=configuration.Settings(), api=api)  # type: ignore[arg-type]
    memo.mounts.listed([obj])
    decision = await webhook.decide(busy_pod(range(FIRST, FIRST + 10)), "ml", memo)
    assert not decision.allowed
    (event,) = api.posted
    assert event["reason"] == admission.REASON_NO_METRICS_PORT
    assert event["message"] == decision.message
