"""Is the installed DatasetMount CRD as new as this operator? (docs/operator.md, "Upgrading")

helm installs a chart's crds/ on first install only and never upgrades them, so a plain
`helm upgrade` leaves the older CRD in place. Against it a newer operator loses what the
older schema prunes (status.resolvedSource.manifestVersion: every restart then took the
pin for another source's and re-pinned the mount to whatever the bucket held, under
running jobs) and has whole status patches refused (a condition type the older enum
lacks).

So the operator compares the installed CRD's schema version (the annotation
`crd.ANNOTATION_SCHEMA_VERSION`; none: an older chart's, version 0) with its own
(`crd.SCHEMA_VERSION`). While the installed one is older it reconciles nothing: no
resolving, no status checks. It says what to run in its log, in /readyz and in a
`CRDOutdated` Warning Event on each DatasetMount, and looks again every
`RECHECK_SECONDS`, so applying the CRDs is enough to go on. What it keeps doing: the
webhook admits pods of mounts already Ready with their pins (those pins were made
against the older schema and are still the datasets their jobs read: refusing them
would stop running training for an upgrade's ordering), deletions release their
finalizers. status.attachedPods waits too (`pod_counts`): it exists in every schema,
but the API server prunes the whole stored object to the installed schema on any status
write, so writing the count alone would drop the pin's manifestVersion all the same.

It never updates the CRD itself: the CRD is cluster-wide, shared by every release,
and two releases of different versions would rewrite it in turn; and writing CRDs is a
cluster administrator's power that the operator's identity should not hold.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import kubernetes

from shardcache_operator import crd, specs

logger = logging.getLogger(__name__)

CRD_NAME = f"{specs.PLURAL}.{specs.GROUP}"
#: The Warning Event's reason on each DatasetMount while the CRD is older.
REASON = "CRDOutdated"
#: Seconds between looks at an older (or unreadable) CRD: applying the CRDs lets the
#: operator go on within this, without a restart.
RECHECK_SECONDS = 30.0
#: Seconds between looks at a CRD found current: one that is replaced by an older one
#: later (someone applies an older chart's crds/) is noticed within this.
CURRENT_RECHECK_SECONDS = 300.0
#: What to run, as docs/operator.md ("Upgrading") says it.
APPLY = "kubectl apply --server-side --force-conflicts -f <chart>/crds/"

#: Reads the installed CRD object (a JSON dict), None when there is none.
Reader = Callable[[], Awaitable[Mapping[str, Any] | None]]


@dataclasses.dataclass(frozen=True)
class Verdict:
    #: Why the operator must not reconcile; None: it may.
    problem: str | None = None
    #: Something worth a warning that does not stop it (a newer CRD).
    note: str | None = None


def installed_version(obj: Mapping[str, Any]) -> int | None:
    """The CRD's schema version: 0 without the annotation (charts before it); None when
    the annotation is not an integer."""
    metadata = obj.get("metadata") or {}
    annotations = metadata.get("annotations") or {}
    text = annotations.get(crd.ANNOTATION_SCHEMA_VERSION)
    if text is None:
        return 0
    try:
        return int(str(text))
    except ValueError:
        return None


def judge(obj: Mapping[str, Any] | None, *, needed: int = crd.SCHEMA_VERSION) -> Verdict:
    """May this operator (schema version `needed`) reconcile against the installed `obj`?"""
    if obj is None:
        return Verdict(problem=f"the {CRD_NAME} CustomResourceDefinition is not installed: {APPLY}")
    found = installed_version(obj)
    annotation = crd.ANNOTATION_SCHEMA_VERSION
    if found is None:
        text = (obj.get("metadata") or {}).get("annotations", {}).get(annotation)
        return Verdict(
            problem=f"the installed {CRD_NAME} CRD has annotation {annotation}={text!r}, "
            f"expected an integer (this operator needs schema version {needed}): {APPLY}"
        )
    if found < needed:
        which = (
            f"schema version {found}"
            if found
            else f"schema version 0 (no {annotation} annotation: an older chart's)"
        )
        return Verdict(
            problem=f"the installed {CRD_NAME} CRD is {which}, this operator needs "
            f"{needed}: helm installs a chart's crds/ on first install only, and against "
            "the older schema status fields are pruned and pins would move. Not "
            f"reconciling until it is applied: {APPLY} (the crds/ of this release's "
            f"chart); looked at again every {RECHECK_SECONDS:g} s"
        )
    if found > needed:
        return Verdict(
            note=f"the installed {CRD_NAME} CRD is schema version {found}, newer than this "
            f"operator's {needed} (an operator rolled back, or another release is newer): "
            "reconciling; run one chart version per cluster"
        )
    return Verdict()


def unreadable(exc: BaseException) -> Verdict:
    """Not reading the CRD stops reconciling too: the check exists to keep pins still."""
    return Verdict(
        problem=f"could not read the {CRD_NAME} CRD to check its schema version ({exc}); "
        "the operator needs list on customresourcedefinitions (the chart grants it). Not "
        f"reconciling; looked at again every {RECHECK_SECONDS:g} s"
    )


async def read_installed() -> Mapping[str, Any] | None:
    """The installed CRD, through the client `kube.configure` set up (list with a field
    selector: the chart grants list and watch on CRDs, not get)."""
    api = kubernetes.client.ApiextensionsV1Api()
    found = await asyncio.to_thread(
        api.list_custom_resource_definition, field_selector=f"metadata.name={CRD_NAME}"
    )
    items = found.items or []
    if not items:
        return None
    metadata = items[0].metadata
    annotations = dict((metadata.annotations if metadata is not None else None) or {})
    return {"metadata": {"name": CRD_NAME, "annotations": annotations}}


class Gate:
    """The verdict on the installed CRD, read at most once per recheck interval.

    Without a reader (tests, tools that build a context) there is nothing to check and
    every reconcile goes on."""

    def __init__(
        self, read: Reader | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._read = read
        self._clock = clock
        self._lock = asyncio.Lock()
        self._checked_at: float | None = None
        self.verdict = Verdict()

    def _due(self) -> bool:
        if self._checked_at is None:
            return True
        interval = RECHECK_SECONDS if self.verdict.problem else CURRENT_RECHECK_SECONDS
        return self._clock() - self._checked_at >= interval

    async def problem(self) -> str | None:
        """Why not to reconcile now, or None; reads the CRD when the last look is old."""
        if self._read is None:
            return None
        # One read for a burst of handlers (every mount's resume at start-up).
        async with self._lock:
            if self._due():
                before = self.verdict
                try:
                    self.verdict = judge(await self._read())
                except Exception as exc:  # any API failure: stay still, say why
                    self.verdict = unreadable(exc)
                self._checked_at = self._clock()
                self._log(before)
        return self.verdict.problem

    def _log(self, before: Verdict) -> None:
        now = self.verdict
        if now.problem and now.problem != before.problem:
            logger.error("%s", now.problem)
        elif now.note and now.note != before.note:
            logger.warning("%s", now.note)
        elif before.problem and not now.problem:
            logger.info("the %s CRD is current: reconciling again", CRD_NAME)

    def message(self) -> str | None:
        """The last verdict's problem, for /readyz (no read: it answers from memory)."""
        return self.verdict.problem
