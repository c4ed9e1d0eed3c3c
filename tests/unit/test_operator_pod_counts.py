"""status.attachedPods from pod events: one write per changed count, none otherwise."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from shardcache_operator import metrics, mounts, pod_counts, pod_watch

pytestmark = pytest.mark.unit


def dsm(name: str, attached: int | None) -> dict[str, Any]:
    status = {} if attached is None else {"attachedPods": attached}
    return {"metadata": {"name": name, "namespace": "ml"}, "status": status}


def store(*objs: dict[str, Any]) -> mounts.Store:
    """The operator's DatasetMount watch, listed with `objs`."""
    result = mounts.Store()
    result.listed(objs)
    return result


class Recorder:
    def __init__(self, fail: int = 0) -> None:
        self.calls: list[tuple[str, str, int]] = []
        self.fail = fail

    async def __call__(self, namespace: str, name: str, count: int) -> None:
        if self.fail:
            self.fail -= 1
            raise RuntimeError("429 Too Many Requests")
        self.calls.append((namespace, name, count))


async def test_only_mounts_whose_count_changed_are_written_once() -> None:
    writer, meters, write = pod_counts.Writer(), metrics.Metrics(), Recorder()
    known = store(dsm("a", 2), dsm("b", 0), dsm("c", None))
    pods = {("ml", "a"): ["p1", "p2"], ("ml", "b"): ["p3"], ("ml", "x"): ["p4"]}
    writer.touch(pods, known)
    assert await writer.flush(write, meters) == 2
    assert sorted(write.calls) == [("ml", "b", 1), ("ml", "c", 0)]
    # Written but not yet seen back through the watch: not written again.
    assert await writer.flush(write, meters) == 0
    sample = meters.registry.get_sample_value
    assert (
        sample("shardcache_operator_attached_pods", {"namespace": "ml", "datasetmount": "a"}) == 2
    )
    assert sample("shardcache_operator_pod_count_writes_total") == 2


async def test_a_failed_write_is_retried_on_the_next_flush() -> None:
    writer, meters, write = pod_counts.Writer(), metrics.Metrics(), Recorder(fail=1)
    writer.touch({("ml", "a"): ["p1"]}, store(dsm("a", 0)))
    assert await writer.flush(write, meters) == 0
    assert await writer.flush(write, meters) == 1
    assert write.calls == [("ml", "a", 1)]


async def test_a_burst_of_touches_becomes_one_write_and_idle_means_no_wakeups() -> None:
    writer, meters, write = pod_counts.Writer(), metrics.Metrics(), Recorder()
    known = store(dsm("a", 0))
    pods: dict[tuple[str, str], list[str]] = {("ml", "a"): []}
    task = asyncio.create_task(writer.run(write, meters, interval=0.2))
    try:
        for i in range(50):
            pods[("ml", "a")].append(f"p{i}")
            writer.touch(pods, known)
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.5)
        assert write.calls == [("ml", "a", 50)]
        await asyncio.sleep(0.5)  # nothing touched it: nothing written
        assert write.calls == [("ml", "a", 50)]
    finally:
        task.cancel()


class Hold:
    """A `crd_version.Gate.problem` stand-in: a reason until `lift`."""

    def __init__(self, reason: str | None) -> None:
        self.reason = reason
        self.asked = 0

    async def __call__(self) -> str | None:
        self.asked += 1
        return self.reason


async def test_no_count_is_written_while_the_crd_is_older_and_all_are_once_it_is_current() -> None:
    writer, meters, write = pod_counts.Writer(), metrics.Metrics(), Recorder()
    hold = Hold("the installed CRD is schema version 0, this operator needs 2")
    writer.touch({("ml", "a"): ["p1"]}, store(dsm("a", 0), dsm("b", 3)))
    assert await writer.flush(write, meters, hold=hold) == 0
    assert write.calls == []
    assert writer.held == hold.reason
    # The gauge prunes nothing: it still follows the pods.
    sample = meters.registry.get_sample_value
    assert (
        sample("shardcache_operator_attached_pods", {"namespace": "ml", "datasetmount": "a"}) == 1
    )
    hold.reason = None
    assert await writer.flush(write, meters, hold=hold) == 2
    assert sorted(write.calls) == [("ml", "a", 1), ("ml", "b", 0)]
    assert writer.held is None


async def test_a_held_writer_looks_again_without_a_pod_event() -> None:
    """Applying the CRDs changes no pod: the writer must look again by itself."""
    writer, meters, write = pod_counts.Writer(), metrics.Metrics(), Recorder()
    hold = Hold("the installed CRD is older")
    writer.touch({("ml", "a"): ["p1", "p2"]}, store(dsm("a", 0)))
    task = asyncio.create_task(writer.run(write, meters, interval=0.01, hold=hold, recheck=0.1))
    try:
        await asyncio.sleep(0.05)
        assert write.calls == []
        hold.reason = None
        await asyncio.sleep(0.3)
        assert write.calls == [("ml", "a", 2)]
    finally:
        task.cancel()


async def test_counts_go_to_the_mounts_the_operator_watch_shows_not_to_deleted_ones() -> None:
    """After a peering pause kopf's index kept deleted mounts and missed new ones: the
    writer follows the operator's own watch, so a deleted mount gets no write (no 404
    every interval) and one created meanwhile gets its count."""
    writer, meters, write = pod_counts.Writer(), metrics.Metrics(), Recorder()
    known = store(dsm("old", 0))
    pods = {("ml", "old"): ["p1"], ("ml", "new"): ["p2", "p3"]}
    writer.touch(pods, known)
    # While this replica was paused: "old" deleted, "new" created; the watch relists.
    known.listed([dsm("new", None)])
    assert await writer.flush(write, meters) == 1
    assert write.calls == [("ml", "new", 2)]


