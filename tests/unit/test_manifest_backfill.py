"""Pins kept without their handed manifests (`manifest_backfill`): looked at once per pin
and process, and again hourly once handed, resolved again only when their ConfigMaps do
not hand them, handed only when the source still gives the pin, and never retried in a
loop."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import kopf
import pyarrow.fs as pafs
import pytest
from shardcache_operator import (
    configuration,
    context,
    handlers,
    manifest_backfill,
    manifest_handoff,
    reconcile,
    source_reads,
    specs,
    status,
)

from shardcache import errors, manifests
from shardcache.node import handed_manifests
from tests.support import datasets

pytestmark = pytest.mark.unit

NOW = "2026-01-01T00:00:00Z"


async def no_secret(namespace: str, name: str) -> Mapping[str, str] | None:
    raise AssertionError("no Secret is named")


def answers(uri: str, options: Mapping[str, str] | None, **_: object) -> None:
    """A source that answers the reachability probe of a kept pin."""


def resolve(uri: str, fmt: str, options: Mapping[str, str] | None) -> manifests.Manifest:
    return manifests.resolve(uri, format=fmt, storage_options=options)


def unreachable(uri: str, fmt: str, options: Mapping[str, str] | None) -> manifests.Manifest:
    raise errors.SourceError(f"{uri}: connection refused")


class Api:
    """The API server's ConfigMaps and the mount, as the backfill reads and writes them."""

    def __init__(self) -> None:
        self.config_maps: dict[tuple[str, str], dict[str, Any]] = {}
        self.mount: dict[str, Any] | None = None
        self.reads = 0
        self.refuse = False

    async def read_config_map(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.reads += 1
        if self.refuse:
            raise PermissionError(f"the operator's identity may not get ConfigMap {name}")
        body = self.config_maps.get((namespace, name))
        if body is None:
            return None
        keys = sorted({*(body.get("data") or {}), *(body.get("binaryData") or {})})
        return {"metadata": {"annotations": dict(body["metadata"]["annotations"])}, "keys": keys}

    async def read_datasetmount(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.mount

    async def put_config_map(self, body: Mapping[str, Any]) -> None:
        meta = body["metadata"]
        self.config_maps[(meta["namespace"], meta["name"])] = dict(body)

    async def delete_config_map(self, namespace: str, name: str) -> None:
        self.config_maps.pop((namespace, name), None)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Backfill:
    """One mount's backfill with its fakes: what it resolved, and what it said."""

    def __init__(self, mount: dict[str, Any]) -> None:
        self.mount = mount
        self.api = Api()
        self.api.mount = mount
        self.ledger = manifest_backfill.Ledger()
        self.clock = Clock()
        self.resolved: list[str] = []
        self.said: list[tuple[str, str, str]] = []
        self.counted: list[str] = []
        self.resolver = resolve

    async def resolve_again(self, spec: specs.DatasetMountSpec, source: str) -> status.Outcome:
        self.resolved.append(source)
        return await reconcile.resolve_again(
            spec,
            source,
            namespace="ml",
            read_secret=no_secret,
            resolve=lambda uri, fmt, options: self.resolver(uri, fmt, options),
            timeout=30,
            reads=source_reads.Gate(),
        )

    async def say(self, kind: str, reason: str, message: str) -> None:
        self.said.append((kind, reason, message))

    @property
    def means(self) -> manifest_backfill.Means:
        return manifest_backfill.Means(
            self.ledger,
            self.api,
            self.resolve_again,
            self.say,
            count=self.counted.append,
            now=self.clock,
        )

    async def __call__(self) -> None:
        await manifest_backfill.backfill(self.mount, self.means)

    def handed(self, source: str = manifest_handoff.PRIMARY) -> list[dict[str, Any]]:
        names = [
            manifest_handoff.config_map_name("train", source, p)
            for p in range(handed_manifests.MAX_PARTS)
        ]
        return [self.api.config_maps[("ml", n)] for n in names if ("ml", n) in self.api.config_maps]


@pytest.fixture
def roots(tmp_path: Path) -> dict[str, str]:
    out = {}
    for name, shards in {"web": [30, 20], "code": [15]}.items():
        datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / name), shards)
        out[name] = f"file://{tmp_path / name}"
    return out


