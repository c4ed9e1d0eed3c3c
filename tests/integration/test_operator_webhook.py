"""The webhook over real HTTPS: kopf's WebhookServer with our generated certificates,
kopf's admission machinery, our @kopf.on.mutate handler; plus /healthz and /metrics."""

from __future__ import annotations

import asyncio
import base64
import copy
import datetime
import functools
import json
import re
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import jsonpatch
import kopf
import pytest
from cryptography import x509
from kopf._cogs.structs import references
from kopf._core.engines import admission as kopf_admission
from kopf._core.reactor import inventory
from prometheus_client.parser import text_string_to_metric_families
from shardcache_operator import (
    app,
    certs,
    configuration,
    context,
    handlers,
    health,
    injection,
    mounts,
    status,
    webhook,
)

from tests.support.s3server import free_port

pytestmark = pytest.mark.integration

#: The namespace's UID as the API server would give it.
NAMESPACE_UID = "4f9c2a6e-1b3d-4c5e-8f70-9a1b2c3d4e5f"

DIGEST = "sha256:" + "ab" * 32


def dsm(name: str, phase: str = "Ready") -> dict[str, Any]:
    return {
        "apiVersion": "shardcache.io/v1alpha1",
        "kind": "DatasetMount",
        "metadata": {"name": name, "namespace": "ml", "generation": 1},
        "spec": {"source": {"uri": f"s3://data/{name}/", "secretRef": {"name": "creds"}}},
        "status": {"phase": phase, "observedGeneration": 1, "manifestDigest": DIGEST},
    }


class FakeDatasetMounts:
    """Stands in for the API read of DatasetMounts (the API server comes with e2e)."""

    def __init__(self, *objects: dict[str, Any]) -> None:
        self.objects = {(o["metadata"]["namespace"], o["metadata"]["name"]): o for o in objects}
        self.reads = 0

    async def read_secret(self, namespace: str, name: str) -> None:
        raise AssertionError("the webhook reads no Secrets")

    async def read_namespace_uid(self, name: str) -> str | None:
        return NAMESPACE_UID

    async def read_datasetmount(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.reads += 1
        if name == "explodes":
            raise RuntimeError("API server said 500")
        return self.objects.get((namespace, name))


def review(pod: dict[str, Any], uid: str = "uid-1") -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "ml",
            "operation": "CREATE",
            "userInfo": {"username": "alice"},
            "object": pod,
        },
    }


def pod(label: str | None) -> dict[str, Any]:
    labels = {injection.LABEL_MOUNT: label} if label else {}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"generateName": "train-", "namespace": "ml", "labels": labels},
        "spec": {"containers": [{"name": "trainer", "image": "python:3.11"}]},
    }


class Endpoint:
    def __init__(
        self,
        url: str,
        ca_bundle: str,
        memo: context.Context,
        index: dict[tuple[str, str], list[dict[str, Any]]],
    ) -> None:
        self.url = url
        #: kopf's DatasetMount index (only kopf's `inject` path receives it; the webhook
        #: reads the operator's own watch, `memo.mounts`, listed empty here).
        self.index = index
        self.ca_bundle = ca_bundle
        self.memo = memo
        assert isinstance(memo.api, FakeDatasetMounts)
        self.api = memo.api
        self.ssl = ssl.create_default_context(cadata=base64.b64decode(ca_bundle).decode())

    async def post(
        self, body: dict[str, Any], *, path: str = "shardcache-inject"
    ) -> dict[str, Any]:
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{self.url}/{path}", json=body, ssl=self.ssl) as resp,
        ):
            assert resp.status == 200, await resp.text()
            data: dict[str, Any] = await resp.json()
            return data


