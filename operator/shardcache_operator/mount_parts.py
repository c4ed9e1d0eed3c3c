"""What one mount adds to a pod (its volumes and its sidecar container), built once.

In a burst every pod of a Job asks for the same mount and is given the same names and
ports, so the same volumes and sidecar are built for each: rendering the sidecar's env
from the contract table alone was about half of an admission decision (issue 18). The
parts are a pure function of the spec and the inputs `Key` names, so `Cache` keeps the
last `CACHE_SIZE` results and hands the same objects to every pod that needs them: the
webhook only serializes what `inject` returns. Copying them per pod (about 30 µs for a
sidecar container, in Python) would have given back most of what the cache saves, so
a caller that passes a cache must treat the pod it gets as read-only.

The spec is keyed by identity: the webhook's spec cache (`mounts.Store`) parses a mount
once per (uid, generation) and hands out the same object, and an entry holds a
reference to its spec, so an id is never reused while its entry lives. Callers that
parse afresh each time (offline injection, tests) only miss the cache.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from shardcache_operator import pod_names, pod_volumes, specs

#: Entries kept: distinct (mount, generation, names, rank source) combinations in use at
#: once. A cluster with more keeps working, only rebuilding some parts per pod.
CACHE_SIZE = 512


@dataclasses.dataclass(frozen=True)
class Key:
    """Everything the parts depend on besides the spec (which is keyed by identity)."""

    mount: str
    digest: str | None
    namespace: str | None
    #: The namespace's UID, which keys its node disk directory (`Mount.namespace_uid`).
    namespace_uid: str | None
    #: Whether the sidecar is handed its pinned manifests is `names.manifest_volume`
    #: (None: not), decided from `namespace` and `defaults.manifest_namespaces`; whether
    #: the sidecar mounts the source's Secret is `names.credentials_volume`, decided from
    #: the spec and `defaults.run_dir` (the Secret's name is the spec's `secretRef`).
    names: pod_names.MountNames
    #: `injection.SidecarDefaults`, hashable (a frozen dataclass of plain values).
    defaults: object
    world_size: int | None
    rank_field: str | None
    #: The pinned digest of each further source of a mixture (`Mount.source_digests`).
    source_digests: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class Parts:
    volumes: pod_volumes.MountVolumes
    sidecar: dict[str, Any]


class Cache:
    """Built parts by (spec identity, `Key`), least recently used dropped first."""

    def __init__(self, size: int = CACHE_SIZE) -> None:
        self._size = size
        self._entries: collections.OrderedDict[
            tuple[int, Key], tuple[specs.DatasetMountSpec, Parts]
        ] = collections.OrderedDict()

    def get(self, spec: specs.DatasetMountSpec, key: Key) -> Parts | None:
        """The parts built for `spec` and `key` (shared: read-only), or None."""
        entry = self._entries.get((id(spec), key))
        if entry is None or entry[0] is not spec:
            return None
        self._entries.move_to_end((id(spec), key))
        return entry[1]

    def put(self, spec: specs.DatasetMountSpec, key: Key, parts: Parts) -> None:
        """Keep `parts` for the next pod; the least recently used entry goes first."""
        self._entries[(id(spec), key)] = (spec, parts)
        self._entries.move_to_end((id(spec), key))
        while len(self._entries) > self._size:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)
