"""Pinned manifests handed to the sidecars in ConfigMaps: their names, bodies and the
volume that projects them into a sidecar.

A resolve reads the whole dataset to hash it; so would the first sidecar of the pin on
each node, before it is ready (`shardcache.node.handed_manifests` says why and how the
sidecar checks what it is handed). Where the chart lets it (`rbac.manifestNamespaces`:
the operator may write ConfigMaps in no other namespace), the operator writes the
manifest it just pinned, gzipped, as up to `handed_manifests.MAX_PARTS` ConfigMaps
owned by the DatasetMount, and the webhook projects them into the mount's sidecar,
each optional: a missing one (too large to hand, not written yet, deleted) costs the
sidecar a resolve, never its start. A pin kept without them is handed later
(`manifest_backfill`). Pure functions but `hand`: the reconcile writes the bodies
(`kube.Api.put_config_map`), the webhook mounts the volume.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from shardcache import errors
from shardcache.contract import variables
from shardcache.node import handed_manifests
from shardcache_operator import specs

logger = logging.getLogger(__name__)

#: The key of spec.source among a mount's handed manifests; a mixture's further
#: sources are keyed by their names (which the spec model keeps apart from this one).
PRIMARY = ""
#: Labels of every ConfigMap written here: whose it is, and which mount's.
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "shardcache"
LABEL_MOUNT = "shardcache.io/datasetmount"
#: The annotations that say which pin a ConfigMap hands, and which part it is, for a
#: person looking at it (the sidecar checks the manifest itself, never these).
ANNOTATION_DIGEST = "shardcache.io/manifest-digest"
ANNOTATION_PART = "shardcache.io/manifest-part"
#: How many parts hand the pin: "0" on the one ConfigMap (part 0, without data) that
#: says the pin was looked at and is too large to hand, so nobody resolves it again to
#: hand it (`manifest_backfill`).
ANNOTATION_PARTS = "shardcache.io/manifest-parts"
#: On that part 0: why it holds no data (`TOO_LARGE`).
ANNOTATION_NOT_HANDED = "shardcache.io/manifest-not-handed"
#: The reason of the Warning Event when a manifest could not be handed.
REASON = "ManifestNotHanded"
#: Where the webhook mounts them in the sidecar (the contract table's default).
MOUNT_PATH = variables.HANDED_MANIFESTS_DIR.required_default


def config_map_name(mount: str, source: str, part: int) -> str:
    """The ConfigMap of `part` of the manifest handed for `source` of DatasetMount
    `mount`: a fixed name per mount and source (a re-pin replaces it), short whatever
    the mount's name (ConfigMap names are DNS subdomains, at most 253 characters)."""
    key = hashlib.sha256(f"{mount}|{source}".encode()).hexdigest()[:20]
    return f"shardcache-manifest-{key}-{part}"


def pinned_sources(
    spec: specs.DatasetMountSpec, digest: str | None, source_digests: Mapping[str, str]
) -> list[tuple[str, str, str]]:
    """(source key, URI, pinned digest) of each source of the mount that is pinned."""
    found: list[tuple[str, str, str]] = []
    if digest is not None:
        found.append((PRIMARY, spec.source.uri, digest))
    if spec.mixture is not None:
        for source in spec.mixture.sources:
            pinned = source_digests.get(source.name)
            if pinned is not None:
                found.append((source.name, source.uri, pinned))
    return found


def volume(name: str, mount: str, sources: Sequence[tuple[str, str, str]]) -> dict[str, Any] | None:
    """The projected volume `name` that hands the sidecar the manifests of `sources`
    (`pinned_sources`), each part optional; None when none is pinned or a URI names no
    source."""
    projected: list[dict[str, Any]] = []
    for key, uri, digest in sources:
        try:
            stem = handed_manifests.file_stem(digest, uri)
        except errors.InputError:  # an unusable URI: the sidecar refuses it, saying why
            continue
        for part in range(handed_manifests.MAX_PARTS):
            projected.append(
                {
                    "configMap": {
                        "name": config_map_name(mount, key, part),
                        "optional": True,
                        "items": [
                            {
                                "key": handed_manifests.DATA_KEY,
                                "path": handed_manifests.part_name(stem, part),
                            }
                        ],
                    }
                }
            )
    if not projected:
        return None
    return {"name": name, "projected": {"sources": projected, "defaultMode": 0o444}}


def volume_mount(name: str) -> dict[str, Any]:
    return {"name": name, "mountPath": MOUNT_PATH, "readOnly": True}


def config_maps(
    *,
    namespace: str,
    mount: str,
    owner: Mapping[str, Any],
    source: str,
    digest: str,
    parts: Sequence[bytes],
) -> list[dict[str, Any]]:
    """The ConfigMaps that hand `parts` of the manifest pinned as `digest` for `source`
    of `mount`, owned by the DatasetMount `owner` (its apiVersion, kind, name and uid):
    deleting the mount deletes them. No parts (too large to hand): one part 0 without
    data that says so (the sidecar's projection of a missing key is optional too)."""
    reference = {
        "apiVersion": str(owner["apiVersion"]),
        "kind": str(owner["kind"]),
        "name": str(owner["name"]),
        "uid": str(owner["uid"]),
        "blockOwnerDeletion": False,
    }

    def body(part: int, data: bytes | None) -> dict[str, Any]:
        annotations = {
            ANNOTATION_DIGEST: digest,
            ANNOTATION_PART: str(part),
            ANNOTATION_PARTS: str(len(parts)),
        }
        found: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": config_map_name(mount, source, part),
                "namespace": namespace,
                "labels": {LABEL_MANAGED_BY: MANAGED_BY, LABEL_MOUNT: mount},
                "annotations": annotations,
                "ownerReferences": [reference],
            },
        }
        if data is None:
            annotations[ANNOTATION_NOT_HANDED] = TOO_LARGE
        else:
            key = handed_manifests.DATA_KEY
            found["binaryData"] = {key: base64.b64encode(data).decode("ascii")}
        return found

    if not parts:
        return [body(0, None)]
    return [body(part, data) for part, data in enumerate(parts)]