@pytest.fixture
async def endpoint(tmp_path: Path) -> AsyncIterator[Endpoint]:
    settings = configuration.Settings(
        webhook_addr="127.0.0.1",
        webhook_port=free_port(),
        webhook_cert_dir=str(tmp_path / "tls"),
        sidecar_image="sidecar:test",
    )
    api = FakeDatasetMounts(dsm("imagenet"), dsm("captions"), dsm("cold", phase="Pending"))
    memo = context.Context(settings=settings, api=api)
    index: dict[tuple[str, str], list[dict[str, Any]]] = {}
    registry = kopf.OperatorRegistry()
    webhook.register(registry)
    kopf_settings = kopf.OperatorSettings()
    insights = references.Insights()
    insights.webhook_resources.add(
        references.Resource(
            group="",
            version="v1",
            plural="pods",
            kind="Pod",
            namespaced=True,
            verbs=["create", "list", "watch"],
        )
    )
    fn = functools.partial(
        kopf_admission.serve_admission_request,
        settings=kopf_settings,
        registry=registry,
        insights=insights,
        memories=inventory.ResourceMemories(),
        memobase=memo,
        # kopf hands handlers its indexes as a mapping of id -> index; the watch that
        # feeds the DatasetMount index is the e2e tier's (test_admission_index.py).
        indices={handlers.MOUNT_INDEX: index},
    )
    # The operator's server: pod reviews answered by webhook.answer, others by kopf.
    memo.mounts.index = index
    memo.mounts.listed([])  # the operator's DatasetMount watch: listed, then silent
    serving = webhook.Server(webhook.server(settings), memo)(fn)
    client_config = await serving.__anext__()
    try:
        yield Endpoint(client_config["url"], client_config["caBundle"], memo, index)
    finally:
        await serving.aclose()


async def test_generated_certificate_is_trusted_through_the_ca_bundle(
    endpoint: Endpoint, tmp_path: Path
) -> None:
    ca_pem = base64.b64decode(endpoint.ca_bundle)
    assert ca_pem == (tmp_path / "tls" / "ca.crt").read_bytes()
    serving = x509.load_pem_x509_certificate((tmp_path / "tls" / "tls.crt").read_bytes())
    sans = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "127.0.0.1" in [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)]
    assert endpoint.url.startswith("https://127.0.0.1:")
    # A client that does not trust the CA is refused by TLS itself.
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await session.post(f"{endpoint.url}/shardcache-inject", json=review(pod(None)))


async def test_labelled_pod_is_injected_through_kopf(endpoint: Endpoint) -> None:
    reply = await endpoint.post(review(pod("imagenet"), uid="u-42"))
    response = reply["response"]
    assert response["uid"] == "u-42"
    assert response["allowed"] is True
    assert response["patchType"] == "JSONPatch"
    patched = jsonpatch.apply_patch(
        pod("imagenet"), json.loads(base64.b64decode(response["patch"]))
    )
    (sidecar,) = patched["spec"]["initContainers"]
    assert sidecar["name"] == "shardcache-imagenet"
    assert sidecar["restartPolicy"] == "Always"
    assert sidecar["image"] == "sidecar:test"
    assert patched["metadata"]["annotations"][injection.ANNOTATION_INJECTED] == "imagenet"
    assert patched["metadata"]["labels"] == {injection.LABEL_MOUNT: "imagenet"}
    # Re-admission of the stored pod changes nothing and reads nothing.
    reads = endpoint.api.reads
    again = (await endpoint.post(review(patched)))["response"]
    assert again["allowed"] is True and "patch" not in again
    assert endpoint.api.reads == reads


def update_review(
    old: dict[str, Any], new: dict[str, Any], *, subresource: str | None = None
) -> dict[str, Any]:
    body = review(new, uid="uid-update")
    body["request"] |= {"operation": "UPDATE", "oldObject": old}
    if subresource is not None:
        body["request"]["subResource"] = subresource
    return body


