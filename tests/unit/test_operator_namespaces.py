"""A namespaced operator (--namespace, the chart's operator.watchNamespaces): kopf serves
its names at once without listing namespaces, its webhook admits pods of namespaces it
does not serve unchanged, and a failed DatasetMount read is refused in one sentence."""

from __future__ import annotations

import asyncio
from typing import Any

import kopf
import kubernetes
import pytest
from kopf._cogs.structs import references
from kopf._core.reactor import observation
from shardcache_operator import (
    app,
    configuration,
    context,
    lookup_failures,
    served_namespaces,
    webhook,
)

from shardcache import contract

pytestmark = pytest.mark.unit

#: The namespace's UID as the API server would give it.
NAMESPACE_UID = "4f9c2a6e-1b3d-4c5e-8f70-9a1b2c3d4e5f"


def test_exact_names_are_told_from_kopf_patterns() -> None:
    assert served_namespaces.exact(("team-a", "team-b"))
    for pattern in ("team-*", "!kube-system", "team-a,team-b", "team-?"):
        assert not served_namespaces.exact(("team-a", pattern))
    assert served_namespaces.serves((), "anything")
    assert served_namespaces.serves(("team-a",), "team-a")
    assert not served_namespaces.serves(("team-a",), "team-b")
    assert served_namespaces.serves(("team-*",), "team-b")  # a pattern: the read decides


@pytest.mark.parametrize(
    ("namespaces", "disabled"),
    [((), False), (("team-a",), True), (("team-a", "team-b"), True), (("team-*",), False)],
)
def test_kopf_scanning_is_off_for_exact_namespace_names(
    namespaces: tuple[str, ...], disabled: bool
) -> None:
    settings = configuration.Settings(namespaces=namespaces, webhook_enabled=False)
    kopf_settings = kopf.OperatorSettings()
    app.configure(settings=kopf_settings, memo=context.Context(settings=settings, api=None))  # type: ignore[arg-type]
    assert kopf_settings.scanning.disabled is disabled


async def test_kopf_serves_exact_names_at_once_without_listing_namespaces() -> None:
    """kopf's own namespace observer, with the settings `app.configure` gives it: no API
    call at all (there is no API server here; a listing would hang, then retry for
    about a minute on the 403 a namespaced release's ServiceAccount gets)."""
    settings = configuration.Settings(namespaces=("team-a", "team-b"), webhook_enabled=False)
    kopf_settings = kopf.OperatorSettings()
    app.configure(settings=kopf_settings, memo=context.Context(settings=settings, api=None))  # type: ignore[arg-type]
    kopf_settings.networking.request_timeout = 1
    insights = references.Insights()
    namespaces = references.Resource("", "v1", "namespaces", namespaced=False)
    await insights.backbone.fill(resources=[namespaces])
    observer = asyncio.create_task(
        observation.namespace_observer(
            clusterwide=False,
            namespaces=list(settings.namespaces),
            insights=insights,
            settings=kopf_settings,
        )
    )
    try:
        await asyncio.wait_for(insights.ready_namespaces.wait(), timeout=2)
        assert insights.namespaces == {"team-a", "team-b"}
    finally:
        observer.cancel()
        await asyncio.gather(observer, return_exceptions=True)


