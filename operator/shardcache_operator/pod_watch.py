"""The operator's own watch of opted-in pods: which DatasetMounts unfinished pods use.

Pods are the one resource the operator watches that it does not own, and a training
burst brings thousands of watch events (about 4.5 per pod). Through kopf each event was
deep-copied twice, diffed against a stored essence, handed to a worker task and to
handlers in a thread pool: ~80 % of the operator's CPU in a 1,000-pod burst, several ms
per pod (issue 18). The operator only needs one fact per pod (which mounts it uses
while unfinished), so this module watches pods itself, as a plain informer:

- LIST then WATCH `/api/v1/pods` with a server-side label selector on the opt-in label
  and a field selector leaving out finished pods, as metadata only, so unlabelled pods
  never reach the operator, memory does not grow with them, and each event is small;
- each event updates `Index` (pod -> mounts, mount -> pods, and for pods of a job the
  pins they were given, which the webhook serves the job's later pods: `job_pins`; and
  the mounts injected into them without a pin, by a webhook from before job pins, with
  their creationTimestamp) in place; only an event that changes a mount's set of pods wakes the count writer
  (`pod_counts`);
- resumes from the last resourceVersion (bookmarks keep it fresh) and lists again
  when the API server says it is too old (410 Gone).

`synced` is set after the first LIST: the operator starts kopf only then, so the
finalizer and the reconcile never count pods from an empty index (kopf's own indexes
give the same guarantee).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import aiohttp
import kopf

from shardcache import errors
from shardcache_operator import informer, injection, job_pins, metrics

logger = logging.getLogger(__name__)

Key = tuple[str, str]
FINISHED_PHASES = ("Succeeded", "Failed")
#: Server-side filters: opted-in pods only, and only while unfinished (a pod that
#: finishes leaves the selection, which the watch reports as DELETED).
LABEL_SELECTOR = injection.LABEL_MOUNT
FIELD_SELECTOR = ",".join(f"status.phase!={phase}" for phase in FINISHED_PHASES)
#: Metadata only: labels and annotations are all the index needs, and a full pod (with
#: an injected sidecar) is several times larger to send and to decode, 4-5 times per pod.
ACCEPT_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"
ACCEPT_WATCH = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"
#: The server ends a watch after this long; it is then resumed from its last version.
WATCH_TIMEOUT_SECONDS = 300
#: Pause before reconnecting after an error (a restarting API server, a network blip).
RETRY_SECONDS = 1.0


def mounts_of(pod: Mapping[str, Any]) -> tuple[str, ...]:
    """DatasetMounts an unfinished pod uses; none once it finished or if its label is bad."""
    if ((pod.get("status") or {}).get("phase")) in FINISHED_PHASES:
        return ()
    try:
        return tuple(injection.requested_mounts(pod.get("metadata") or {}))
    except errors.InputError:  # a malformed label on someone's pod must not stop the watch
        return ()


class Index(Mapping[Key, frozenset[str]]):
    """(namespace, DatasetMount name) -> names of the unfinished pods using it."""

    def __init__(self) -> None:
        self._pods: dict[Key, tuple[str, ...]] = {}
        self._by_mount: dict[Key, set[str]] = {}
        #: What the live pods of each job were given of each mount, for the webhook.
        self.jobs = job_pins.Siblings()
        #: pod -> mount -> the digest its injection wrote (`job_pins.ANNOTATION_PINS`).
        self._digests: dict[Key, dict[str, str]] = {}
        #: pod -> (mounts injected into it without a pin, its creationTimestamp).
        self._unpinned: dict[Key, tuple[tuple[str, ...], str | None]] = {}

    def __getitem__(self, key: Key) -> frozenset[str]:
        return frozenset(self._by_mount[key])

    def __iter__(self) -> Iterator[Key]:
        return iter(list(self._by_mount))

    def __len__(self) -> int:
        return len(self._by_mount)

    def count(self, namespace: str, name: str) -> int:
        return len(self._by_mount.get((namespace, name), ()))

    def older(
        self, namespace: str, name: str, digest: str | None, resolved_at: str | None = None
    ) -> int:
        """Unfinished pods of the mount given another digest than `digest` (the mount's
        pin now, resolved at `resolved_at`), and those injected without a recorded pin (a
        webhook from before job pins) created before it was resolved (`job_pins.unpinned`:
        they read an earlier pin); without `resolved_at` those are not counted."""
        if digest is None:
            return 0
        pods = self._by_mount.get((namespace, name), ())
        created = {
            pod: self._unpinned[(namespace, pod)][1]
            for pod in pods
            if name in self._unpinned.get((namespace, pod), ((), None))[0]
        }
        unknown = job_pins.unpinned(created, resolved_at).unknown if resolved_at else frozenset()
        return len(unknown) + sum(
            1 for pod in pods if self._digests.get((namespace, pod), {}).get(name, digest) != digest
        )

    def set(
        self,
        namespace: str,
        pod: str,
        mounts: tuple[str, ...],
        job: str | None = None,
        pins: Mapping[str, str] | None = None,
        *,
        injected: tuple[str, ...] = (),
        created: str | None = None,
    ) -> bool:
        """Record the mounts of one pod (empty: none, or gone) and, for a pod of a job,
        the pins it was given of them; `injected` (its `shardcache.io/injected`
        annotation) and `created` (its creationTimestamp) tell a mount injected without
        a pin (`job_pins.Siblings.unpinned`). True when its mounts changed."""
        key = (namespace, pod)
        live = {m: text for m, text in (pins or {}).items() if m in mounts}
        unpinned = tuple(m for m in injected if m in mounts and m not in live)
        self.jobs.record(
            namespace, pod, job if mounts else None, live, unpinned=unpinned, created=created
        )
        digests = {m: d for m, text in live.items() if (d := job_pins.digest_in(text))}
        if digests:
            self._digests[key] = digests
        else:
            self._digests.pop(key, None)
        if unpinned:
            self._unpinned[key] = (unpinned, created)
        else:
            self._unpinned.pop(key, None)
        before = self._pods.get(key, ())
        if before == mounts:
            return False
        for mount in before:
            users = self._by_mount.get((namespace, mount))
            if users is not None:
                users.discard(pod)
                if not users:
                    del self._by_mount[(namespace, mount)]
        for mount in mounts:
            self._by_mount.setdefault((namespace, mount), set()).add(pod)
        if mounts:
            self._pods[key] = mounts
        else:
            self._pods.pop(key, None)
        return True

    def replace(
        self,
        pods: Mapping[Key, tuple[str, ...]],
        jobs: Mapping[Key, Facts] | None = None,
    ) -> bool:
        """A fresh LIST: the index becomes exactly `pods` (and `jobs`: pod -> what
        `facts` read of it); True when any pod's mounts changed."""
        changed = False
        for key in [k for k in self._pods if k not in pods]:
            changed |= self.set(*key, ())
        for key in self.jobs.pods() - set(pods):
            self.jobs.record(*key, None, {})
        for key in [k for k in self._digests if k not in pods]:
            del self._digests[key]
        for key in [k for k in self._unpinned if k not in pods]:
            del self._unpinned[key]
        for (namespace, pod), mounts in pods.items():
            changed |= self.record(namespace, pod, mounts, (jobs or {}).get((namespace, pod)))
        return changed

    def record(
        self, namespace: str, pod: str, mounts: tuple[str, ...], found: Facts | None
    ) -> bool:
        """`set` with what `facts` read of the pod (None: nothing, as for a pod gone)."""
        found = found or Facts(None, {})
        return self.set(
            namespace,
            pod,
            mounts,
            found.job,
            found.pins,
            injected=found.injected,
            created=found.created,
        )


