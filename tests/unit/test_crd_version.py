"""The operator reconciles only against a DatasetMount CRD as new as itself.

helm never upgrades a chart's crds/: after a plain `helm upgrade` the older CRD pruned
status.resolvedSource.manifestVersion and every operator restart moved the pin (the
helm exploration's defect 1). The installed CRD's schema version annotation is compared
with the operator's; an older one stops reconciling, says what to run (log, /readyz, a
Warning Event) and is looked at again until it is applied.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import aiohttp.test_utils
import kopf
import pytest
import yaml
from shardcache_operator import crd, crd_version, handlers, health, metrics

from tests.unit.test_crd import CRD_PATH
from tests.unit.test_operator_handlers import (
    capture_events,
    drained,
    dsm,
    memo,
    present,
    resolves,
)

pytestmark = pytest.mark.unit

#: The command every message names (docs/operator.md, "Upgrading").
APPLY = "kubectl apply --server-side --force-conflicts -f <chart>/crds/"


def installed(version: str | None) -> dict[str, Any]:
    annotations = {} if version is None else {crd.ANNOTATION_SCHEMA_VERSION: version}
    return {"metadata": {"name": crd_version.CRD_NAME, "annotations": annotations}}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Reads:
    """The installed CRD as the API would serve it, one answer after another."""

    def __init__(self, *answers: Mapping[str, Any] | Exception | None) -> None:
        self.answers = list(answers)
        self.count = 0

    async def __call__(self) -> Mapping[str, Any] | None:
        self.count += 1
        answer = self.answers[min(self.count, len(self.answers)) - 1]
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_the_committed_crd_carries_the_operators_schema_version() -> None:
    committed = yaml.safe_load(CRD_PATH.read_text())
    assert committed["metadata"]["annotations"] == {
        crd.ANNOTATION_SCHEMA_VERSION: str(crd.SCHEMA_VERSION)
    }
    assert crd_version.judge(committed) == crd_version.Verdict()


def test_a_crd_without_the_annotation_is_an_older_charts_and_stops_reconciling() -> None:
    verdict = crd_version.judge(installed(None))
    assert verdict.problem is not None
    assert "schema version 0" in verdict.problem and APPLY in verdict.problem
    assert f"needs {crd.SCHEMA_VERSION}" in verdict.problem


def test_an_older_version_stops_reconciling_and_a_newer_one_only_warns() -> None:
    older = crd_version.judge(installed("1"), needed=2)
    assert older.problem is not None and "schema version 1" in older.problem
    newer = crd_version.judge(installed("3"), needed=2)
    assert newer.problem is None and newer.note is not None and "newer" in newer.note


def test_an_unreadable_annotation_or_a_missing_crd_says_what_was_found() -> None:
    garbled = crd_version.judge(installed("one"))
    assert garbled.problem is not None and "'one'" in garbled.problem
    assert "expected an integer" in garbled.problem
    missing = crd_version.judge(None)
    assert missing.problem is not None and "not installed" in missing.problem


async def test_the_gate_looks_again_until_the_crd_is_applied(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    reads = Reads(installed(None), installed(str(crd.SCHEMA_VERSION)))
    gate = crd_version.Gate(reads, clock=clock)
    with caplog.at_level(logging.INFO, logger=crd_version.__name__):
        first = await gate.problem()
        assert first is not None and APPLY in first
        assert gate.message() == first
        # A burst of handlers within the interval: one read.
        clock.now += crd_version.RECHECK_SECONDS - 1
        assert await gate.problem() == first
        assert reads.count == 1
        clock.now += 1
        assert await gate.problem() is None
        assert reads.count == 2
    assert [r.levelname for r in caplog.records] == ["ERROR", "INFO"]
    # Current: looked at again far less often.
    clock.now += crd_version.RECHECK_SECONDS
    await gate.problem()
    assert reads.count == 2


async def test_a_crd_that_cannot_be_read_stops_reconciling_too() -> None:
    gate = crd_version.Gate(Reads(PermissionError("403 Forbidden")), clock=Clock())
    problem = await gate.problem()
    assert problem is not None and "403 Forbidden" in problem
    assert "customresourcedefinitions" in problem


async def test_without_a_reader_there_is_nothing_to_check() -> None:
    assert await crd_version.Gate().problem() is None


async def test_resolve_holds_a_pinned_mount_and_says_what_to_run_while_the_crd_is_older() -> None:
    """The pin of a Ready mount is neither re-resolved nor rewritten: a retry later, a
    Warning Event naming the command, and nothing in the status patch."""
    events = capture_events()

    def never(uri: str, fmt: str, options: Mapping[str, str] | None) -> Any:
        raise AssertionError("nothing is resolved against an older CRD")

    ctx = memo(resolve=never, probe=present, crd=crd_version.Gate(Reads(installed(None))))
    body = dsm(phase="Ready", manifestDigest="sha256:" + "ab" * 32)
    patch = kopf.Patch()
    with pytest.raises(kopf.TemporaryError) as raised:
        await handlers.resolve(
            body=body, patch=patch, retry=0, namespace="ml", name="data", memo=ctx
        )
    assert raised.value.delay == crd_version.RECHECK_SECONDS
    assert APPLY in str(raised.value)
    assert not patch
    assert drained(events) == [("Warning", crd_version.REASON)]
    # The next retries stay quiet for a while (kopf logs each one).
    with pytest.raises(kopf.TemporaryError):
        await handlers.resolve(
            body=body, patch=patch, retry=1, namespace="ml", name="data", memo=ctx
        )
    assert drained(events) == []
    # The timers write nothing either (DataStarved would be refused by the older enum).
    await handlers.check_source(body=body, patch=patch, memo=ctx)
    await handlers.check_stalls(body=body, patch=patch, namespace="ml", name="data", memo=ctx)
    assert not patch


async def test_resolve_goes_on_once_the_crd_is_current() -> None:
    capture_events()
    current = installed(str(crd.SCHEMA_VERSION))
    ctx = memo(resolve=resolves, probe=present, crd=crd_version.Gate(Reads(current)))
    patch = kopf.Patch()
    await handlers.resolve(body=dsm(), patch=patch, retry=0, namespace="ml", name="data", memo=ctx)
    assert patch.status["phase"] == "Ready"


async def test_readyz_stays_ready_for_the_webhook_and_says_why_nothing_is_reconciled() -> None:
    ready = asyncio.Event()
    ready.set()
    problem = crd_version.judge(installed(None)).problem
    app = health.application(ready, metrics.Metrics(), note=lambda: problem)
    async with aiohttp.test_utils.TestClient(aiohttp.test_utils.TestServer(app)) as client:
        response = await client.get("/readyz")
        body = await response.text()
    assert response.status == 200
    assert body.startswith("ready (webhook only): ") and APPLY in body


async def test_a_deletion_waits_for_its_pods_without_writing_status_while_the_crd_is_older() -> (
    None
):
    """The finalizer still holds and releases; only the status write waits."""
    events = capture_events()
    ctx = memo(crd=crd_version.Gate(Reads(installed(None))))
    ctx.pods.set("ml", "train-0", ("data",))
    patch = kopf.Patch()
    with pytest.raises(kopf.TemporaryError):
        await handlers.finalize(
            body=dsm(phase="Ready"), patch=patch, namespace="ml", name="data", annotations={},
            memo=ctx,
        )  # fmt: skip
    assert not patch
    assert drained(events) == [("Normal", "WaitingForPods")]
    # Its phase is never written, so the next deletion polls must not post it again.
    with pytest.raises(kopf.TemporaryError):
        await handlers.finalize(
            body=dsm(phase="Ready"), patch=kopf.Patch(), namespace="ml", name="data",
            annotations={}, memo=ctx,
        )  # fmt: skip
    assert drained(events) == []
