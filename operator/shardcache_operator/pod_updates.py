"""What an UPDATE may not change in a pod the cache was injected into (docs/security.md).

The webhook injects at CREATE, but a pod stays mutable in two places that reach what
only the cache sidecar holds, the DatasetMount's Secret (`envFrom`, and the secret
volume of its files) and the node disk tier (a hostPath):

* `spec.initContainers[*].image` can be patched by anyone who may patch the pod: the
  sidecar would then run their image, with the Secret and the node directory;
* `kubectl debug` adds ephemeral containers (an UPDATE of `pods/ephemeralcontainers`):
  one could mount the disk tier's or the Secret's volume, or join the sidecar's process
  namespace (`targetContainerName`) and read its `/proc/<pid>/environ`.

So the webhook, which also sees UPDATEs of opted-in pods, refuses one that changes an
injected container in any way, or that adds an ephemeral container targeting one or
mounting a volume only the injected containers mount. Every other UPDATE is admitted
as sent, with no patch and no DatasetMount read: `refusal` stops at the first look
for a pod without injected containers, which is most of the traffic.

Pure, and total: the objects come from the API server, but a field of the wrong type
answers a refusal naming it, never an exception (a 500 would block the update).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardcache import contract

#: The ephemeral containers subresource (`kubectl debug`): an UPDATE of the pod.
EPHEMERAL_SUBRESOURCE = "ephemeralcontainers"


def _list(value: Any) -> list[Mapping[str, Any]]:
    """The mappings of a list field; anything else counts as none (the API server has
    validated both objects, and the refusal needs only what is well-formed)."""
    if not isinstance(value, list):
        return []
    return [item for item in value if isinstance(item, Mapping)]


def _spec(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    spec = pod.get("spec")
    return spec if isinstance(spec, Mapping) else {}


def served_mount(container: Mapping[str, Any]) -> str | None:
    """The DatasetMount an injected container serves ($SHARDCACHE_MOUNT), else None."""
    for entry in _list(container.get("env")):
        if entry.get("name") == contract.ENV_MOUNT:
            return str(entry.get("value"))
    return None


def injected_containers(pod: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """The pod's init containers that serve a DatasetMount, by name: the sidecars the
    webhook injected (and any a pod author forged, which protecting costs nothing).

    Trainers carry $SHARDCACHE_MOUNT too, but they are `containers`, never init
    containers; the `shardcache.io/injected` annotation is not needed and not trusted.
    """
    return {
        str(c.get("name")): c
        for c in _list(_spec(pod).get("initContainers"))
        if served_mount(c) is not None
    }


def _mounted(container: Mapping[str, Any]) -> set[str]:
    return {
        str(m.get("name"))
        for field in ("volumeMounts", "volumeDevices")
        for m in _list(container.get(field))
    }


def _sidecar_only_volumes(
    pod: Mapping[str, Any], injected: Mapping[str, Mapping[str, Any]]
) -> set[str]:
    """Volumes the injected containers mount and no other container of the pod does:
    the node disk tier, the source's credentials (`pod_volumes.credentials_volume`) and
    the handed manifests (`manifest_handoff`; nothing secret, but the sidecar's). The
    run and checkpoint volumes are the trainers' too, so a debug container may look at
    them as the trainer can; ephemeral containers already there do not count (one could
    predate this check)."""
    theirs = set().union(*(_mounted(c) for c in injected.values()))
    spec = _spec(pod)
    others = [
        *_list(spec.get("containers")),
        *(c for c in _list(spec.get("initContainers")) if str(c.get("name")) not in injected),
    ]
    return theirs - set().union(*(_mounted(c) for c in others))


def _changed_fields(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


def refusal(old: Mapping[str, Any], new: Mapping[str, Any]) -> str | None:
    """Why the UPDATE of `old` into `new` is refused, or None to admit it unchanged."""
    injected = injected_containers(old)
    if not injected:
        return None
    after = {str(c.get("name")): c for c in _list(_spec(new).get("initContainers"))}
    for name, before in injected.items():
        mount = served_mount(before)
        now = after.get(name)
        if now == before:
            continue
        found = (
            "it is gone" if now is None else f"changed: {', '.join(_changed_fields(before, now))}"
        )
        return (
            f"init container {name!r} is the cache sidecar of DatasetMount {mount}, and "
            "holds its credentials and the node cache: expected it exactly as injected, "
            f"found it {found}; to run the pod otherwise, delete it and create it again"
        )
    ephemeral = _list(_spec(new).get("ephemeralContainers"))
    if not ephemeral:
        return None
    before_ephemeral = {str(c.get("name")) for c in _list(_spec(old).get("ephemeralContainers"))}
    own = _sidecar_only_volumes(old, injected)
    for index, container in enumerate(ephemeral):
        name = str(container.get("name"))
        if name in before_ephemeral:
            continue  # the API server keeps existing ones as they are
        where = f"ephemeral container {name!r} (spec.ephemeralContainers[{index}])"
        target = container.get("targetContainerName")
        if isinstance(target, str) and target in injected:
            choices = ", ".join(str(c.get("name")) for c in _list(_spec(old).get("containers")))
            return (
                f"{where} targets {target!r}, the cache sidecar of DatasetMount "
                f"{served_mount(injected[target])}: its processes' environment holds "
                f"the source's credentials; expected a target among the pod's containers "
                f"({choices or 'none'}), or none"
            )
        taken = sorted(_mounted(container) & own)
        if taken:
            return (
                f"{where} mounts {', '.join(repr(v) for v in taken)}, a volume only the "
                "cache sidecar mounts (the node disk tier, shared with other pods of the "
                "node, or the source's credentials): expected only volumes the pod's own "
                "containers mount"
            )
    return None