#: Why a pin's manifest is not handed, on its part 0 (`ANNOTATION_NOT_HANDED`).
TOO_LARGE = (
    f"over {handed_manifests.PART_BYTES * handed_manifests.MAX_PARTS} bytes gzipped: each "
    "node's first sidecar of this pin reads the dataset to hash it"
)


def hands(found: Sequence[Mapping[str, Any] | None], digest: str) -> bool:
    """Whether the ConfigMaps `found` of a source's parts 0, 1, ... (None: not there;
    `kube.Api.read_config_map`'s metadata and keys) hand the pin `digest` whole, or say
    it is too large to hand: either way nothing is left to write for it.

    Parts an operator wrote before part 0 counted them hand it when part 0 does and
    the parts after it, up to the first missing, are of the same pin. A tail deleted by
    hand then goes unseen (the sidecars refuse the cut stream and resolve): cheaper than
    reading every such pin's dataset again after an upgrade."""
    first = found[0] if found else None
    if first is None:
        return False
    counted = _annotations(first).get(ANNOTATION_PARTS)
    if counted is None:
        parts = list(itertools.takewhile(lambda c: c is not None, found))
        return all(_of(c, digest, part, data=True) for part, c in enumerate(parts))
    count = int(counted) if str(counted).isdigit() else -1
    if not 0 <= count <= handed_manifests.MAX_PARTS or len(found) < max(count, 1):
        return False
    return all(_of(found[part], digest, part, data=count > 0) for part in range(max(count, 1)))


def _of(config_map: Mapping[str, Any] | None, digest: str, part: int, *, data: bool) -> bool:
    """Whether `config_map` is part `part` of pin `digest` (with its data, if `data`)."""
    if config_map is None:
        return False
    annotations = _annotations(config_map)
    if annotations.get(ANNOTATION_DIGEST) != digest:
        return False
    if annotations.get(ANNOTATION_PART) != str(part):
        return False
    return not data or handed_manifests.DATA_KEY in (config_map.get("keys") or ())


def _annotations(config_map: Mapping[str, Any]) -> Mapping[str, Any]:
    return (config_map.get("metadata") or {}).get("annotations") or {}


def owner(body: Mapping[str, Any]) -> dict[str, Any]:
    """The DatasetMount `body` as the owner `config_maps` names."""
    metadata = body.get("metadata") or {}
    return {
        "apiVersion": body.get("apiVersion") or f"{specs.GROUP}/{specs.VERSION}",
        "kind": body.get("kind") or specs.KIND,
        "name": str(metadata.get("name") or ""),
        "uid": str(metadata.get("uid") or ""),
    }


def stale_names(mount: str, source: str, parts: int) -> list[str]:
    """The ConfigMaps of `source` past its `parts` (a re-pin to a smaller manifest, or
    one too large to hand: 0, whose part 0 says so), which would hand a stale tail."""
    first = max(parts, 1)
    return [config_map_name(mount, source, p) for p in range(first, handed_manifests.MAX_PARTS)]


class Writer(Protocol):
    """The API calls handing takes (`kube.Api`)."""

    async def put_config_map(self, body: Mapping[str, Any]) -> None: ...

    async def delete_config_map(self, namespace: str, name: str) -> None: ...


async def hand(
    api: Writer,
    *,
    owner: Mapping[str, Any],
    namespace: str,
    source: str,
    digest: str,
    parts: Sequence[bytes],
) -> str | None:
    """Write the ConfigMaps that hand `parts` of `source`'s manifest, pinned as
    `digest`, and delete those past them (no parts: too large to hand, which part 0
    says); None, or why it failed (the sidecars then resolve it from the store, as
    before). PermissionError where the operator may not write them: a namespace
    without the Role, which the caller leaves alone (`manifest_backfill.Ledger.refuse`)."""
    mount = str(owner["name"])
    where = "spec.source" if source == PRIMARY else f"mixture source {source}"
    try:
        for body in config_maps(
            namespace=namespace,
            mount=mount,
            owner=owner,
            source=source,
            digest=digest,
            parts=parts,
        ):
            await api.put_config_map(body)
        for name in stale_names(mount, source, len(parts)):
            await api.delete_config_map(namespace, name)
    except PermissionError:
        raise
    except Exception as exc:  # an API failure: the sidecars resolve instead
        return (
            f"the manifest {digest} of {where} was not handed to the sidecars ({exc}); each "
            "node's first sidecar of this pin reads the dataset to hash it"
        )
    if not parts:
        logger.info(
            "%s/%s: the manifest %s of %s is not handed: %s",
            namespace,
            mount,
            digest,
            where,
            TOO_LARGE,
        )
    return None
