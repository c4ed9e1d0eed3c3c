"""Per-job pins: every pod of one job reads the dataset its job's other pods read.

A DatasetMount pins one dataset at a time (status.manifestDigest), and a `spec.source`
edit pins another while a job may still run: a rank's pod replaced after the edit
(preemption, node loss, a backoffLimit retry) would otherwise get the new dataset while
the other ranks keep the old one, two datasets in one job. So the webhook writes on each
pod it injects what it injected from each mount's resolved source (`ANNOTATION_PINS`:
digest, `uri`, `format`, `version`, and each further source of a mixture), the
operator's pod watch indexes those by (namespace, job, mount) (`Siblings`), and a pod
whose job has live pods of the same mount gets *their* pin, not the mount's current one
(`serve`). A job's pods that disagree, or a pin the mount's current spec cannot take (a
source added to or removed from the mixture since), refuse the pod: a job never mixes
datasets silently.

Pods injected by a webhook from before job pins carry no `ANNOTATION_PINS`. The pod
watch indexes them too (`Siblings.unpinned`: by their `shardcache.io/injected`
annotation, with their creationTimestamp): one created after the mount's current pin
was resolved (status.resolvedAt, and `UNPINNED_MARGIN_SECONDS`) was given that pin; of
one created before, the digest cannot be known, and the pod is refused as for pods
that disagree (`unpinned`, `serve`), with a Warning Event naming them.

What names a job (`job_of`), first match wins: the opt-in label `shardcache.io/job`
(any controller: the user names the unit that must read one dataset), a JobSet
(`jobset.sigs.k8s.io/jobset-uid`, else `-name`: all its Jobs), a LeaderWorkerSet group
(`leaderworkerset.sigs.k8s.io/group-key`), a Kubeflow training job
(`training.kubeflow.org/operator-name` and `job-name`), a batch/v1 Job
(`batch.kubernetes.io/controller-uid`, else the legacy `controller-uid`).

Pure, except `Siblings`, a plain in-memory index the pod watch keeps.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from shardcache import errors
from shardcache_operator import rfc3339, specs

#: Written by the injection: {mount: pin} of every mount injected, as JSON. The webhook
#: replaces what a pod's author wrote there for the mounts it injects.
ANNOTATION_PINS = "shardcache.io/pins"
#: Opt-in: pods with the same value (in one namespace) are one job for pinning.
LABEL_JOB = "shardcache.io/job"
#: The version of the pin's JSON; another is "not recoverable" (the pod is refused).
PIN_VERSION = 1

#: (label, what it names) in the order they are tried; a Kubeflow job is two labels.
_JOBSET_UID = "jobset.sigs.k8s.io/jobset-uid"
_JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
_LWS_GROUP = "leaderworkerset.sigs.k8s.io/group-key"
_LWS_NAME = "leaderworkerset.sigs.k8s.io/name"
_KUBEFLOW_OPERATOR = "training.kubeflow.org/operator-name"
_KUBEFLOW_JOB = "training.kubeflow.org/job-name"
_JOB_UID = "batch.kubernetes.io/controller-uid"
_JOB_UID_LEGACY = "controller-uid"
_JOB_NAME = "batch.kubernetes.io/job-name"
_JOB_NAME_LEGACY = "job-name"
#: Every label `job_of` reads, for docs and tests.
JOB_LABELS = (
    LABEL_JOB,
    _JOBSET_UID,
    _JOBSET_NAME,
    _LWS_GROUP,
    _KUBEFLOW_OPERATOR,
    _KUBEFLOW_JOB,
    _JOB_UID,
    _JOB_UID_LEGACY,
)

#: An injected pod without a pin is taken to hold the mount's current pin only when
#: created this long after status.resolvedAt: the webhook reads mounts from a watch (a
#: moment behind the status write), and the two times come from two clocks (the
#: operator's and the API server's), each to the second.
UNPINNED_MARGIN_SECONDS = 60

_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")


@dataclasses.dataclass(frozen=True)
class Job:
    """One job's identity: `key` (unique in its namespace) and how a message names it."""

    key: str
    label: str


