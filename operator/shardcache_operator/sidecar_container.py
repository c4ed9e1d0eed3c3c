"""The cache sidecar container of one mount: a native sidecar with probes and a
locked-down security context.

Appended to `initContainers` with `restartPolicy: Always`, so it starts before the
trainers, runs beside them and stops after them; its startup probe on /readyz holds
the trainers back until the manifest is verified and the first shards are warm.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shardcache.contract import parsers, protocol, variables
from shardcache_operator import pod_names, specs


def _probe(path: str, port: int, *, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "timeoutSeconds": 2,
        "failureThreshold": failures,
    }


def _limits(resources: specs.ResourcesSpec, extra: int) -> dict[str, str]:
    """The limits, with the memory limit raised by `extra` bytes when there is one."""
    limits = dict(resources.limits)
    if extra and "memory" in limits:
        # Whole bytes, a fraction rounded up as Kubernetes does ("1.3Gi" is valid).
        memory = specs.memory_bytes(limits["memory"], path="spec.sidecar.resources.limits.memory")
        limits["memory"] = parsers.quantity(memory + extra)
    return limits


def _requests(resources: specs.ResourcesSpec, extra: int, limits: dict[str, str]) -> dict[str, str]:
    """The requests, with the memory request raised by `extra` bytes as the limit is.

    The memory tier's tmpfs pages are node memory the pod holds (charged to the
    sidecar's cgroup) whether or not a limit is set: a request without them let the
    scheduler place a 64Gi tier as 256Mi and overcommit the node's memory its
    neighbours depend on. Capped at the raised limit, which the spec allows a request
    up to (`specs._sidecar_requests_within_limits`): the API server refuses a request
    above its limit.
    """
    requests = dict(resources.requests)
    if extra and "memory" in requests:
        path = "spec.sidecar.resources.requests.memory"
        memory = specs.memory_bytes(requests["memory"], path=path) + extra
        if "memory" in limits:
            memory = min(memory, specs.memory_bytes(limits["memory"], path=path))
        requests["memory"] = parsers.quantity(memory)
    return requests


def build(
    spec: specs.DatasetMountSpec,
    names: pod_names.MountNames,
    *,
    image: str,
    env: list[dict[str, Any]],
    volume_mounts: Sequence[dict[str, Any]],
    run_as_user: int,
    startup_timeout_seconds: int,
) -> dict[str, Any]:
    """The container; `image` is the operator's default, used when the spec names none."""
    port = names.port
    extra_memory = specs.sidecar_memory_raise(spec.cache)
    limits = _limits(spec.sidecar.resources, extra_memory)
    sidecar: dict[str, Any] = {
        "name": names.sidecar,
        "image": spec.sidecar.image or image,
        "imagePullPolicy": spec.sidecar.image_pull_policy,
        "command": ["shardcache", "sidecar"],
        # A native sidecar: starts before the trainers, runs beside them, stops after.
        "restartPolicy": "Always",
        "env": env,
        "ports": [{"name": names.port_name, "containerPort": port, "protocol": "TCP"}],
        "startupProbe": _probe(
            protocol.READYZ, port, period=1, failures=max(1, startup_timeout_seconds)
        ),
        "readinessProbe": _probe(protocol.READYZ, port, period=5, failures=3),
        "livenessProbe": _probe(protocol.HEALTHZ, port, period=10, failures=6),
        "resources": {
            "requests": _requests(spec.sidecar.resources, extra_memory, limits),
            "limits": limits,
        },
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": run_as_user,
            "runAsGroup": run_as_user,
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumeMounts": list(volume_mounts),
        # Where the sidecar writes why it exits (a refusal, unusable tier directories),
        # which `kubectl describe pod` shows; a crash that wrote nothing shows its last
        # log lines instead. The path is the one the sidecar writes by default.
        "terminationMessagePath": variables.TERMINATION_MESSAGE_PATH.required_default,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if spec.source.secret_ref is not None:
        # Credentials reach the sidecar only; trainer containers never see them. The env
        # comes first; the Secret's files (`pod_volumes.credentials_volume`, when mounted)
        # bring a key rotated while the pod runs.
        sidecar["envFrom"] = [{"secretRef": {"name": spec.source.secret_ref.name}}]
    return sidecar