async def ready(roots: dict[str, str], *, mixture: bool = False) -> dict[str, Any]:
    """A mount Ready with its pins, as a reconcile left it (the ConfigMaps not written:
    a pin made before its namespace was listed)."""
    spec: dict[str, Any] = {"source": {"uri": roots["web"]}}
    if mixture:
        code = {"name": "code", "weight": 1, "uri": roots["code"]}
        spec["mixture"] = {"name": "web", "weight": 3, "sources": [code]}
    obj = {
        "apiVersion": "shardcache.io/v1alpha1",
        "kind": "DatasetMount",
        "metadata": {"name": "train", "namespace": "ml", "generation": 1, "uid": "u-1"},
        "spec": spec,
    }
    result = await reconcile.reconcile(
        obj, read_secret=no_secret, resolve=resolve, probe=answers, now=NOW
    )
    assert result.status["phase"] == status.Phase.READY
    return {**obj, "status": result.status}


async def test_a_pin_kept_without_its_configmaps_is_resolved_again_and_handed(
    roots: dict[str, str],
) -> None:
    mount = await ready(roots)
    backfill = Backfill(mount)
    await backfill()
    assert backfill.resolved == [manifest_handoff.PRIMARY]
    parts = backfill.handed()
    assert len(parts) == 1
    digest = mount["status"]["manifestDigest"]
    assert parts[0]["metadata"]["annotations"][manifest_handoff.ANNOTATION_DIGEST] == digest
    assert parts[0]["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    # What the sidecar then loads is the pinned manifest, checked against the pin.
    directory = Path(roots["web"][len("file://") :]).parent / "handed"
    directory.mkdir()
    stem = handed_manifests.file_stem(digest, roots["web"])
    (directory / handed_manifests.part_name(stem, 0)).write_bytes(
        base64.b64decode(parts[0]["binaryData"][handed_manifests.DATA_KEY])
    )
    loaded = handed_manifests.load(directory, digest=digest, uri=roots["web"])
    assert loaded is not None and loaded.digest == digest
    assert [(kind, reason) for kind, reason, _ in backfill.said] == [
        ("Normal", manifest_backfill.HANDED)
    ]
    assert backfill.counted == [manifest_backfill.WRITTEN]
    # Settled: the next looks read nothing and resolve nothing.
    reads = backfill.api.reads
    await backfill()
    assert backfill.api.reads == reads and backfill.resolved == [manifest_handoff.PRIMARY]


async def test_a_pin_its_configmaps_hand_costs_one_read_and_no_resolve(
    roots: dict[str, str],
) -> None:
    mount = await ready(roots)
    first = Backfill(mount)
    await first()
    # A new process (an operator restart) finds them written.
    again = Backfill(mount)
    again.api.config_maps = first.api.config_maps
    await again()
    await again()
    assert again.resolved == [] and again.said == []
    assert again.api.reads == 1  # part 0, which counts one part
    assert again.counted == [manifest_backfill.PRESENT]


async def test_configmaps_deleted_after_a_look_are_handed_again_at_the_hourly_look(
    roots: dict[str, str],
) -> None:
    """A pin found handed is looked at again `LOOK_AGAIN_SECONDS` later (one GET per
    part), not only at the next operator restart: ConfigMaps deleted meanwhile come back."""
    mount = await ready(roots)
    backfill = Backfill(mount)
    await backfill()
    assert backfill.counted == [manifest_backfill.WRITTEN]
    backfill.api.config_maps.clear()  # someone deleted them
    backfill.clock.now += manifest_backfill.LOOK_AGAIN_SECONDS - 1
    await backfill()
    assert backfill.counted == [manifest_backfill.WRITTEN]  # not due yet: no GET
    backfill.clock.now += 1
    await backfill()
    assert backfill.resolved == [manifest_handoff.PRIMARY] * 2
    assert len(backfill.handed()) == 1
    assert backfill.counted == [manifest_backfill.WRITTEN] * 2
    # Present at the next hour's look: one GET, no resolve.
    reads = backfill.api.reads
    backfill.clock.now += manifest_backfill.LOOK_AGAIN_SECONDS
    await backfill()
    assert backfill.api.reads == reads + 1 and len(backfill.resolved) == 2
    assert backfill.counted[-1] == manifest_backfill.PRESENT


async def test_a_source_that_gives_another_digest_now_is_said_and_never_read_again(
    roots: dict[str, str], tmp_path: Path
) -> None:
    mount = await ready(roots)
    datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / "web"), [30, 21])
    backfill = Backfill(mount)
    await backfill()
    await backfill()
    assert backfill.resolved == [manifest_handoff.PRIMARY]
    assert backfill.handed() == []
    [(kind, reason, message)] = backfill.said
    assert (kind, reason) == ("Warning", manifest_handoff.REASON)
    assert f"the manifest {mount['status']['manifestDigest']} pinned for spec.source" in message
    assert "now gives manifest sha256:" in message
    assert backfill.counted == [manifest_backfill.SOURCE_CHANGED]
    # Not at the hourly looks either: only a new pin mends it.
    backfill.clock.now += 10 * manifest_backfill.LOOK_AGAIN_SECONDS
    await backfill()
    assert backfill.resolved == [manifest_handoff.PRIMARY]


