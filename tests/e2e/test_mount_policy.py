"""The DatasetMount policy through the real API server (issue 13, rows 6, 7, 9).

The CRD refuses credentials in URIs and unbounded quantities at create time; the
operator marks a DatasetMount that names a node path, image or cache size the platform
did not allow (the chart's `policy.*` defaults) Invalid (reason NotAllowed), and the
webhook refuses its pods, each with a message naming it.
"""

from __future__ import annotations

import json
from typing import Any

import kubernetes.client
import pytest
from kubernetes.client.rest import ApiException

from tests.e2e import harness, objects
from tests.e2e.conftest import ReadyMount

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ({"source": {"uri": "s3://AKIA:secret@bucket/p/"}}, "credentials in a URI"),
        ({"source": {"uri": "s3://b/p/"}, "cache": {"memory": "1e5000"}}, "spec.cache.memory"),
        ({"source": {"uri": "s3://b/p/"}, "cache": {"disk": "1e30"}}, "spec.cache.disk"),
        ({"source": {"uri": "s3://b/p/"}, "cache": {"nodePath": "/var/../etc"}}, "nodePath"),
    ],
)
def test_crd_refuses_credentials_and_unbounded_values(
    admin: kubernetes.client.ApiClient,
    ready_mount: ReadyMount,
    spec: dict[str, Any],
    named: str,
) -> None:
    body = objects.datasetmount(objects.unique("bad"), "s3://b/p/", secret=None)
    body["spec"] = spec
    with pytest.raises(ApiException) as refused:
        objects.create_datasetmount(admin, ready_mount.namespace, body)
    assert refused.value.status == 422
    message = json.loads(refused.value.body)["message"]
    assert named in message, message
    assert "secret@" not in message


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ({"cache": {"nodePath": "/var/lib/kubelet/pods"}}, "spec.cache.nodePath"),
        ({"sidecar": {"image": "localhost/not-allowed:1"}}, "spec.sidecar.image"),
        ({"cache": {"disk": "2Ti"}}, "spec.cache.disk"),
    ],
)
def test_a_mount_beyond_the_platform_policy_is_invalid_and_its_pods_refused(
    admin: kubernetes.client.ApiClient,
    ready_mount: ReadyMount,
    operator: harness.Operator,
    spec: dict[str, Any],
    named: str,
) -> None:
    name = objects.unique("beyond")
    objects.create_datasetmount(
        admin, ready_mount.namespace, objects.datasetmount(name, ready_mount.uri, **spec)
    )
    # The operator says so in status too, without reading the source.
    refused = objects.wait_phase(
        admin, ready_mount.namespace, name, "Invalid", operator, reason="NotAllowed"
    )
    assert named in objects.condition(refused, "Ready")["message"]
    assert "manifestDigest" not in refused
    core = kubernetes.client.CoreV1Api(admin)
    with pytest.raises(ApiException) as refused:
        core.create_namespaced_pod(ready_mount.namespace, objects.pod(None, name))
    message = json.loads(refused.value.body)["message"]
    assert named in message and "policy" in message, message
