"""DataStarved: reading the sidecars' stall fraction and judging it (pure parts)."""

from __future__ import annotations

from typing import Any

import pytest
from shardcache_operator import specs, starvation, status

from shardcache import contract

pytestmark = pytest.mark.unit

STALL = specs.StallSpec(threshold_percent=50, for_seconds=60)


def pod(name: str, *, mount: str = "train", ip: str = "10.0.0.7", phase: str = "Running") -> Any:
    return {
        "metadata": {"name": name, "labels": {"shardcache.io/mount": mount}},
        "spec": {
            "initContainers": [
                {
                    "name": f"shardcache-{mount}",
                    "env": [{"name": contract.ENV_MOUNT, "value": mount}],
                    "ports": [{"name": "shardcache", "containerPort": 8471}],
                }
            ],
            "containers": [{"name": "trainer", "ports": [{"containerPort": 8470}]}],
        },
        "status": {"phase": phase, "podIP": ip},
    }


def test_a_trainer_carrying_the_mounts_variable_is_not_taken_for_its_sidecar() -> None:
    # Admitted without its sidecar (the webhook failed open), the pod still asks for
    # the mount, and its trainer has $SHARDCACHE_MOUNT and a port of its own.
    found = pod("p")
    found["spec"]["initContainers"] = []
    found["spec"]["containers"][0]["env"] = [{"name": contract.ENV_MOUNT, "value": "train"}]
    assert starvation.endpoint(found, "train") is None


def test_the_endpoint_is_the_mounts_own_sidecar_port_on_the_pod_ip() -> None:
    assert starvation.endpoint(pod("p"), "train") == starvation.Endpoint(
        "p", "http://10.0.0.7:8471/metrics"
    )
    assert starvation.endpoint(pod("p", ip="fd00::7"), "train") == starvation.Endpoint(
        "p", "http://[fd00::7]:8471/metrics"
    )


@pytest.mark.parametrize(
    "found",
    [pod("p", phase="Pending"), pod("p", ip=""), pod("p", mount="other")],
)
def test_pods_not_running_without_an_ip_or_of_another_mount_have_no_endpoint(found: Any) -> None:
    assert starvation.endpoint(found, "train") is None


def test_the_worst_reader_of_an_exposition_counts() -> None:
    text = "\n".join(
        [
            "# HELP shardcache_reader_stall_fraction Share of ...",
            "# TYPE shardcache_reader_stall_fraction gauge",
            'shardcache_reader_stall_fraction{rank="0",reader="a"} 0.25',
            'shardcache_reader_stall_fraction{rank="1",reader="b"} 0.75',
            'shardcache_reader_stall_fraction_other{rank="1"} 0.99',
            "shardcache_ready 1.0",
        ]
    )
    assert starvation.worst_fraction(text) == 0.75
    assert starvation.worst_fraction("shardcache_ready 1.0\n") is None


def test_a_pod_is_starved_only_after_staying_above_the_threshold_for_the_duration() -> None:
    first = starvation.judge({}, {"a": 0.9, "b": 0.2, "c": None}, now=100.0, stall=STALL)
    assert first.above_since == {"a": 100.0} and first.starved == ()
    later = starvation.judge(first.above_since, {"a": 0.8, "b": 0.9}, now=160.0, stall=STALL)
    assert later.above_since == {"a": 100.0, "b": 160.0}
    assert later.starved == ("a",)
    # One check below (or without an answer) starts the clock again.
    dipped = starvation.judge(later.above_since, {"a": 0.4, "b": None}, now=170.0, stall=STALL)
    assert dipped.above_since == {} and dipped.starved == ()


def test_a_new_leader_keeps_a_starved_mount_starved_without_waiting_again() -> None:
    carried = starvation.judge(
        {}, {"a": 0.9, "b": 0.1}, now=500.0, stall=STALL, starved_before=True
    )
    assert carried.starved == ("a",)
    # Without the condition set, a first sighting starts the clock as usual.
    fresh = starvation.judge({}, {"a": 0.9}, now=500.0, stall=STALL)
    assert fresh.starved == ()


def test_the_condition_names_the_pods_and_counts_the_rest() -> None:
    pods = [f"p{i:02d}" for i in range(12)]
    cond = starvation.condition(pods, STALL)
    assert (cond.type, cond.status, cond.reason) == ("DataStarved", "True", "ReadersWaitingOnData")
    assert "p00" in cond.message and "p09" in cond.message and "p10" not in cond.message
    assert "and 2 more" in cond.message
    assert starvation.condition([], STALL).status == "False"


def test_conditions_keep_the_others_and_report_only_a_status_flip() -> None:
    ready = {"type": "Ready", "status": "True", "reason": "ManifestPinned", "message": "m"}
    # A mount that never starved gets no condition (and no status write).
    never, flipped = starvation.conditions_with([ready], starvation.condition([], STALL), now="T0")
    assert never == [ready] and not flipped
    starved = starvation.condition(["p1"], STALL)
    conditions, flipped = starvation.conditions_with([ready], starved, now="T1")
    assert flipped and [c["type"] for c in conditions] == ["Ready", "DataStarved"]
    # The same verdict again: nothing to write, no Event.
    again, flipped = starvation.conditions_with(conditions, starved, now="T2")
    assert again == conditions and not flipped
    # Another pod starved too: the message changes, the transition time does not.
    more, flipped = starvation.conditions_with(
        conditions, starvation.condition(["p1", "p2"], STALL), now="T3"
    )
    assert not flipped and more[-1]["lastTransitionTime"] == "T1" and "p2" in more[-1]["message"]
    cleared, flipped = starvation.conditions_with(more, starvation.condition([], STALL), now="T4")
    assert (
        flipped and cleared[-1]["status"] == "False" and cleared[-1]["lastTransitionTime"] == "T4"
    )


def test_a_reconcile_keeps_the_data_starved_condition() -> None:
    previous = {
        "conditions": [
            {"type": "DataStarved", "status": "True", "reason": "ReadersWaitingOnData"},
        ]
    }
    built = status.build_status(
        status.Resolved(digest="sha256:x", format="parquet", shards=1, rows=1, bytes=1),
        previous=previous,
        generation=2,
        now="T",
        resolved_source=None,
    )
    kinds = {c["type"]: c["status"] for c in built["conditions"]}
    assert kinds["DataStarved"] == "True" and kinds["Ready"] == "True"


def test_the_stall_timer_runs_for_mounts_with_pods_or_a_condition_to_clear() -> None:
    from shardcache_operator import handlers

    def body(status: dict[str, Any]) -> Any:
        return {"status": status}

    assert handlers.watches_stalls(body=body({"attachedPods": 2}))
    starved = {"type": "DataStarved", "status": "True"}
    assert handlers.watches_stalls(body=body({"attachedPods": 0, "conditions": [starved]}))
    assert not handlers.watches_stalls(body=body({"attachedPods": 0}))
    assert not handlers.watches_stalls(body=body({}))


def test_zero_stall_check_seconds_registers_no_stall_timer() -> None:
    import kopf
    from shardcache_operator import configuration, handlers

    def timers(seconds: float) -> set[str]:
        registry = kopf.OperatorRegistry()
        handlers.register(registry, configuration.Settings(stall_check_seconds=seconds))
        return {h.id for h in registry._spawning.get_all_handlers()}

    assert "check-stalls" in timers(30.0)
    assert "check-stalls" not in timers(0.0)
