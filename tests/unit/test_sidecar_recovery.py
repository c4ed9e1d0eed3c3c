"""A sidecar OOMKilled once kept its mount's SidecarsHealthy=False until its pod ended:
the kubelet keeps the last termination in lastState for the pod's life. One that has
run, ready, for `sidecar_health.SETTLE_SECONDS` since its last restart now counts
healthy again: the condition turns True/SidecarsRecovered and one Normal Event says so.
And the check-sidecars timer lists each namespace's pods once per round for all its
mounts, not once per mount (`namespace_lists`)."""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Mapping
from typing import Any

import kopf
import pytest
from kopf._core.engines import posting
from shardcache_operator import (
    configuration,
    context,
    namespace_lists,
    sidecar_checks,
    sidecar_health,
)

from shardcache import contract

pytestmark = pytest.mark.unit

NOW = datetime.datetime(2026, 11, 28, 12, 0, 0, tzinfo=datetime.UTC)
SETTLE = sidecar_health.SETTLE_SECONDS


def stamp(seconds_ago: float) -> str:
    return (NOW - datetime.timedelta(seconds=seconds_ago)).strftime("%Y-%m-%dT%H:%M:%SZ")


def pod(
    name: str = "train-0",
    *,
    mount: str = "data",
    namespace: str = "ml",
    running_for: float | None = SETTLE + 60,
    ready: bool = True,
    last_reason: str | None = "OOMKilled",
    exit_code: int = 137,
) -> dict[str, Any]:
    """A pod whose sidecar for `mount` died once (`last_reason`) and has run since."""
    container_status: dict[str, Any] = {
        "name": f"shardcache-{mount}",
        "restartCount": 1,
        "ready": ready,
        "state": {"running": {"startedAt": stamp(running_for)}}
        if running_for is not None
        else {"waiting": {"reason": "PodInitializing"}},
    }
    if last_reason:
        container_status["lastState"] = {
            "terminated": {"reason": last_reason, "exitCode": exit_code}
        }
    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"shardcache.io/mount": mount},
        },
        "spec": {
            "initContainers": [
                {
                    "name": f"shardcache-{mount}",
                    "restartPolicy": "Always",
                    "env": [{"name": contract.ENV_MOUNT, "value": mount}],
                    "resources": {"limits": {"memory": "512Mi"}},
                }
            ],
            "containers": [{"name": "trainer"}],
        },
        "status": {"phase": "Running", "initContainerStatuses": [container_status]},
    }


def test_a_sidecar_oomkilled_once_that_ran_ready_since_for_the_settle_time_is_healthy() -> None:
    assert sidecar_health.troubles(pod(), "data", now=NOW) == []
    health = sidecar_health.assess([pod()], NOW)["data"]
    assert health.troubles == ()
    (recovered,) = health.recovered
    assert (recovered.pod, recovered.reason) == ("train-0", "OOMKilled")
    new = sidecar_health.condition(health.troubles, health.recovered)
    assert (new.status, new.reason) == ("True", "SidecarsRecovered")
    assert "train-0" in new.message and f"{SETTLE:.0f} s" in new.message


@pytest.mark.parametrize(
    "case",
    [
        dict(running_for=SETTLE - 1),  # not long enough yet
        dict(running_for=5),  # restarted again just now: startedAt moved
        dict(ready=False),  # running but not ready
        dict(running_for=None),  # not running
    ],
    ids=["settling", "restarted-again", "not-ready", "not-running"],
)
def test_a_sidecar_that_died_is_trouble_until_it_has_settled(case: dict[str, Any]) -> None:
    (trouble,) = sidecar_health.troubles(pod(**case), "data", now=NOW)
    assert trouble.reason == "OOMKilled"


def test_a_crash_loops_short_runs_between_deaths_keep_it_trouble() -> None:
    # Between two deaths the container runs a few seconds: no True in between (it
    # would post a recovery Event per loop).
    (trouble,) = sidecar_health.troubles(
        pod(running_for=3, last_reason="Error", exit_code=1), "data", now=NOW
    )
    assert (trouble.reason, trouble.event_reason) == ("Error", "SidecarCrashLooping")


def test_a_sidecar_whose_last_run_completed_never_died() -> None:
    assert (
        sidecar_health.assess([pod(running_for=1, last_reason="Completed", exit_code=0)], NOW) == {}
    )


def test_sidecars_of_several_mounts_in_one_list_are_told_apart() -> None:
    pods = [
        pod("a-0", mount="a", running_for=10),
        pod("b-0", mount="b"),
        pod("c-0", mount="c", last_reason=None),
    ]
    by_mount = sidecar_health.assess(pods, NOW)
    assert set(by_mount) == {"a", "b"}
    assert [t.pod for t in by_mount["a"].troubles] == ["a-0"]
    assert [t.pod for t in by_mount["b"].recovered] == ["b-0"]


class CountingApi:
    def __init__(self, pods: list[dict[str, Any]]) -> None:
        self.pods = pods
        self.lists: list[str] = []
        self.fail = False

    async def list_unfinished_pods(self, namespace: str, label_selector: str) -> list[Any]:
        self.lists.append(namespace)
        await asyncio.sleep(0)  # another check may ask meanwhile
        if self.fail:
            raise RuntimeError("API down")
        return [p for p in self.pods if p["metadata"]["namespace"] == namespace]


def capture_events() -> asyncio.Queue[posting.K8sEvent]:
    queue: asyncio.Queue[posting.K8sEvent] = asyncio.Queue()
    posting.settings_var.set(kopf.OperatorSettings())
    posting.event_queue_var.set(queue)
    posting.event_queue_loop_var.set(asyncio.get_running_loop())
    return queue