async def test_a_failed_resolve_is_tried_again_later_backing_off(
    roots: dict[str, str],
) -> None:
    mount = await ready(roots)
    backfill = Backfill(mount)

    backfill.resolver = unreachable
    await backfill()
    await backfill()  # not due yet
    assert backfill.resolved == [manifest_handoff.PRIMARY]
    backfill.clock.now += manifest_backfill.RETRY_FIRST_SECONDS
    await backfill()
    assert len(backfill.resolved) == 2
    backfill.clock.now += manifest_backfill.RETRY_FIRST_SECONDS  # the wait doubled
    await backfill()
    assert len(backfill.resolved) == 2
    backfill.resolver = resolve
    backfill.clock.now += manifest_backfill.RETRY_FIRST_SECONDS
    await backfill()
    assert len(backfill.resolved) == 3 and len(backfill.handed()) == 1
    assert backfill.said[-1][1] == manifest_backfill.HANDED
    assert backfill.counted == [manifest_backfill.FAILED] * 2 + [manifest_backfill.WRITTEN]


async def test_a_namespace_without_configmap_access_is_said_once_and_left_alone(
    roots: dict[str, str],
) -> None:
    mount = await ready(roots)
    backfill = Backfill(mount)
    backfill.api.refuse = True
    await backfill()
    await backfill()
    assert backfill.api.reads == 1 and backfill.resolved == []
    [(kind, reason, message)] = backfill.said
    assert (kind, reason) == ("Warning", manifest_handoff.REASON)
    assert "may not get ConfigMap" in message and "namespace ml" in message
    assert backfill.counted == [manifest_backfill.REFUSED]
    # A Role granted later is used an hour on, without an operator restart.
    backfill.api.refuse = False
    backfill.clock.now += manifest_backfill.LOOK_AGAIN_SECONDS
    await backfill()
    assert backfill.resolved == [manifest_handoff.PRIMARY] and len(backfill.handed()) == 1
    assert backfill.counted == [manifest_backfill.REFUSED, manifest_backfill.WRITTEN]