def job_of(metadata: Mapping[str, Any]) -> Job | None:
    """The job a pod belongs to, from its labels; None for a pod of no job we know."""
    labels = metadata.get("labels") or {}
    if not isinstance(labels, Mapping):
        return None

    def get(name: str) -> str:
        value = labels.get(name)
        return value if isinstance(value, str) else ""

    if get(LABEL_JOB):
        return Job(f"{LABEL_JOB}={get(LABEL_JOB)}", f"{get(LABEL_JOB)} (label {LABEL_JOB})")
    if get(_JOBSET_UID) or get(_JOBSET_NAME):
        key = f"{_JOBSET_UID}={get(_JOBSET_UID)}" if get(_JOBSET_UID) else ""
        key = key or f"{_JOBSET_NAME}={get(_JOBSET_NAME)}"
        return Job(key, f"JobSet {get(_JOBSET_NAME) or get(_JOBSET_UID)}")
    if get(_LWS_GROUP):
        return Job(
            f"{_LWS_GROUP}={get(_LWS_GROUP)}",
            f"LeaderWorkerSet {get(_LWS_NAME) or '?'} group {get(_LWS_GROUP)}",
        )
    if get(_KUBEFLOW_JOB):
        operator = get(_KUBEFLOW_OPERATOR)
        return Job(
            f"{_KUBEFLOW_OPERATOR}={operator},{_KUBEFLOW_JOB}={get(_KUBEFLOW_JOB)}",
            f"{operator or 'Kubeflow'} job {get(_KUBEFLOW_JOB)}",
        )
    for uid_label in (_JOB_UID, _JOB_UID_LEGACY):
        if get(uid_label):
            name = get(_JOB_NAME) or get(_JOB_NAME_LEGACY) or get(uid_label)
            return Job(f"{_JOB_UID}={get(uid_label)}", f"Job {name}")
    return None


@dataclasses.dataclass(frozen=True)
class SourcePin:
    """What a pod's sidecar reads of one source: where, how, and the pinned digest."""

    uri: str
    format: str
    version: str | None
    digest: str | None
    #: The source's name in a mixture (None: spec.source of a single-source mount).
    name: str | None = None


@dataclasses.dataclass(frozen=True)
class Pin:
    """What one mount's sidecar in a pod was given from the resolved sources: spec.source
    first, then each further source of a mixture in the spec's order."""

    sources: tuple[SourcePin, ...]

    @property
    def digest(self) -> str | None:
        return self.sources[0].digest

    def text(self) -> str:
        """Canonical JSON: two pins are the same exactly when their texts are."""
        return json.dumps(_to_json(self), sort_keys=True, separators=(",", ":"))


def _to_json(pin: Pin) -> dict[str, Any]:
    first = pin.sources[0]
    out: dict[str, Any] = {
        "v": PIN_VERSION,
        "uri": first.uri,
        "format": first.format,
        "digest": first.digest,
    }
    if first.version is not None:
        out["version"] = first.version
    if len(pin.sources) > 1:
        out["mixture"] = [
            {
                "name": s.name,
                "uri": s.uri,
                "format": s.format,
                "digest": s.digest,
                **({"version": s.version} if s.version is not None else {}),
            }
            for s in pin.sources[1:]
        ]
    return out


def pin_of(
    spec: specs.DatasetMountSpec, digest: str | None, source_digests: Mapping[str, str]
) -> Pin:
    """The pin a pod injected from `spec` and its pinned digests gets."""
    first = SourcePin(spec.source.uri, spec.source.format, spec.source.version, digest)
    further = tuple(
        SourcePin(s.uri, s.format, s.version, source_digests.get(s.name) or s.version, s.name)
        for s in (spec.mixture.sources if spec.mixture is not None else ())
    )
    return Pin((first, *further))


def _source(data: object, where: str, *, named: bool) -> SourcePin:
    """One source of a pin, checked as the CRD checks a spec's source."""
    if not isinstance(data, Mapping):
        raise errors.InputError(f"{where}: expected an object, found {type(data).__name__}")
    digest = data.get("digest")
    if digest is not None and not (isinstance(digest, str) and _DIGEST_RE.match(digest)):
        raise errors.InputError(f"{where}.digest: expected sha256:<64 hex>, found {digest!r}")
    fields = {k: data[k] for k in ("uri", "format", "version") if k in data}
    name = data.get("name") if named else None
    if named:
        parsed = specs.from_dict(
            specs.MixtureSourceSpec, {**fields, "name": name, "weight": 1}, path=where
        )
        return SourcePin(parsed.uri, parsed.format, parsed.version, digest, parsed.name)
    source = specs.from_dict(specs.SourceSpec, fields, path=where)
    return SourcePin(source.uri, source.format, source.version, digest)