def job_facts(metadata: Mapping[str, Any]) -> tuple[str | None, dict[str, str]]:
    """A pod's job key (None: no job) and the pins its injection wrote (`job_pins`)."""
    job = job_pins.job_of(metadata)
    annotations = metadata.get("annotations") or {}
    if not isinstance(annotations, Mapping):
        return None if job is None else job.key, {}
    return None if job is None else job.key, job_pins.annotation_pins(annotations)


@dataclasses.dataclass(frozen=True)
class Facts:
    """What the index keeps of a pod besides its mounts (`Index.set`)."""

    job: str | None
    pins: Mapping[str, str]
    injected: tuple[str, ...] = ()
    created: str | None = None


def facts(metadata: Mapping[str, Any]) -> Facts:
    """`job_facts`, and the mounts the pod's injection names (`shardcache.io/injected`:
    a pod of a webhook from before job pins has it, and its sidecars, but no pins) and
    its creationTimestamp. The watch sees metadata only, so the annotation stands for
    the sidecars here; a pod author who writes it on a pod admitted without the cache
    only keeps their own job's later pods from starting."""
    job, pins = job_facts(metadata)
    annotations = metadata.get("annotations") or {}
    value = (
        annotations.get(injection.ANNOTATION_INJECTED) if isinstance(annotations, Mapping) else None
    )
    injected = tuple(m for m in value.split(",") if m) if isinstance(value, str) else ()
    created = metadata.get("creationTimestamp")
    return Facts(job, pins, injected, created if isinstance(created, str) else None)


