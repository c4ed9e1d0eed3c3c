"""`shardcache inject`: the webhook's injection applied to YAML files, offline.

Like `istioctl kube-inject`: for GitOps (commit the injected manifests) and for
debugging (see exactly what the webhook would add). Same pure function as the webhook.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from shardcache import errors
from shardcache_operator import injection, specs

#: Where each supported kind keeps its pod (template); () is the document itself.
POD_PATHS: dict[str, tuple[str, ...]] = {
    "Pod": (),
    "Job": ("spec", "template"),
    "CronJob": ("spec", "jobTemplate", "spec", "template"),
    "Deployment": ("spec", "template"),
    "StatefulSet": ("spec", "template"),
    "DaemonSet": ("spec", "template"),
    "ReplicaSet": ("spec", "template"),
}


def load_mounts(documents: Sequence[object], *, source: str) -> dict[str, specs.DatasetMount]:
    """DatasetMounts from the documents of one --mount file; anything else is an error."""
    mounts: dict[str, specs.DatasetMount] = {}
    for index, doc in enumerate(documents, start=1):
        if doc is None:
            continue
        try:
            mount = specs.load(doc)
        except errors.InputError as exc:
            raise errors.InputError(f"{source}, document {index}: {exc}") from exc
        mounts[mount.name] = mount
    if not mounts:
        raise errors.InputError(f"{source}: expected a DatasetMount, found no documents")
    return mounts


def _pod_of(doc: Mapping[str, Any], where: str) -> tuple[dict[str, Any], tuple[str, ...]]:
    kind = doc.get("kind")
    if kind not in POD_PATHS:
        raise errors.InputError(
            f"{where}: cannot inject into kind {kind!r}; expected one of {', '.join(POD_PATHS)}"
        )
    node: Any = doc
    for key in POD_PATHS[str(kind)]:
        node = node.get(key) if isinstance(node, Mapping) else None
    if not isinstance(node, dict) or not isinstance(node.get("spec"), dict):
        path = ".".join(POD_PATHS[str(kind)]) or "the document"
        raise errors.InputError(f"{where}: {kind} has no pod spec at {path}")
    return node, POD_PATHS[str(kind)]


def _indexed(doc: Mapping[str, Any]) -> bool | None:
    kind = doc.get("kind")
    if kind == "Job":
        return bool((doc.get("spec") or {}).get("completionMode") == "Indexed")
    if kind == "CronJob":
        job = ((doc.get("spec") or {}).get("jobTemplate") or {}).get("spec") or {}
        return bool(job.get("completionMode") == "Indexed")
    return None if kind == "Pod" else False


def inject_document(
    doc: object,
    mounts: Mapping[str, specs.DatasetMount],
    *,
    defaults: injection.SidecarDefaults,
    where: str,
) -> tuple[object, list[str]]:
    """The document with mounts injected into its pod (template), and warnings.

    A pod that carries the opt-in label gets the mounts it names (each must be among
    `mounts`); one without it gets every mount, and the label is added so the
    operator counts it as attached.
    """
    if doc is None:
        return None, []
    if not isinstance(doc, dict):
        raise errors.InputError(f"{where}: expected a Kubernetes object, found {doc!r:.60}")
    pod, path = _pod_of(doc, where)
    metadata = pod.setdefault("metadata", {})
    wanted = injection.requested_mounts(metadata)
    if not wanted:
        wanted = list(mounts)
        labels = metadata.setdefault("labels", {})
        label = injection.MOUNT_SEPARATOR.join(wanted)
        if len(label) <= 63:
            labels[injection.LABEL_MOUNT] = label
        else:
            labels[injection.LABEL_MOUNT] = wanted[0]
            metadata.setdefault("annotations", {})[injection.ANNOTATION_MOUNTS] = ",".join(
                wanted[1:]
            )
    missing = [name for name in wanted if name not in mounts]
    if missing:
        raise errors.InputError(
            f"{where}: the pod asks for DatasetMount {', '.join(missing)}, "
            "which no --mount file defines"
        )
    warnings = [
        f"{where}: DatasetMount {name} has no pinned digest (no status.manifestDigest or "
        "spec.source.version); the sidecar will resolve the manifest itself"
        for name in wanted
        if not mounts[name].manifest_digest
    ]
    selected = [
        injection.Mount(
            name=name,
            spec=mounts[name].spec,
            digest=mounts[name].manifest_digest,
            namespace=mounts[name].namespace,
            source_digests=mounts[name].source_digests,
        )
        for name in wanted
    ]
    try:
        injected = injection.inject(pod, selected, defaults=defaults, indexed_job=_indexed(doc))
    except errors.InputError as exc:
        raise errors.InputError(f"{where}: {exc}") from exc
    if not path:
        return injected, warnings
    parent: Any = doc
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = injected
    return doc, warnings