async def test_updates_are_answered_without_a_read_and_refused_when_they_reach_the_sidecar(
    endpoint: Endpoint,
) -> None:
    created = (await endpoint.post(review(pod("imagenet"))))["response"]
    stored = jsonpatch.apply_patch(pod("imagenet"), json.loads(base64.b64decode(created["patch"])))
    reads = endpoint.api.reads
    relabelled = copy.deepcopy(stored)
    relabelled["metadata"]["labels"]["team"] = "vision"
    answer = (await endpoint.post(update_review(stored, relabelled)))["response"]
    assert answer == {"uid": "uid-update", "allowed": True}
    swapped = copy.deepcopy(stored)
    swapped["spec"]["initContainers"][0]["image"] = "evil.example/dump:1"
    answer = (await endpoint.post(update_review(stored, swapped)))["response"]
    assert answer["allowed"] is False
    assert "'shardcache-imagenet' is the cache sidecar" in answer["status"]["message"]
    # kopf's managed mode calls the ephemeral containers' handler at a path of its own.
    debugged = copy.deepcopy(stored)
    debugged["spec"]["ephemeralContainers"] = [
        {"name": "debugger", "image": "busybox", "targetContainerName": "shardcache-imagenet"}
    ]
    for path in ("shardcache-inject", webhook.EPHEMERAL_HANDLER_ID):
        body = update_review(stored, debugged, subresource="ephemeralcontainers")
        answer = (await endpoint.post(body, path=path))["response"]
        assert answer["allowed"] is False, path
        assert "targets 'shardcache-imagenet', the cache sidecar" in answer["status"]["message"]
    assert endpoint.api.reads == reads
    sample = endpoint.memo.metrics.registry.get_sample_value
    assert sample("shardcache_operator_admission_reviews_total", {"result": "refused"}) == 3


async def test_kopfs_own_handler_refuses_the_same_updates(endpoint: Endpoint) -> None:
    """`inject` as kopf calls it (with `operation` and `old`), for kopf's serving."""
    stored = jsonpatch.apply_patch(
        pod("imagenet"),
        json.loads(
            base64.b64decode((await endpoint.post(review(pod("imagenet"))))["response"]["patch"])
        ),
    )
    swapped = copy.deepcopy(stored)
    swapped["spec"]["initContainers"][0]["image"] = "evil.example/dump:1"
    with pytest.raises(kopf.AdmissionError, match="is the cache sidecar of DatasetMount imagenet"):
        await webhook.inject(
            body=kopf.Body(swapped),
            patch=kopf.Patch(),
            warnings=[],
            memo=endpoint.memo,
            operation="UPDATE",
            old=kopf.Body(stored),
        )
    patch = kopf.Patch()
    relabelled = copy.deepcopy(stored)
    relabelled["metadata"]["labels"]["team"] = "vision"
    await webhook.inject(
        body=kopf.Body(relabelled),
        patch=patch,
        warnings=[],
        memo=endpoint.memo,
        operation="UPDATE",
        old=kopf.Body(stored),
    )
    assert not patch


async def test_a_mount_missing_from_the_index_is_read_once_then_served_from_memory(
    endpoint: Endpoint,
) -> None:
    for i in range(3):
        answer = await endpoint.post(review(pod("imagenet"), uid=f"uid-{i}"))
        assert answer["response"]["allowed"] is True and answer["response"]["patch"]
    assert endpoint.api.reads == 1
    sample = endpoint.memo.metrics.registry.get_sample_value
    assert sample("shardcache_operator_admission_lookups_total", {"source": "api"}) == 1
    assert sample("shardcache_operator_admission_lookups_total", {"source": "memory"}) == 2
    # Parsed once for all three pods: same uid and generation.
    assert endpoint.memo.mounts.parses == 1


async def test_a_watched_mount_costs_no_read_and_its_status_there_decides(
    endpoint: Endpoint,
) -> None:
    endpoint.memo.mounts.seen("ADDED", dsm("captions", phase="Degraded"))
    answer = await endpoint.post(review(pod("captions")))
    assert answer["response"]["allowed"] is False
    assert "is not Ready (phase Degraded" in answer["response"]["status"]["message"]
    endpoint.memo.mounts.seen("MODIFIED", dsm("captions"))
    answer = await endpoint.post(review(pod("captions"), uid="uid-2"))
    assert answer["response"]["allowed"] is True
    assert endpoint.api.reads == 0


async def test_a_frozen_kopf_index_is_not_what_pods_are_admitted_from(
    endpoint: Endpoint,
) -> None:
    # kopf stops watching while peering pauses a replica, and its index stays as it was
    # when the replica was outranked (node tier, s18): here a Degraded copy, while the
    # mount is Ready now. The webhook reads its own watch, then the API: admitted.
    endpoint.index[("ml", "captions")] = [dsm("captions", phase="Degraded")]
    answer = await endpoint.post(review(pod("captions")))
    assert answer["response"]["allowed"] is True, answer["response"]
    assert endpoint.api.reads == 1