def drained(queue: asyncio.Queue[posting.K8sEvent]) -> list[posting.K8sEvent]:
    out = []
    while not queue.empty():
        out.append(queue.get_nowait())
    return out


def mount_body(
    name: str = "data", namespace: str = "ml", conditions: list[Mapping[str, Any]] | None = None
) -> kopf.Body:
    return kopf.Body(
        {
            "apiVersion": "shardcache.io/v1alpha1",
            "kind": "DatasetMount",
            "metadata": {"name": name, "namespace": namespace, "uid": f"u-{name}"},
            "spec": {"source": {"uri": "s3://bucket/data/"}},
            "status": {"phase": "Ready", "attachedPods": 1, "conditions": conditions or []},
        }
    )


def real_pod(**kwargs: Any) -> dict[str, Any]:
    """`pod()` with start times relative to the wall clock the handler reads."""
    made = pod(**kwargs)
    shift = datetime.datetime.now(datetime.UTC) - NOW
    for status in made["status"]["initContainerStatuses"]:
        running = status["state"].get("running")
        if running:
            started = datetime.datetime.fromisoformat(running["startedAt"]) + shift
            running["startedAt"] = started.strftime("%Y-%m-%dT%H:%M:%SZ")
    return made


async def test_the_timer_turns_the_condition_true_with_one_normal_event_once_recovered() -> None:
    events = capture_events()
    api = CountingApi([real_pod()])
    ctx = context.Context(settings=configuration.Settings(), api=api)  # type: ignore[arg-type]
    ctx.pods.set("ml", "train-0", ("data",))
    dead = [{"type": "SidecarsHealthy", "status": "False", "reason": "SidecarOOMKilled"}]
    patch = kopf.Patch()
    await sidecar_checks.check_sidecars(
        body=mount_body(conditions=dead), patch=patch, namespace="ml", name="data", memo=ctx
    )
    (condition,) = patch.status["conditions"]
    assert (condition["status"], condition["reason"]) == ("True", "SidecarsRecovered")
    posted = drained(events)
    assert [(e.type, e.reason) for e in posted] == [("Normal", "SidecarsRecovered")]
    assert "train-0" in posted[0].message
    # The next round: already True, nothing written, nothing posted.
    again = kopf.Patch()
    await sidecar_checks.check_sidecars(
        body=mount_body(conditions=[condition]), patch=again, namespace="ml", name="data", memo=ctx
    )
    assert "conditions" not in again.status
    assert drained(events) == []
    # A status patch that failed: the condition still says False, no second Event.
    retry = kopf.Patch()
    await sidecar_checks.check_sidecars(
        body=mount_body(conditions=dead), patch=retry, namespace="ml", name="data", memo=ctx
    )
    assert retry.status["conditions"][0]["status"] == "True"
    assert drained(events) == []


async def test_one_pod_list_per_namespace_per_round_whatever_its_mounts() -> None:
    capture_events()
    mounts = [f"m{i}" for i in range(20)]
    pods = [real_pod(name=f"{m}-0", mount=m, running_for=5) for m in mounts]
    pods.append(real_pod(name="x-0", mount="x", namespace="other", running_for=5))
    api = CountingApi(pods)
    clock = [1000.0]
    ctx = context.Context(
        settings=configuration.Settings(),
        api=api,  # type: ignore[arg-type]
        sidecar_lists=namespace_lists.Shared(
            sidecar_health.LIST_MAX_AGE_SECONDS, clock=lambda: clock[0]
        ),
    )
    for p in pods:
        ctx.pods.set(
            p["metadata"]["namespace"],
            p["metadata"]["name"],
            (p["metadata"]["labels"]["shardcache.io/mount"],),
        )
    targets = [("ml", m) for m in mounts] + [("other", "x")]

    async def round_() -> list[kopf.Patch]:
        patches = [kopf.Patch() for _ in targets]
        # Concurrent, as kopf runs the timers: checks asking during a LIST share it.
        await asyncio.gather(
            *(
                sidecar_checks.check_sidecars(
                    body=mount_body(m, ns), patch=p, namespace=ns, name=m, memo=ctx
                )
                for (ns, m), p in zip(targets, patches, strict=True)
            )
        )
        return patches

    patches = await round_()
    assert sorted(api.lists) == ["ml", "other"]
    # Each mount judged only its own sidecar.
    for (_, m), p in zip(targets, patches, strict=True):
        (condition,) = p.status["conditions"]
        assert condition["status"] == "False" and f"{m}-0" in condition["message"]
    clock[0] += sidecar_health.LIST_MAX_AGE_SECONDS - 1
    await round_()
    assert len(api.lists) == 2  # still fresh: no new LIST
    clock[0] += 1
    await round_()
    assert sorted(api.lists) == ["ml", "ml", "other", "other"]


async def test_a_failed_list_is_not_kept() -> None:
    api = CountingApi([])
    shared: namespace_lists.Shared[list[Any]] = namespace_lists.Shared(30.0, clock=lambda: 0.0)
    api.fail = True
    with pytest.raises(RuntimeError):
        await shared.get("ml", lambda: api.list_unfinished_pods("ml", "x"))
    api.fail = False
    assert await shared.get("ml", lambda: api.list_unfinished_pods("ml", "x")) == []
    assert api.lists == ["ml", "ml"]


def test_the_lists_age_is_the_checks_interval() -> None:
    assert sidecar_health.LIST_MAX_AGE_SECONDS == sidecar_checks.INTERVAL_SECONDS