async def test_a_namespace_that_refuses_writes_is_not_read_again_every_backoff(
    roots: dict[str, str],
) -> None:
    """A Role that lets the operator get ConfigMaps but not write them: each backoff's
    try would read the whole dataset again to be refused again. Said once, and the
    namespace left alone for the hour."""
    mount = await ready(roots)
    backfill = Backfill(mount)

    async def refuse(body: Mapping[str, Any]) -> None:
        raise PermissionError("the operator's identity may not write ConfigMap ml/x")

    backfill.api.put_config_map = refuse  # type: ignore[method-assign]
    await backfill()
    assert backfill.resolved == [manifest_handoff.PRIMARY]
    for _ in range(3):
        backfill.clock.now += manifest_backfill.RETRY_FIRST_SECONDS
        await backfill()
    assert backfill.resolved == [manifest_handoff.PRIMARY]
    [(kind, reason, message)] = backfill.said
    assert (kind, reason) == ("Warning", manifest_handoff.REASON)
    assert "may not write ConfigMap" in message and "tried again in an hour" in message
    assert backfill.counted == [manifest_backfill.REFUSED]


async def test_a_pin_replaced_while_it_was_read_again_is_not_handed(
    roots: dict[str, str],
) -> None:
    """A reconcile that pinned again meanwhile handed its own pin: the old one must not
    overwrite it."""
    mount = await ready(roots)
    backfill = Backfill(mount)
    moved = {**mount, "status": {**mount["status"], "manifestDigest": "sha256:" + "0" * 64}}
    backfill.api.mount = moved
    await backfill()
    assert backfill.resolved == [manifest_handoff.PRIMARY]
    assert backfill.handed() == [] and backfill.said == []


async def test_only_the_mixture_source_its_configmaps_do_not_hand_is_resolved_again(
    roots: dict[str, str],
) -> None:
    mount = await ready(roots, mixture=True)
    first = Backfill(mount)
    await first()
    assert sorted(first.resolved) == sorted([manifest_handoff.PRIMARY, "code"])
    again = Backfill(mount)
    again.api.config_maps = dict(first.api.config_maps)
    name = manifest_handoff.config_map_name("train", "code", 0)
    del again.api.config_maps[("ml", name)]
    await again()
    assert again.resolved == ["code"]
    assert len(again.handed("code")) == 1


async def test_a_mount_whose_source_changed_since_its_pin_is_left_to_the_reconcile(
    roots: dict[str, str],
) -> None:
    mount = await ready(roots)
    mount["spec"]["source"]["uri"] = roots["code"]
    backfill = Backfill(mount)
    await backfill()
    assert backfill.api.reads == 0 and backfill.resolved == []


