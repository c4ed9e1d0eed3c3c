"""The webhook's NoMetricsPort Event is posted once per DatasetMount and cause in a
while, not once per pod: a Deployment of 500 pods that all meet the same cause made
500 Events (500 API writes before answering). The next one after the interval says how
many were held back; another mount, or another cause, gets its own."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
from shardcache_operator import admission, configuration, context, event_gates, webhook

from shardcache import contract
from tests.unit.test_injection import dsm
from tests.unit.test_metrics_port_range import busy_pod

pytestmark = pytest.mark.unit

#: The namespace's UID as the API server would give it.
NAMESPACE_UID = "4f9c2a6e-1b3d-4c5e-8f70-9a1b2c3d4e5f"

FIRST = contract.DEFAULT_METRICS_PORT
ADMIT = {"admission": {"policy": "Admit"}}


class Events:
    def __init__(self) -> None:
        self.posted: list[dict[str, Any]] = []

    async def read_namespace_uid(self, name: str) -> str | None:
        return NAMESPACE_UID

    async def post_event(self, body: Mapping[str, Any]) -> None:
        self.posted.append(dict(body))


def mount(name: str, uid: str, **spec: Any) -> dict[str, Any]:
    obj = dsm(name, **spec)
    obj["metadata"]["uid"] = uid
    return obj


async def test_many_pods_meeting_the_same_cause_post_one_event() -> None:
    api = Events()
    memo = context.Context(settings=configuration.Settings(), api=api)  # type: ignore[arg-type]
    memo.mounts.listed([mount("imagenet", "u-1", **ADMIT)])
    for _ in range(500):
        decision = await webhook.decide(busy_pod(range(FIRST, FIRST + 10)), "ml", memo)
        # Every pod still gets its own admission warning: that is the pod's, not the mount's.
        assert decision.allowed and decision.warnings
    (event,) = api.posted
    assert event["reason"] == admission.REASON_NO_METRICS_PORT


async def test_each_mount_and_each_cause_gets_its_own_event() -> None:
    api = Events()
    memo = context.Context(settings=configuration.Settings(), api=api)  # type: ignore[arg-type]
    memo.mounts.listed(
        [
            mount("imagenet", "u-1", **ADMIT),
            mount("laion", "u-2", **ADMIT),
            mount("strict", "u-3"),
        ]
    )
    for label in ("imagenet", "laion", "strict", "imagenet", "laion", "strict"):
        await webhook.decide(busy_pod(range(FIRST, FIRST + 10), label=label), "ml", memo)
    names = sorted(e["involvedObject"]["name"] for e in api.posted)
    assert names == ["imagenet", "laion", "strict"]


async def test_the_next_event_after_the_interval_counts_the_ones_held_back() -> None:
    api = Events()
    memo = context.Context(settings=configuration.Settings(), api=api)  # type: ignore[arg-type]
    obj = mount("imagenet", "u-1", **ADMIT)
    await webhook.post_event(memo, obj, "NoMetricsPort", "no port", now=0.0)
    for second in range(1, 4):
        await webhook.post_event(memo, obj, "NoMetricsPort", "no port", now=float(second))
    assert len(api.posted) == 1
    later = event_gates.INTERVAL_SECONDS + 1
    await webhook.post_event(memo, obj, "NoMetricsPort", "no port", now=later)
    assert [e["message"] for e in api.posted] == [
        "no port",
        "no port (and 3 more pods since the last such Event)",
    ]
    # A new mount of the same name (another uid) is another mount.
    await webhook.post_event(
        memo, mount("imagenet", "u-9", **ADMIT), "NoMetricsPort", "no port", now=later
    )
    assert len(api.posted) == 3


def test_the_gate_forgets_its_oldest_cause_when_full() -> None:
    gate = event_gates.Gate(max_keys=2)
    keys = [("ml", f"m{i}", f"u{i}", "R", "text") for i in range(3)]
    assert [gate.admit(k, now=0.0) for k in keys] == [0, 0, 0]
    assert gate.admit(keys[2], now=1.0) is None  # remembered
    assert gate.admit(keys[0], now=1.0) == 0  # forgotten, posted again