async def test_unlabelled_pod_passes_untouched(endpoint: Endpoint) -> None:
    response = (await endpoint.post(review(pod(None))))["response"]
    assert response["allowed"] is True
    assert "patch" not in response
    assert endpoint.api.reads == 0


@pytest.mark.parametrize(
    ("label", "message"),
    [
        ("missing", "DatasetMount ml/missing does not exist"),
        ("cold", "DatasetMount ml/cold is not Ready (phase Pending"),
        (
            "explodes",
            "DatasetMount ml/explodes could not be read: the operator got no answer from the "
            "API server (RuntimeError: API server said 500); retry in a moment",
        ),
        ("imagenet_missing", "DatasetMount ml/missing does not exist"),
    ],
)
async def test_refusals_name_the_datasetmount_and_why(
    endpoint: Endpoint, label: str, message: str
) -> None:
    response = (await endpoint.post(review(pod(label))))["response"]
    assert response["allowed"] is False
    assert response["status"]["code"] == 403
    assert message in response["status"]["message"]
    assert "patch" not in response


async def test_webhook_keeps_serving_after_bad_requests(endpoint: Endpoint) -> None:
    responses = await asyncio.gather(
        endpoint.post(review(pod("explodes"))),
        endpoint.post(review(pod("Not_A_Name"))),
        endpoint.post(review(pod("imagenet_captions"))),
    )
    assert [r["response"]["allowed"] for r in responses] == [False, False, True]


METRIC_NAME = re.compile(r"^shardcache_operator_[a-z0-9_]+$")


async def test_healthz_readyz_and_metrics_follow_prometheus_conventions(
    endpoint: Endpoint,
) -> None:
    await endpoint.post(review(pod("imagenet")))
    await endpoint.post(review(pod("missing")))
    meters = endpoint.memo.metrics
    meters.set_phase("ml", "imagenet", status.Phase.READY)
    # Counted from the pod index by the count writer, as the operator does: the gauge
    # shows what the writer computed, not a value the test wrote.
    pods = {("ml", "imagenet"): ["trainer-0", "trainer-1", "trainer-2"]}
    known = mounts.Store()
    known.listed([dsm("imagenet")])
    endpoint.memo.pod_counts.touch(pods, known)

    async def write(namespace: str, name: str, count: int) -> None:
        pass

    await endpoint.memo.pod_counts.flush(write, meters)
    ready = asyncio.Event()
    runner = await health.start("127.0.0.1", 0, ready, meters)
    try:
        port = runner.addresses[0][1]
        base = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{base}/healthz") as resp:
                assert resp.status == 200
            async with session.get(f"{base}/readyz") as resp:
                assert resp.status == 503
            ready.set()
            async with session.get(f"{base}/readyz") as resp:
                assert resp.status == 200
            async with session.get(f"{base}/metrics") as resp:
                assert resp.status == 200
                assert resp.headers["Content-Type"].startswith("text/plain")
                text = await resp.text()
    finally:
        await runner.cleanup()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, family in families.items():
        assert METRIC_NAME.match(name), name
        assert family.documentation, name
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples), name
        if family.type == "histogram":
            assert name.endswith("_seconds"), name
        assert not name.endswith("_total") or family.type == "counter", name
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in families.values()
        for s in f.samples
    }
    assert samples[("shardcache_operator_admission_reviews_total", (("result", "injected"),))] >= 1
    assert samples[("shardcache_operator_admission_reviews_total", (("result", "refused"),))] >= 1
    assert samples[("shardcache_operator_datasetmounts", (("phase", "Ready"),))] >= 1
    assert (
        samples[
            (
                "shardcache_operator_attached_pods",
                (("datasetmount", "imagenet"), ("namespace", "ml")),
            )
        ]
        == 3
    )
    assert samples[("shardcache_operator_up", ())] == 1
    assert "shardcache_operator_reconcile_duration_seconds" in families