async def test_a_manifest_too_large_to_hand_is_marked_and_not_resolved_again(
    roots: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    mount = await ready(roots)
    monkeypatch.setattr(handed_manifests, "MAX_PARTS", 0)
    backfill = Backfill(mount)
    await backfill()
    monkeypatch.undo()
    [marker] = backfill.handed()
    assert marker["metadata"]["annotations"][manifest_handoff.ANNOTATION_PARTS] == "0"
    assert backfill.said == []
    again = Backfill(mount)
    again.api.config_maps = backfill.api.config_maps
    await again()
    assert again.resolved == [] and again.api.reads == 1


async def test_the_mounts_task_retries_until_handed_then_ends(roots: dict[str, str]) -> None:
    """`follow`: the first pass on the status the reconcile writes, then, after each
    wait, the mount as the API server has it, until every pin is settled."""
    mount = await ready(roots)
    backfill = Backfill(mount)
    failures = [2]

    def flaky(uri: str, fmt: str, options: Mapping[str, str] | None) -> manifests.Manifest:
        if failures[0]:
            failures[0] -= 1
            raise errors.SourceError(f"{uri}: connection refused")
        return resolve(uri, fmt, options)

    backfill.resolver = flaky
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        backfill.clock.now += seconds

    await manifest_backfill.follow(mount, backfill.means, sleep=sleep)
    assert slept == [
        manifest_backfill.RETRY_FIRST_SECONDS,
        2 * manifest_backfill.RETRY_FIRST_SECONDS,
    ]
    assert len(backfill.resolved) == 3 and len(backfill.handed()) == 1


@pytest.mark.parametrize("gone", ["deleted", "recreated", "degraded"])
async def test_the_mounts_task_ends_when_the_mount_is_gone_or_not_ready(
    roots: dict[str, str], gone: str
) -> None:
    mount = await ready(roots)
    backfill = Backfill(mount)

    backfill.resolver = unreachable
    if gone == "deleted":
        backfill.api.mount = None
    elif gone == "recreated":
        backfill.api.mount = {**mount, "metadata": {**mount["metadata"], "uid": "u-2"}}
    else:
        backfill.api.mount = {**mount, "status": {**mount["status"], "phase": "Degraded"}}
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    await manifest_backfill.follow(mount, backfill.means, sleep=sleep)
    assert len(slept) == 1 and backfill.resolved == [manifest_handoff.PRIMARY]


async def test_a_task_is_started_only_where_manifests_are_handed_and_a_pin_waits(
    roots: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    mount = await ready(roots)
    started: list[tuple[str, str]] = []

    def start(self: manifest_backfill.Ledger, namespace: str, uid: str, run: Any) -> bool:
        started.append((namespace, uid))
        return True

    monkeypatch.setattr(manifest_backfill.Ledger, "start", start)
    listed = context.Context(
        settings=configuration.Settings(manifest_namespaces=("ml",)),
        api=Api(),  # type: ignore[arg-type]
    )
    handlers.follow_manifests(listed, mount)
    assert started == [("ml", "u-1")]
    unlisted = context.Context(settings=configuration.Settings(), api=Api())  # type: ignore[arg-type]
    handlers.follow_manifests(unlisted, mount)
    handlers.follow_manifests(listed, {**mount, "status": {**mount["status"], "phase": "Pending"}})
    for pin, _ in manifest_backfill.pins_of(mount):
        listed.backfills.settle(pin, time.monotonic())
    handlers.follow_manifests(listed, mount)
    assert started == [("ml", "u-1")]


async def test_a_pin_a_reconcile_handed_is_settled_and_one_it_failed_to_hand_is_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Refusing(Api):
        async def put_config_map(self, body: Mapping[str, Any]) -> None:
            raise PermissionError("the operator's identity may not write ConfigMap")

    body = kopf.Body(
        {
            "apiVersion": "shardcache.io/v1alpha1",
            "kind": "DatasetMount",
            "metadata": {"name": "train", "namespace": "ml", "uid": "u-1"},
        }
    )
    digest = "sha256:" + "ab" * 32
    pinned = [reconcile.Handed(manifest_handoff.PRIMARY, digest, (b"x",))]
    settings = configuration.Settings(manifest_namespaces=("ml",))
    handed = context.Context(settings=settings, api=Api())  # type: ignore[arg-type]
    await handlers.hand_manifests(handed, body, "ml", pinned)
    pin = ("ml", "u-1", manifest_handoff.PRIMARY, digest)
    assert set(handed.backfills.settled) == {pin}
    assert handed.backfills.is_settled(pin, time.monotonic())
    events: list[str] = []
    monkeypatch.setattr(kopf, "event", lambda *_, reason, **__: events.append(reason))
    refused = context.Context(settings=settings, api=Refusing())  # type: ignore[arg-type]
    await handlers.hand_manifests(refused, body, "ml", pinned)
    assert refused.backfills.settled == {} and events == [manifest_handoff.REASON]
    # A namespace without the Role: left alone for the hour, and said once in it.
    assert refused.backfills.is_refused("ml", time.monotonic())
    other = [reconcile.Handed(manifest_handoff.PRIMARY, "sha256:" + "cd" * 32, (b"y",))]
    await handlers.hand_manifests(refused, body, "ml", other)
    assert events == [manifest_handoff.REASON]

    class Failing(Api):
        async def put_config_map(self, body: Mapping[str, Any]) -> None:
            raise RuntimeError("the API server answered 500")

    failing = context.Context(settings=settings, api=Failing())  # type: ignore[arg-type]
    await handlers.hand_manifests(failing, body, "ml", pinned)
    assert events == [manifest_handoff.REASON] * 2
    # Handed by the mount's task later, not at once after a failed write.
    assert not failing.backfills.due(pin, time.monotonic())
    assert not failing.backfills.is_refused("ml", time.monotonic())


async def test_one_task_a_mount_removed_when_it_ends_and_cancelled_when_it_is_deleted() -> None:
    ledger = manifest_backfill.Ledger()
    release = asyncio.Event()
    runs: list[str] = []

    async def run() -> None:
        runs.append("ran")
        await release.wait()

    assert ledger.start("ml", "u-1", run)
    assert not ledger.start("ml", "u-1", run)  # one at a time per mount
    assert ledger.start("ml", "u-2", run)
    await asyncio.sleep(0)
    assert runs == ["ran", "ran"]
    first, second = ledger.tasks[("ml", "u-1")], ledger.tasks[("ml", "u-2")]
    ledger.forget("ml", "u-2")
    release.set()
    await asyncio.gather(first, second, return_exceptions=True)
    await asyncio.sleep(0)
    assert second.cancelled() and not first.cancelled()
    assert ledger.tasks == {}
    assert ledger.start("ml", "u-1", run)  # ended: a later reconcile starts it again
    ledger.close()
    await asyncio.sleep(0)
    assert ledger.tasks == {}


async def test_an_api_server_that_fails_a_read_is_asked_again_later_not_at_once(
    roots: dict[str, str],
) -> None:
    mount = await ready(roots)
    backfill = Backfill(mount)
    fail = [True]
    read = backfill.api.read_config_map

    async def flaky(namespace: str, name: str) -> dict[str, Any] | None:
        if fail[0]:
            raise OSError("connection reset by peer")
        return await read(namespace, name)

    backfill.api.read_config_map = flaky  # type: ignore[method-assign]
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        backfill.clock.now += seconds
        fail[0] = False

    await manifest_backfill.follow(mount, backfill.means, sleep=sleep)
    assert slept == [manifest_backfill.RETRY_FIRST_SECONDS]
    assert len(backfill.handed()) == 1


async def test_a_namespace_whose_store_hangs_delays_only_its_own_backfills(
    roots: dict[str, str],
) -> None:
    """One mount of a namespace at a time, but namespaces side by side: a tenant's
    trickling store holds its own turn, never another tenant's."""
    mount = await ready(roots)
    other = {**mount, "metadata": {**mount["metadata"], "namespace": "other", "uid": "u-9"}}
    backfill = Backfill(mount)
    read = backfill.api.read_datasetmount

    async def by_namespace(namespace: str, name: str) -> dict[str, Any] | None:
        return other if namespace == "other" else await read(namespace, name)

    backfill.api.read_datasetmount = by_namespace  # type: ignore[method-assign]
    hung, release = asyncio.Event(), asyncio.Event()

    async def resolve_again(spec: specs.DatasetMountSpec, source: str) -> status.Outcome:
        hung.set()
        await release.wait()
        return await Backfill.resolve_again(backfill, spec, source)

    stuck = asyncio.create_task(
        manifest_backfill.backfill(
            mount, dataclasses.replace(backfill.means, resolve_again=resolve_again)
        )
    )
    await hung.wait()
    await asyncio.wait_for(manifest_backfill.backfill(other, backfill.means), 10)
    assert [name for (ns, name) in backfill.api.config_maps if ns == "other"]
    same = asyncio.create_task(manifest_backfill.backfill(mount, backfill.means))
    await asyncio.sleep(0.05)
    assert not same.done()  # waits for the namespace's turn
    release.set()
    await asyncio.wait_for(asyncio.gather(stuck, same), 10)


async def test_parts_an_older_operator_wrote_are_taken_as_handed_after_an_upgrade(
    roots: dict[str, str],
) -> None:
    mount = await ready(roots)
    first = Backfill(mount)
    await first()
    for body in first.api.config_maps.values():
        body["metadata"]["annotations"].pop(manifest_handoff.ANNOTATION_PARTS)
    upgraded = Backfill(mount)
    upgraded.api.config_maps = first.api.config_maps
    await upgraded()
    assert upgraded.resolved == [] and upgraded.counted == [manifest_backfill.PRESENT]
    assert upgraded.api.reads == 2  # part 0, then part 1: not there, the end of them