class ForbiddenApi:
    """The API as a namespaced release's operator sees it outside its namespaces."""

    def __init__(self, status: int = 403, reason: str = "Forbidden") -> None:
        self.reads = 0
        self.status = status
        self.reason = reason

    async def read_namespace_uid(self, name: str) -> str | None:
        return NAMESPACE_UID

    async def read_datasetmount(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.reads += 1
        exc = kubernetes.client.ApiException(status=self.status, reason=self.reason)
        exc.headers = {"Audit-Id": "0f3c", "X-Kubernetes-Pf-Flowschema-Uid": "77"}
        exc.body = (
            '{"kind":"Status","message":"datasetmounts.shardcache.io \\"train\\" is forbidden: '
            'User \\"system:serviceaccount:a-system:a-shardcache\\" cannot get"}'
        )
        raise exc


def request(namespace: str, *, old: dict[str, Any] | None = None) -> dict[str, Any]:
    """A pod's CREATE, or with `old` its UPDATE."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "trainer",
            "namespace": namespace,
            "labels": {"shardcache.io/mount": "train"},
        },
        "spec": {"containers": [{"name": "trainer", "image": "python:3.11"}]},
    }
    body: dict[str, Any] = {"uid": "u-1", "namespace": namespace, "object": pod}
    body["operation"] = "CREATE" if old is None else "UPDATE"
    if old is not None:
        body["oldObject"] = old
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": body}


def memo_for(namespaces: tuple[str, ...], api: ForbiddenApi) -> context.Context:
    settings = configuration.Settings(namespaces=namespaces, sidecar_image="sidecar:test")
    return context.Context(settings=settings, api=api)  # type: ignore[arg-type]


async def test_a_pod_of_a_namespace_the_operator_does_not_serve_is_admitted_unchanged() -> None:
    api = ForbiddenApi()
    memo = memo_for(("team-a",), api)
    response = (await webhook.answer(request("team-b"), memo))["response"]
    assert response["allowed"] is True
    assert "patch" not in response
    assert "warnings" not in response
    assert api.reads == 0


async def test_the_injected_sidecar_stays_guarded_in_any_namespace() -> None:
    """The UPDATE guard reads nothing, so it needs no permission: every release whose
    webhook sees the pod refuses an UPDATE that drops or changes an injected sidecar."""
    injected = request("team-b")["request"]["object"]
    injected["spec"]["initContainers"] = [
        {
            "name": "shardcache-train",
            "image": "sidecar:test",
            "env": [{"name": contract.ENV_MOUNT, "value": "train"}],
        }
    ]
    memo = memo_for(("team-a",), ForbiddenApi())
    response = (await webhook.answer(request("team-b", old=injected), memo))["response"]
    assert response["allowed"] is False
    assert "is the cache sidecar of DatasetMount train" in response["status"]["message"]


async def test_a_forbidden_read_is_refused_in_one_sentence_without_http_details() -> None:
    api = ForbiddenApi()
    memo = memo_for(("team-a",), api)
    response = (await webhook.answer(request("team-a"), memo))["response"]
    assert response["allowed"] is False
    message = response["status"]["message"]
    assert message.startswith(
        "DatasetMount team-a/train could not be read: the operator may not get DatasetMounts "
        "in namespace team-a (the API server answered 403 Forbidden): the release's Role in "
        "team-a grants it"
    )
    assert "operator.watchNamespaces, which is namespace team-a" in message
    for leaked in ("HTTP", "Audit-Id", "{", "Reason:", "\n"):
        assert leaked not in message


@pytest.mark.parametrize(
    ("exc", "served", "expected"),
    [
        (
            kubernetes.client.ApiException(status=403, reason="Forbidden"),
            (),
            "the operator may not get DatasetMounts in namespace ml (the API server answered "
            "403 Forbidden): the release's ClusterRole grants it; check that it and its "
            "binding to the operator's ServiceAccount exist (`helm upgrade` restores them)",
        ),
        (
            kubernetes.client.ApiException(status=503, reason="Service Unavailable"),
            (),
            "the API server answered 503 Service Unavailable; retry in a moment, and check "
            "the API server if it persists",
        ),
        (
            kubernetes.client.ApiException(status=401, reason="Unauthorized"),
            ("ml",),
            "the API server did not accept the operator's credentials (the API server "
            "answered 401 Unauthorized): its ServiceAccount token may have expired or been "
            "revoked; restart the operator (`kubectl rollout restart deployment` of the "
            "release)",
        ),
        (
            ConnectionRefusedError(111, "Connection refused"),
            (),
            "the operator got no answer from the API server (ConnectionRefusedError: [Errno "
            "111] Connection refused); retry in a moment, and check the API server if it "
            "persists",
        ),
    ],
)
def test_lookup_failures_say_what_was_tried_found_and_to_do(
    exc: BaseException, served: tuple[str, ...], expected: str
) -> None:
    assert lookup_failures.explain(exc, namespace="ml", served=served) == expected
