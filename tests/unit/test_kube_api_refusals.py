"""How `kube.Api` answers an API server that refuses (403) or does not have (404) what
it reads or writes: a refusal is a PermissionError naming the action and where the chart
grants it, a missing object is None (or nothing to delete), anything else is raised."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import kubernetes
import pytest
from shardcache_operator import kube

pytestmark = pytest.mark.unit

CONFIG_MAP = {"metadata": {"namespace": "ml", "name": "train-manifest"}, "data": {"a": "b"}}


class Core:
    """A CoreV1Api whose calls fail with the statuses given, in turn, per method."""

    def __init__(self, **statuses: list[int]) -> None:
        self.statuses = statuses
        self.calls: list[str] = []

    def __getattr__(self, method: str) -> Callable[..., Any]:
        def call(*_: Any, **__: Any) -> Any:
            self.calls.append(method)
            remaining = self.statuses.get(method)
            if not remaining:
                return kubernetes.client.V1ConfigMap()
            raise kubernetes.client.ApiException(status=remaining.pop(0), reason="Refused")

        return call


def api(core: Core) -> kube.Api:
    made = kube.Api.__new__(kube.Api)
    made._core = core  # type: ignore[assignment]
    return made


#: Each method: the CoreV1Api call that fails, how to call it, and its 403 sentence.
METHODS: dict[str, tuple[str, Callable[[kube.Api], Awaitable[object]], str]] = {
    "read_secret": (
        "read_namespaced_secret",
        lambda a: a.read_secret("ml", "s3-creds"),
        "the operator's identity may not get Secret ml/s3-creds",
    ),
    "read_namespace_uid": (
        "read_namespace",
        lambda a: a.read_namespace_uid("ml"),
        "the operator's identity may not get namespace ml (the chart's ClusterRole grants "
        "it: rbac.create)",
    ),
    "read_config_map": (
        "read_namespaced_config_map",
        lambda a: a.read_config_map("ml", "train-manifest"),
        "the operator's identity may not get ConfigMap ml/train-manifest (the chart grants "
        "it in rbac.manifestNamespaces)",
    ),
    "put_config_map": (
        "create_namespaced_config_map",
        lambda a: a.put_config_map(CONFIG_MAP),
        "the operator's identity may not write ConfigMap ml/train-manifest (the chart "
        "grants it in rbac.manifestNamespaces)",
    ),
    "delete_config_map": (
        "delete_namespaced_config_map",
        lambda a: a.delete_config_map("ml", "train-manifest"),
        "the operator's identity may not delete ConfigMap ml/train-manifest (the chart "
        "grants it in rbac.manifestNamespaces)",
    ),
}


@pytest.mark.parametrize("method", METHODS)
async def test_a_refusal_is_a_permission_error_naming_the_action_and_the_chart_setting(
    method: str,
) -> None:
    core_call, call, sentence = METHODS[method]
    with pytest.raises(PermissionError) as raised:
        await call(api(Core(**{core_call: [403]})))
    assert str(raised.value) == sentence
    assert isinstance(raised.value.__cause__, kubernetes.client.ApiException)
    assert raised.value.__cause__.status == 403


@pytest.mark.parametrize("method", ["read_secret", "read_namespace_uid", "read_config_map"])
async def test_a_missing_object_reads_as_none(method: str) -> None:
    core_call, call, _ = METHODS[method]
    assert await call(api(Core(**{core_call: [404]}))) is None


async def test_deleting_a_missing_config_map_is_done() -> None:
    core = Core(delete_namespaced_config_map=[404])
    await api(core).delete_config_map("ml", "train-manifest")
    assert core.calls == ["delete_namespaced_config_map"]


async def test_a_config_map_write_to_a_missing_namespace_is_raised() -> None:
    """A 404 of the create (no such namespace) is not mapped: nothing was written."""
    with pytest.raises(kubernetes.client.ApiException) as raised:
        await api(Core(create_namespaced_config_map=[404])).put_config_map(CONFIG_MAP)
    assert raised.value.status == 404


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("status", [401, 500])
async def test_other_refusals_are_raised_as_they_are(method: str, status: int) -> None:
    core_call, call, _ = METHODS[method]
    with pytest.raises(kubernetes.client.ApiException) as raised:
        await call(api(Core(**{core_call: [status]})))
    assert raised.value.status == status


async def test_a_config_map_that_exists_is_replaced() -> None:
    core = Core(create_namespaced_config_map=[409])
    await api(core).put_config_map(CONFIG_MAP)
    assert core.calls == ["create_namespaced_config_map", "replace_namespaced_config_map"]


async def test_a_refused_config_map_replace_names_the_chart_setting() -> None:
    core = Core(create_namespaced_config_map=[409], replace_namespaced_config_map=[403])
    with pytest.raises(PermissionError) as raised:
        await api(core).put_config_map(CONFIG_MAP)
    assert str(raised.value) == METHODS["put_config_map"][2]
    assert isinstance(raised.value.__cause__, kubernetes.client.ApiException)
    assert raised.value.__cause__.status == 403
    assert core.calls == ["create_namespaced_config_map", "replace_namespaced_config_map"]
