"""`shardcache inject`: the webhook's injection applied to YAML files, offline.

Like `istioctl kube-inject`: for GitOps (commit the injected manifests) and for
debugging (see exactly what the webhook would add). Same pure function as the webhook.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from shardcache import errors
from shardcache_operator import injection, namespace_dirs, specs

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


def namespace_uids(
    given: Sequence[str], mounts: Mapping[str, specs.DatasetMount]
) -> dict[str, str]:
    """The `--namespace-uid NAMESPACE=UID` arguments, by namespace: each a namespace of
    one of `mounts` with a UID the API server gives (a lowercase UUID), at most once."""
    namespaces = sorted({m.namespace for m in mounts.values() if m.namespace})
    uids: dict[str, str] = {}
    for text in given:
        namespace, sep, uid = text.partition("=")
        if not sep or not namespace:
            raise errors.InputError(f"--namespace-uid: expected NAMESPACE=UID, found {text!r}")
        if namespace not in namespaces:
            raise errors.InputError(
                f"--namespace-uid {text}: expected the namespace of a --mount's "
                f"DatasetMount ({', '.join(namespaces) or 'they name none'}), found "
                f"{namespace!r}"
            )
        if namespace in uids and uids[namespace] != uid:
            raise errors.InputError(
                f"--namespace-uid: namespace {namespace} given two UIDs, "
                f"{uids[namespace]} and {uid}"
            )
        try:
            uids[namespace] = namespace_dirs.check_uid(uid, namespace=namespace)
        except ValueError as exc:
            raise errors.InputError(f"--namespace-uid: {exc}") from exc
    return uids


def unkeyed(mounts: Mapping[str, specs.DatasetMount], uids: Mapping[str, str]) -> list[str]:
    """A warning for each namespace of `mounts` whose UID was not given: its pods' node
    disk directory is keyed by the name alone."""
    namespaces = sorted({m.namespace for m in mounts.values() if m.namespace} - set(uids))
    return [
        f"namespace {ns}: its node disk directory is keyed by the name alone (ns-{ns}): "
        "a namespace deleted and created again with that name would be given what this "
        f"one cached there (docs/security.md); pass --namespace-uid {ns}=<its "
        "metadata.uid> to key it as the webhook does"
        for ns in namespaces
    ]


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
    namespace_uids: Mapping[str, str] | None = None,
) -> tuple[object, list[str]]:
    """The document with mounts injected into its pod (template), and warnings.

    A pod that carries the opt-in label gets the mounts it names (each must be among
    `mounts`); one without it gets every mount, and the label is added so the
    operator counts it as attached. `namespace_uids`: the UID of each mount's namespace
    that is known (`--namespace-uid`), which keys its node disk directory as the
    webhook does; one without it gets `ns-<namespace>`, keyed by the name alone
    (`unkeyed`).
    """
    uids = namespace_uids or {}
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
            namespace_uid=uids.get(mounts[name].namespace or ""),
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