def decode(text: str, where: str) -> Pin:
    """The pin in `text` (a `Pin.text`); InputError saying what is wrong with it."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise errors.InputError(f"{where}: expected JSON, found {text[:80]!r} ({exc})") from None
    if not isinstance(data, Mapping) or data.get("v") != PIN_VERSION:
        found = data.get("v") if isinstance(data, Mapping) else type(data).__name__
        raise errors.InputError(f"{where}: expected pin version {PIN_VERSION}, found {found!r}")
    mixture = data.get("mixture") or []
    if not isinstance(mixture, list):
        raise errors.InputError(f"{where}.mixture: expected a list, found {mixture!r}")
    first = _source(data, where, named=False)
    further = tuple(
        _source(entry, f"{where}.mixture[{i}]", named=True) for i, entry in enumerate(mixture)
    )
    return Pin((first, *further))


def annotation_pins(annotations: Mapping[str, Any]) -> dict[str, str]:
    """{mount: pin text} from a pod's `ANNOTATION_PINS`; {} when absent or not an object
    (the texts themselves are checked when a pod is served from them, `serve`)."""
    raw = annotations.get(ANNOTATION_PINS)
    if not isinstance(raw, str) or not raw:
        return {}
    try:
        data = json.loads(raw)
    except ValueError:
        return {}
    if not isinstance(data, Mapping):
        return {}
    return {
        str(mount): json.dumps(pin, sort_keys=True, separators=(",", ":"))
        for mount, pin in data.items()
    }


def annotation_value(pins: Mapping[str, str]) -> str:
    """The `ANNOTATION_PINS` value for {mount: pin text}."""
    return json.dumps(
        {mount: json.loads(text) for mount, text in sorted(pins.items())},
        sort_keys=True,
        separators=(",", ":"),
    )


def apply(spec: specs.DatasetMountSpec, pin: Pin, where: str) -> specs.DatasetMountSpec:
    """`spec` with its sources as `pin` has them (credentials, cache, plan and weights
    stay the spec's); InputError when the spec's sources no longer match the pin's (a
    source of the mixture added, removed or renamed since)."""
    first, further = pin.sources[0], pin.sources[1:]
    present = [s.name for s in spec.mixture.sources] if spec.mixture is not None else []
    pinned = [s.name for s in further]
    if present != pinned:
        raise errors.InputError(
            f"{where}: the job's pods read the sources {_names(pinned)}, but the mount's "
            f"spec now has {_names(present)}; the job cannot be served the same dataset"
        )
    source = dataclasses.replace(
        spec.source, uri=first.uri, format=first.format, version=first.version
    )
    mixture = spec.mixture
    if mixture is not None:
        by_name = {s.name: s for s in further}
        mixture = dataclasses.replace(
            mixture,
            sources=tuple(
                dataclasses.replace(
                    s,
                    uri=by_name[s.name].uri,
                    format=by_name[s.name].format,
                    version=by_name[s.name].version,
                )
                for s in mixture.sources
            ),
        )
    return dataclasses.replace(spec, source=source, mixture=mixture)


def _names(names: Sequence[str | None]) -> str:
    return "spec.source alone" if not names else "spec.source and " + ", ".join(map(str, names))


@dataclasses.dataclass(frozen=True)
class Served:
    """What a pod of a job gets of one mount: `pin` (None: the mount's current one) and,
    when that is not the mount's current pin, a message saying so."""

    pin: Pin | None
    message: str = ""


@dataclasses.dataclass(frozen=True)
class Unpinned:
    """A job's live pods of a mount injected without a recorded pin (by a webhook from
    before job pins): those given the mount's `current` pin, and those whose pin is
    `unknown`."""

    current: frozenset[str] = frozenset()
    unknown: frozenset[str] = frozenset()
    #: status.resolvedAt as read, for the message.
    resolved_at: str | None = None


class PinUnknown(errors.InputError):
    """A job's live pods were given a pin nobody recorded: the pod is refused, and a
    Warning Event on the mount names them (`admission.REASON_JOB_PIN_UNKNOWN`)."""


def unpinned(created: Mapping[str, str | None], resolved_at: str | None) -> Unpinned:
    """Which pods of `created` (pod -> creationTimestamp) read the pin the mount resolved
    at `resolved_at` (status.resolvedAt): those created `UNPINNED_MARGIN_SECONDS` after
    it. A pod created before (or near) it, or a time missing or unreadable, is unknown:
    it may have been given the pin before."""
    since = rfc3339.parse(resolved_at)
    margin = datetime.timedelta(seconds=UNPINNED_MARGIN_SECONDS)
    current, unknown = set(), set()
    for pod, text in created.items():
        when = rfc3339.parse(text)
        if since is not None and when is not None and when >= since + margin:
            current.add(pod)
        else:
            unknown.add(pod)
    return Unpinned(frozenset(current), frozenset(unknown), resolved_at)


def _some(pods: frozenset[str]) -> str:
    names = sorted(pods)
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return ", ".join(names[:3]) + more


def serve(
    where: str,
    *,
    pod: str,
    job: Job,
    current: Pin,
    siblings: Mapping[str, frozenset[str]],
    unpinned: Unpinned = Unpinned(),
) -> Served:
    """The pin a pod of `job` gets of a mount: its job's, as its live pods of the mount
    (`siblings`: pin text -> pod names; `unpinned`: those without a recorded pin) were
    given, else the mount's `current` one.

    InputError (the pod is refused) when the job's pods hold different pins already, or
    a pin cannot be read; `PinUnknown` when some were given a pin nobody recorded:
    guessing would mix datasets in one job.
    """
    if unpinned.unknown:
        raise PinUnknown(
            f"{where}: pod {pod} of {job.label} is refused: the job's live pods "
            f"{_some(unpinned.unknown)} were injected by a webhook from before job pins "
            f"(no annotation {ANNOTATION_PINS}) and created before the mount's current pin "
            f"was resolved (status.resolvedAt {unpinned.resolved_at or 'not set'}), so the "
            "dataset they read is not known. Let the job finish, or delete it and create a "
            "new one to train on one dataset"
        )
    if unpinned.current:
        text = current.text()
        siblings = {**siblings, text: siblings.get(text, frozenset()) | unpinned.current}
    if not siblings:
        return Served(None)
    if len(siblings) > 1:
        held = "; ".join(
            f"{_digest_of(text)} by {', '.join(sorted(pods)[:3])}"
            for text, pods in sorted(siblings.items())
        )
        raise errors.InputError(
            f"{where}: the live pods of {job.label} already read different datasets of it "
            f"({held}); expected one. Delete the job and create a new one to train on one "
            "dataset"
        )
    text, pods = next(iter(siblings.items()))
    try:
        pin = decode(text, f"annotation {ANNOTATION_PINS} of pod {sorted(pods)[0]}")
    except errors.InputError as exc:
        raise errors.InputError(
            f"{where}: the dataset the live pods of {job.label} read cannot be recovered "
            f"({exc}); delete the job and create a new one"
        ) from None
    if pin.text() == current.text():
        return Served(None)
    message = (
        f"pod {pod} of {job.label} gets digest {pin.digest} ({pin.sources[0].uri}), the "
        f"one its other pods read; {where} now pins {current.digest} "
        f"({current.sources[0].uri}). Create a new job to train on the new data"
    )
    return Served(pin, message)


def digest_in(text: str) -> str | None:
    """The digest of spec.source a pin text names; None when it names none or is not a pin."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    digest = data.get("digest") if isinstance(data, Mapping) else None
    return digest if isinstance(digest, str) and digest else None


def _digest_of(text: str) -> str:
    return digest_in(text) or "no digest"


Key = tuple[str, str, str]


class Siblings:
    """(namespace, job key, mount) -> pin text -> the live pods given it, and the live
    pods injected without a recorded pin -> their creationTimestamp; the pod watch keeps
    it (`pod_watch.Index.set`)."""

    def __init__(self) -> None:
        self._pods: dict[tuple[str, str], tuple[str, dict[str, str], tuple[str, ...]]] = {}
        self._by_job: dict[Key, dict[str, set[str]]] = {}
        self._unpinned: dict[Key, dict[str, str | None]] = {}

    def pins(self, namespace: str, job: str, mount: str) -> dict[str, frozenset[str]]:
        found = self._by_job.get((namespace, job, mount)) or {}
        return {text: frozenset(pods) for text, pods in found.items()}

    def unpinned(self, namespace: str, job: str, mount: str) -> dict[str, str | None]:
        """The job's live pods injected with `mount` but no pin -> their creationTimestamp."""
        return dict(self._unpinned.get((namespace, job, mount)) or {})

    def record(
        self,
        namespace: str,
        pod: str,
        job: str | None,
        pins: Mapping[str, str],
        *,
        unpinned: tuple[str, ...] = (),
        created: str | None = None,
    ) -> None:
        """Record the pins of one live pod, and the mounts injected into it without one
        (`unpinned`, with the pod's `created`); no job, or neither: forget it."""
        key = (namespace, pod)
        before = self._pods.pop(key, None)
        if before is not None:
            old_job, old_pins, old_unpinned = before
            for mount, text in old_pins.items():
                held = self._by_job.get((namespace, old_job, mount))
                if held is None:
                    continue
                held.get(text, set()).discard(pod)
                if not held.get(text, True):
                    del held[text]
                if not held:
                    del self._by_job[(namespace, old_job, mount)]
            for mount in old_unpinned:
                times = self._unpinned.get((namespace, old_job, mount))
                if times is not None:
                    times.pop(pod, None)
                    if not times:
                        del self._unpinned[(namespace, old_job, mount)]
        unpinned = tuple(m for m in unpinned if m not in pins)
        if job is None or not (pins or unpinned):
            return
        self._pods[key] = (job, dict(pins), unpinned)
        for mount, text in pins.items():
            self._by_job.setdefault((namespace, job, mount), {}).setdefault(text, set()).add(pod)
        for mount in unpinned:
            self._unpinned.setdefault((namespace, job, mount), {})[pod] = created

    def pods(self) -> set[tuple[str, str]]:
        return set(self._pods)
