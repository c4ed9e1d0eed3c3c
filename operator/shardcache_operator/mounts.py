"""DatasetMounts from memory for the webhook: the operator's own watch, plus what it lacks.

The webhook sits in front of every labelled pod (failurePolicy Fail), so it answers
from memory: one API read per pod put a 1,000-pod burst behind 1,000 reads in a handful
of worker threads (issue 18). Memory is `Store.watched`, fed by `mount_watch` on every
replica, standby included. Not kopf's index (`handlers.MOUNT_INDEX`): kopf stops listing
and watching while peering pauses a replica, so a replica that led and was then
outranked kept its index frozen, and its webhook injected the old digest and URI after a
source edit, and admitted pods of deleted mounts (node tier, s18). A kopf index is also
never told of objects deleted while it was paused: its next LIST only adds.

A `Store` answers from `watched` only while that watch is listed and connected
(`synced`); otherwise, and for a mount the watch has not delivered yet, the webhook reads
the API once and `remember`s it:

- A mount created just before its pods may not have reached the watch yet. The next
  pods are served from that copy until the watch has the object (then the watch wins
  and the copy is dropped), or for `READ_TTL_SECONDS` at most, so a copy can never
  outlive the object for long.
- So a pod is admitted from the mount as the watch last showed it (normally
  milliseconds old), or from an API read at most `READ_TTL_SECONDS` old.
- Parsing a spec costs far more than a dict lookup, and specs change only with the
  object's generation. Parsed specs are kept per (uid, generation); status changes
  (phase, attachedPods) bump neither, so they reuse the parsed spec. A spec that names
  no cache.nodePath gets the platform's default here (`default_node_path`), so the
  webhook and the operator's policy check see the path its pods will mount.

Single-threaded: kopf's handlers, the watch and the webhook run on the operator's event loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from shardcache import contract, errors
from shardcache_operator import specs

Key = tuple[str, str]
#: kopf's DatasetMount index as handlers receive it: (namespace, name) -> its objects.
MountIndex = Mapping[Key, Iterable[Mapping[str, Any]]]
#: How long a mount read from the API is served before the watch delivers it. The watch
#: normally does within milliseconds; this bounds how long a copy of a mount edited or
#: deleted in that window (or while the watch reconnects) could still admit pods.
READ_TTL_SECONDS = 10.0


def key_of(obj: Mapping[str, Any]) -> Key:
    metadata = obj.get("metadata") or {}
    return str(metadata.get("namespace") or ""), str(metadata.get("name") or "")


def _identity(obj: Mapping[str, Any]) -> tuple[str, object]:
    metadata = obj.get("metadata") or {}
    return str(metadata.get("uid") or ""), metadata.get("generation")


def indexed(index: MountIndex, namespace: str, name: str) -> Mapping[str, Any] | None:
    """The object of that name in kopf's index (one per key), or None."""
    for obj in index.get((namespace, name), ()):
        return obj
    return None


class Store:
    """The watched DatasetMounts, short-lived API reads and parsed specs."""

    def __init__(self, *, default_node_path: str = contract.DEFAULT_DISK_DIR) -> None:
        #: cache.nodePath of mounts that name none (the operator's default_node_path).
        self.default_node_path = default_node_path
        #: kopf's DatasetMount index, live, as its indexer last handed it over, for the
        #: handlers (which run only on the active replica). Never for admissions: kopf
        #: freezes it while this replica is paused (see the module's docstring).
        self.index: MountIndex = {}
        #: (namespace, name) -> the object as `mount_watch` last showed it.
        self.watched: dict[Key, Mapping[str, Any]] = {}
        #: Whether `watched` is listed and its watch connected: only then is it served.
        self.synced = False
        #: (namespace, name) -> (monotonic time read, the object) for mounts not watched yet.
        self._reads: dict[Key, tuple[float, Mapping[str, Any]]] = {}
        #: (namespace, name) -> ((uid, generation), parsed spec or why it is invalid).
        self._parsed: dict[Key, tuple[tuple[str, object], specs.DatasetMountSpec | Exception]] = {}
        #: Specs parsed (cache misses), for tests and the benchmark.
        self.parses = 0

    def lookup(self, namespace: str, name: str, *, now: float) -> Mapping[str, Any] | None:
        """The mount from memory, or None when memory has nothing (read the API then)."""
        key = (namespace, name)
        if self.synced:
            found = self.watched.get(key)
            if found is not None:
                self._reads.pop(key, None)
                return found
        read = self._reads.get(key)
        if read is None:
            return None
        if now - read[0] > READ_TTL_SECONDS:
            del self._reads[key]
            return None
        return read[1]

    def remember(self, obj: Mapping[str, Any], *, now: float) -> None:
        """Serve `obj`, just read from the API, until the index has it."""
        self._reads[key_of(obj)] = (now, obj)
        for key in [k for k, (at, _) in self._reads.items() if now - at > READ_TTL_SECONDS]:
            del self._reads[key]

    def listed(self, objs: Iterable[Mapping[str, Any]]) -> None:
        """A fresh LIST by the watch: `watched` becomes exactly `objs`, and is served."""
        self.watched = {key_of(obj): obj for obj in objs}
        self.synced = True

    def seen(self, kind: str, obj: Mapping[str, Any]) -> None:
        """One watch event (ADDED, MODIFIED, DELETED): the object as it now is, or gone.

        An earlier API read of it is dropped either way: the watch is newer.
        """
        key = key_of(obj)
        self._reads.pop(key, None)
        if kind == "DELETED":
            self.watched.pop(key, None)
        else:
            self.watched[key] = obj

    def lost(self) -> None:
        """The watch broke: what it showed may be stale, so read the API until it relists."""
        self.synced = False

    def load(self, obj: Mapping[str, Any], *, known: int) -> specs.DatasetMount:
        """`specs.load(obj)`, parsing the spec only once per (uid, generation).

        `known` is how many mounts the operator knows (the index's size): cached specs of
        deleted mounts are dropped when the cache grows past twice that.
        """
        key, identity = key_of(obj), _identity(obj)
        cached = self._parsed.get(key)
        if cached is None or cached[0] != identity:
            try:
                parsed: specs.DatasetMountSpec | Exception = specs.with_node_path(
                    specs.parse_spec(obj.get("spec"), path=f"{specs.KIND} {key[1]}: spec"),
                    self.default_node_path,
                )
            except errors.InputError as exc:
                parsed = exc
            self.parses += 1
            cached = (identity, parsed)
            if len(self._parsed) >= 2 * known + 16:
                self._parsed.clear()
            self._parsed[key] = cached
        result = cached[1]

        def parse(_: object, *, path: str) -> specs.DatasetMountSpec:
            if isinstance(result, Exception):
                raise errors.InputError(str(result))
            return result

        return specs.load(obj, parse=parse)