async def test_nothing_is_written_while_the_mount_watch_reconnects() -> None:
    """A broken watch may show deleted mounts and miss new ones: wait for its LIST."""
    writer, meters, write = pod_counts.Writer(), metrics.Metrics(), Recorder()
    known = store(dsm("a", 0))
    writer.touch({("ml", "a"): ["p1"]}, known)
    known.lost()
    assert await writer.flush(write, meters) == 0
    known.listed([dsm("a", 0)])
    assert await writer.flush(write, meters) == 1
    assert write.calls == [("ml", "a", 1)]


def gauges(meters: metrics.Metrics, name: str) -> tuple[float | None, float | None]:
    """(attached_pods, pods_on_older_pin) of ml/`name`; None for a series not exported."""
    labels = {"namespace": "ml", "datasetmount": name}
    sample = meters.registry.get_sample_value
    return (
        sample("shardcache_operator_attached_pods", labels),
        sample("shardcache_operator_pods_on_older_pin", labels),
    )


async def test_a_mount_gone_from_the_watch_loses_its_pod_gauges() -> None:
    """Each flush set the gauges of every watched mount and removed none: a mount
    deleted (or gone at a relist) kept exporting its last counts. On a standby replica
    nothing else removes them (the delete handler runs on the active one only)."""
    writer, meters, write = pod_counts.Writer(), metrics.Metrics(), Recorder()
    pods = pod_watch.Index()
    pods.set("ml", "p1", ("a",))
    pods.set("ml", "p2", ("b",))
    known = store(dsm("a", 1), dsm("b", 1))
    writer.touch(pods, known)
    await writer.flush(write, meters)
    assert gauges(meters, "a") == gauges(meters, "b") == (1, 0)
    known.seen("DELETED", dsm("a", 1))
    await writer.flush(write, meters)
    assert gauges(meters, "a") == (None, None)
    assert gauges(meters, "b") == (1, 0)
    known.listed([])  # a relist without "b"
    await writer.flush(write, meters)
    assert gauges(meters, "b") == (None, None)


async def test_a_flush_between_the_delete_handler_and_the_deleted_event_does_not_keep_the_series() -> (
    None
):
    """The delete handler removes the series (`Metrics.set_phase(None)`), but the mount
    stays in the watch until its DELETED event: a flush in between set them again, and
    they stayed. They go at the next flush after the event, and stay gone, even while
    pods labelled with the mount are still in the pod index (a forced deletion)."""
    writer, meters, write = pod_counts.Writer(), metrics.Metrics(), Recorder()
    pods = pod_watch.Index()
    pods.set("ml", "p1", ("a",))
    known = store(dsm("a", 1))
    writer.touch(pods, known)
    await writer.flush(write, meters)
    meters.set_phase("ml", "a", None)  # the finalizer released it
    assert gauges(meters, "a") == (None, None)
    await writer.flush(write, meters)  # the DELETED event is not in yet
    assert gauges(meters, "a") == (1, 0)
    known.seen("DELETED", dsm("a", 1))
    await writer.flush(write, meters)
    assert gauges(meters, "a") == (None, None)
    await writer.flush(write, meters)
    assert gauges(meters, "a") == (None, None)
    assert 'datasetmount="a"' not in meters.exposition().decode()


def ready_series(meters: metrics.Metrics, name: str) -> float | None:
    labels = {"namespace": "ml", "datasetmount": name}
    return meters.registry.get_sample_value("shardcache_operator_datasetmount_ready", labels)


def phase_count(meters: metrics.Metrics, phase: str) -> float | None:
    return meters.registry.get_sample_value("shardcache_operator_datasetmounts", {"phase": phase})


async def test_every_replica_exports_each_watched_mounts_readiness_and_forgets_a_deleted_one() -> (
    None
):
    """`datasetmount_ready` and the per-phase count were set by the reconcile handlers
    and removed by the delete handler, both on the active replica only: a standby never
    exported them, one that had been active kept the phases it last wrote, and a mount
    whose finalizer went without the delete handler (a replica that lost the lease
    between) was reported not Ready, for the alert, until a restart."""
    writer, meters, write = pod_counts.Writer(), metrics.Metrics(), Recorder()
    ready, pending = dsm("a", 0), dsm("b", 0)
    ready["status"]["phase"], pending["status"]["phase"] = "Ready", "Pending"
    known = store(ready, pending, dsm("c", None))  # "c": not reconciled yet
    writer.touch(pod_watch.Index(), known)
    await writer.flush(write, meters)
    assert (ready_series(meters, "a"), ready_series(meters, "b")) == (1, 0)
    assert ready_series(meters, "c") is None
    assert (phase_count(meters, "Ready"), phase_count(meters, "Pending")) == (1, 1)
    pending["status"]["phase"] = "Ready"
    known.seen("MODIFIED", pending)
    known.seen("DELETED", ready)
    await writer.flush(write, meters)
    assert (ready_series(meters, "a"), ready_series(meters, "b")) == (None, 1)
    assert (phase_count(meters, "Ready"), phase_count(meters, "Pending")) == (1, 0)