class Watcher:
    """The informer; `run` is its only task. `changed` is called when counts may differ."""

    def __init__(
        self,
        index: Index,
        meters: metrics.Metrics,
        changed: Callable[[], None],
        *,
        namespaces: tuple[str, ...] = (),
    ) -> None:
        self.index = index
        self.synced = asyncio.Event()
        self._meters = meters
        # The two counter children, looked up once: `labels()` per event was 2 % of the
        # operator's CPU in a burst (issue 18).
        self._events = {
            opted_in: meters.pod_events_total.labels(opted_in=str(opted_in).lower())
            for opted_in in (True, False)
        }
        self._changed = changed
        self._namespaces = namespaces
        self._failures = informer.Failures("pod watch", logger)

    def _paths(self) -> list[str]:
        if not self._namespaces:
            return ["/api/v1/pods"]
        return [f"/api/v1/namespaces/{ns}/pods" for ns in self._namespaces]

    def apply(self, kind: str, pod: Mapping[str, Any]) -> None:
        """One watch event (ADDED, MODIFIED, DELETED) of one pod."""
        metadata = pod.get("metadata") or {}
        opted_in = injection.LABEL_MOUNT in (metadata.get("labels") or {})
        self._events[opted_in].inc()
        mounts = () if kind == "DELETED" else mounts_of(pod)
        namespace, name = str(metadata.get("namespace") or ""), str(metadata.get("name") or "")
        if self.index.record(namespace, name, mounts, facts(metadata) if mounts else None):
            self._changed()

    async def run(self, connect: Callable[[], kopf.ConnectionInfo]) -> None:
        """Until cancelled: list, watch, resume (`informer.run`); `connect` gives fresh
        credentials. The index keeps what it showed through errors (nothing to tell)."""
        await informer.run(
            connect,
            self._list,
            self._watch,
            self._failures,
            retry_seconds=RETRY_SECONDS,
            on_listed=self.synced.set,
        )

    async def _list(self, session: aiohttp.ClientSession, server: str) -> dict[str, str]:
        pods: dict[Key, tuple[str, ...]] = {}
        jobs: dict[Key, Facts] = {}
        versions: dict[str, str] = {}
        params = {"labelSelector": LABEL_SELECTOR, "fieldSelector": FIELD_SELECTOR}
        headers = {"Accept": ACCEPT_LIST}
        for path in self._paths():
            items, versions[path] = await informer.list_all(session, server + path, params, headers)
            for pod in items:
                metadata = pod.get("metadata") or {}
                key = (str(metadata.get("namespace") or ""), str(metadata.get("name") or ""))
                mounts = mounts_of(pod)
                if mounts:
                    pods[key] = mounts
                    jobs[key] = facts(metadata)
        if self.index.replace(pods, jobs):
            self._changed()
        return versions

    async def _watch(
        self,
        session: aiohttp.ClientSession,
        server: str,
        path: str,
        version: str,
        working: Callable[[], None],
    ) -> None:
        await informer.watch(
            session,
            server + path,
            {"labelSelector": LABEL_SELECTOR, "fieldSelector": FIELD_SELECTOR},
            version,
            self.apply,
            timeout_seconds=WATCH_TIMEOUT_SECONDS,
            silent_seconds=WATCH_TIMEOUT_SECONDS + 30,
            headers={"Accept": ACCEPT_WATCH},
            working=working,
        )