def test_generated_serving_certificate_chains_to_its_ca() -> None:
    bundle = certs.generate(certs.service_sans("shardcache-webhook", "shardcache-system"))
    ca = x509.load_pem_x509_certificate(bundle.ca_pem)
    cert = x509.load_pem_x509_certificate(bundle.cert_pem)
    cert.verify_directly_issued_by(ca)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "shardcache-webhook.shardcache-system.svc" in sans.get_values_for_type(x509.DNSName)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    assert cert.not_valid_after_utc - cert.not_valid_before_utc >= datetime.timedelta(days=300)


def test_configuration_for_the_chart_matches_what_kopf_manages() -> None:
    registry = kopf.OperatorRegistry()
    webhook.register(registry)
    pods = references.Resource(
        group="", version="v1", plural="pods", kind="Pod", namespaced=True, verbs=["create"]
    )
    managed = kopf_admission.build_webhooks(
        registry._webhooks.get_all_handlers(),
        resources=[pods],
        name_suffix="shardcache.io",
        client_config={"url": "https://127.0.0.1:9443"},
    )
    config = webhook.build_configuration(
        "shardcache.io", ca_bundle="Q0E=", url="https://127.0.0.1:9443"
    )
    assert len(config["webhooks"]) == len(managed) == 2
    for ours, theirs in zip(config["webhooks"], managed, strict=True):
        assert ours["name"] == theirs["name"]
        assert ours["clientConfig"]["url"] == theirs["clientConfig"]["url"]
        assert ours["objectSelector"] == theirs["objectSelector"]
        assert ours["failurePolicy"] == theirs["failurePolicy"] == "Fail"
        # kopf writes no reinvocationPolicy; the API server's default is Never, as ours.
        assert ours["reinvocationPolicy"] == theirs.get("reinvocationPolicy", "Never") == "Never"
        assert ours["rules"][0]["operations"] == theirs["rules"][0]["operations"]
        assert ours["rules"][0]["resources"] == theirs["rules"][0]["resources"]
        # Beyond what kopf can write: UPDATEs that leave the spec alone are not sent.
        assert ours["matchConditions"] == list(webhook.MATCH_CONDITIONS)
    pods_hook, ephemeral_hook = config["webhooks"]
    assert pods_hook["rules"][0]["operations"] == ["CREATE", "UPDATE"]
    assert pods_hook["rules"][0]["resources"] == ["pods"]
    assert ephemeral_hook["rules"][0]["operations"] == ["UPDATE"]
    assert ephemeral_hook["rules"][0]["resources"] == ["pods/ephemeralcontainers"]
    in_cluster = webhook.build_configuration(
        "shardcache", ca_bundle="Q0E=", service="shardcache-webhook", namespace="shardcache"
    )
    service = in_cluster["webhooks"][0]["clientConfig"]["service"]
    assert service == {
        "name": "shardcache-webhook",
        "namespace": "shardcache",
        "path": "/shardcache-inject",
        "port": 443,
    }
    assert in_cluster["webhooks"][1]["clientConfig"]["service"]["path"] == (
        "/shardcache-ephemeral-containers"
    )


async def test_the_operator_is_ready_only_once_its_webhook_server_listens(
    tmp_path: Path,
) -> None:
    """kopf raises its ready flag before its root tasks, the webhook server among them,
    start: /readyz said ready while labelled pods were refused with 'connection refused'
    calling the webhook (seen in the e2e tier right after an operator restart)."""
    port = free_port()
    settings = configuration.Settings(
        webhook_addr="127.0.0.1",
        webhook_port=port,
        webhook_cert_dir=str(tmp_path / "tls"),
        sidecar_image="sidecar:test",
    )
    memo = context.Context(settings=settings, api=FakeDatasetMounts())
    started, ready = asyncio.Event(), asyncio.Event()
    readiness = asyncio.create_task(app._ready_when(started, memo.webhook_listening, ready))
    started.set()  # kopf's flag: startup handlers done
    await asyncio.sleep(0.05)
    assert not ready.is_set()
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)

    async def unused(*_: Any, **__: Any) -> Any:
        raise AssertionError("no review is sent here")

    serving = webhook.Server(webhook.server(settings), memo)(unused)
    try:
        await serving.__anext__()
        await asyncio.wait_for(readiness, timeout=5)
        assert ready.is_set()
        _, writer = await asyncio.open_connection("127.0.0.1", port)  # it listens
        writer.close()
    finally:
        await serving.aclose()
