"""Watching and poking pods on the real node: waits, logs, exec, and a kill -9 from the
host (the test runs as root on the node's machine, so it sees the containers' processes).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
from collections.abc import Callable
from typing import Any

import kubernetes.client
from kubernetes.client.rest import ApiException

from tests.e2e import harness
from tests.node.product import jobs

#: A Job of two ranks here: sandboxes, two Python sidecars warming up, two trainers, on
#: two cores shared with the control plane. A minute or two; five is a hang.
JOB_TIMEOUT_S = 300.0
SIDECAR_PREFIX = "shardcache-"


def describe(core: kubernetes.client.CoreV1Api, namespace: str) -> str:
    """Every pod's phase and container states, and the namespace's recent events."""
    lines = []
    for pod in core.list_namespaced_pod(namespace).items:
        lines.append(f"pod {pod.metadata.name}: {pod.status.phase} on {pod.spec.node_name}")
        statuses = [*(pod.status.init_container_statuses or []),
                    *(pod.status.container_statuses or [])]  # fmt: skip
        for status in statuses:
            lines.append(
                f"  {status.name}: restarts={status.restart_count} state={status.state.to_dict()}"
                f" last={status.last_state.to_dict() if status.last_state else None}"
            )
    events = core.list_namespaced_event(namespace).items
    for event in sorted(events, key=lambda e: str(e.last_timestamp or e.event_time))[-25:]:
        lines.append(f"event {event.involved_object.name}: {event.reason} {event.message}")
    return "\n".join(lines)


def log(core: kubernetes.client.CoreV1Api, namespace: str, pod: str, container: str) -> str:
    try:
        return str(core.read_namespaced_pod_log(pod, namespace, container=container))
    except ApiException as exc:
        return f"(no log of {pod}/{container}: {exc.status} {exc.reason})"


def wait_job_complete(
    admin: kubernetes.client.ApiClient, namespace: str, name: str, *, timeout: float = JOB_TIMEOUT_S
) -> kubernetes.client.V1Job:
    batch = kubernetes.client.BatchV1Api(admin)
    core = kubernetes.client.CoreV1Api(admin)

    def done() -> kubernetes.client.V1Job | None:
        job = batch.read_namespaced_job(name, namespace)
        for cond in job.status.conditions or []:
            if cond.status == "True" and cond.type == "Failed":
                raise AssertionError(
                    f"Job {name} failed: {cond.message}\n{describe(core, namespace)}"
                )
            if cond.status == "True" and cond.type == "Complete":
                return job
        return None

    return harness.wait_until(
        f"Job {namespace}/{name} to complete",
        done,
        timeout=timeout,
        interval=2,
        describe=lambda: describe(core, namespace) + "\n" + trainer_logs(core, namespace),
    )


def trainer_logs(core: kubernetes.client.CoreV1Api, namespace: str) -> str:
    parts = []
    for pod in core.list_namespaced_pod(namespace).items:
        text = log(core, namespace, pod.metadata.name, jobs.TRAINER_CONTAINER)
        parts.append(
            f"--- {pod.metadata.name}/trainer (tail)\n" + "\n".join(text.splitlines()[-8:])
        )
    return "\n".join(parts)


def job_pods(core: kubernetes.client.CoreV1Api, namespace: str, job: str) -> list[Any]:
    listing = core.list_namespaced_pod(namespace, label_selector=f"job-name={job}")
    return sorted(listing.items, key=lambda p: p.metadata.creation_timestamp)


def sidecar_status(pod: Any) -> Any:
    """The injected cache sidecar's status (an init container with restartPolicy Always)."""
    found = [
        s for s in pod.status.init_container_statuses or [] if s.name.startswith(SIDECAR_PREFIX)
    ]
    assert len(found) == 1, f"expected one injected sidecar in {pod.metadata.name}: {found}"
    return found[0]


def container_status(pod: Any, name: str) -> Any:
    found = [s for s in pod.status.container_statuses or [] if s.name == name]
    assert found, f"no container {name} in {pod.metadata.name}"
    return found[0]


def started_at(status: Any) -> Any:
    state = status.state
    if state.running is not None:
        return state.running.started_at
    if state.terminated is not None:
        return state.terminated.started_at
    raise AssertionError(f"{status.name} never started: {state}")


def wait_pod(
    core: kubernetes.client.CoreV1Api,
    namespace: str,
    name: str,
    check: Callable[[Any], bool],
    what: str,
    *,
    timeout: float = JOB_TIMEOUT_S,
) -> Any:
    def ready() -> Any:
        pod = core.read_namespaced_pod(name, namespace)
        if pod.status.phase == "Failed":
            raise AssertionError(f"pod {name} failed\n{describe(core, namespace)}")
        return pod if check(pod) else None

    return harness.wait_until(
        f"pod {namespace}/{name}: {what}",
        ready,
        timeout=timeout,
        interval=1,
        describe=lambda: describe(core, namespace) + "\n" + trainer_logs(core, namespace),
    )


def wait_event(
    core: kubernetes.client.CoreV1Api,
    namespace: str,
    pod: str,
    check: Callable[[dict[str, Any]], bool],
    what: str,
    *,
    timeout: float = JOB_TIMEOUT_S,
) -> dict[str, Any]:
    """Poll the trainer's log until one of its events satisfies `check`."""

    def seen() -> dict[str, Any] | None:
        # Read the state first: a trainer that has exited has written all it will.
        state = core.read_namespaced_pod(pod, namespace)
        text = log(core, namespace, pod, jobs.TRAINER_CONTAINER)
        found = next((e for e in jobs.events(text) if check(e)), None)
        statuses = [s for s in state.status.container_statuses or [] if s.state.terminated]
        if found is None and any(s.name == jobs.TRAINER_CONTAINER for s in statuses):
            raise AssertionError(
                f"the trainer of {namespace}/{pod} exited before {what}; its log:\n"
                + "\n".join(text.splitlines()[-30:])
            )
        return found

    return harness.wait_until(
        f"trainer of {namespace}/{pod}: {what}",
        seen,
        timeout=timeout,
        interval=0.5,
        describe=lambda: describe(core, namespace) + "\n" + trainer_logs(core, namespace),
    )


def exec_python(
    cluster: harness.Cluster, namespace: str, pod: str, container: str, code: str
) -> str:
    """Run `python3 -c code` inside a running container (its image's own interpreter)."""
    result = cluster.run(
        "kubectl", "-n", namespace, "exec", pod, "-c", container, "--", "python3", "-c", code
    )
    return result.stdout


def host_pids(container_id: str) -> list[int]:
    """Processes of a container, seen from the host: its id is in their cgroup paths."""
    cid = container_id.split("://", 1)[-1]
    pids = []
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cgroups = (entry / "cgroup").read_text()
        except OSError:
            continue
        if cid in cgroups:
            pids.append(int(entry.name))
    return pids


def kill_9(container_id: str) -> list[int]:
    """SIGKILL every process of the container: what an OOM kill or a crash looks like."""
    pids = host_pids(container_id)
    assert pids, f"no host process belongs to container {container_id}"
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids
