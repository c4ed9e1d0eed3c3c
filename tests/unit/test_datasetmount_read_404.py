"""A 404 reading a DatasetMount: the mount missing ("create it") is told apart from the
resource type missing (the CRD is not installed: apply crds/)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import kubernetes
import pytest
from shardcache_operator import kube, lookup_failures, specs

pytestmark = pytest.mark.unit

#: What a kube-apiserver answers for a missing object of a served resource type.
OBJECT_NOT_FOUND = json.dumps(
    {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": 'datasetmounts.shardcache.io "web" not found',
        "reason": "NotFound",
        "details": {"name": "web", "group": "shardcache.io", "kind": specs.PLURAL},
        "code": 404,
    }
)
#: ... and for a path of a group/resource it does not serve (no CRD).
TYPE_NOT_FOUND = "404 page not found\n"


class Custom:
    def __init__(self, body: str) -> None:
        self.body = body

    def get_namespaced_custom_object(self, *_: Any) -> dict[str, Any]:
        exc = kubernetes.client.ApiException(status=404, reason="Not Found")
        exc.body = self.body
        raise exc


def read(body: str) -> object:
    api = kube.Api.__new__(kube.Api)
    api._custom = Custom(body)  # type: ignore[assignment]
    return asyncio.run(api.read_datasetmount("ml", "web"))


def test_a_missing_datasetmount_reads_as_none() -> None:
    assert read(OBJECT_NOT_FOUND) is None


def test_a_missing_crd_is_an_error_that_says_to_apply_the_crds() -> None:
    with pytest.raises(kubernetes.client.ApiException) as raised:
        read(TYPE_NOT_FOUND)
    sentence = lookup_failures.explain(raised.value, namespace="ml", served=())
    assert sentence.startswith("the DatasetMount CRD is not installed"), sentence
    assert "kubectl apply -f <chart>/crds/" in sentence
    assert "create it" not in sentence


@pytest.mark.parametrize(
    "body",
    [
        TYPE_NOT_FOUND,
        "",
        "{not json",
        json.dumps({"kind": "Status", "reason": "NotFound", "details": {"kind": "pods"}}),
        json.dumps({"kind": "Status", "reason": "NotFound"}),
    ],
)
def test_only_a_status_naming_the_mount_is_a_missing_mount(body: str) -> None:
    assert not kube.object_not_found(body, "web")
    assert kube.object_not_found(OBJECT_NOT_FOUND, "web")
    assert not kube.object_not_found(OBJECT_NOT_FOUND, "other")
