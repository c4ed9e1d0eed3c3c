"""The operator's kopf registry: which handlers exist, under which ids and filters.

Handler ids become annotation keys of kopf's progress storage on real objects, and
the index id is the keyword handlers receive it under; an id like
"register.<locals>.resolve" is rejected by the API server, so ids are explicit.
"""

from __future__ import annotations

import re
from typing import Any

import kopf
import pytest
from shardcache_operator import app, configuration, handlers, injection, webhook

pytestmark = pytest.mark.unit

ID = re.compile(r"^[A-Za-z0-9][-A-Za-z0-9_./]*$")


def registry(**settings: Any) -> kopf.OperatorRegistry:
    return app.build_registry(configuration.Settings(**settings))


def all_handlers(reg: kopf.OperatorRegistry) -> list[Any]:
    return [
        *reg._activities.get_all_handlers(),
        *reg._indexing.get_all_handlers(),
        *reg._changing.get_all_handlers(),
        *reg._spawning.get_all_handlers(),
        *reg._webhooks.get_all_handlers(),
    ]


def test_every_handler_id_is_a_valid_annotation_key_part() -> None:
    ids = [h.id for h in all_handlers(registry())]
    assert ids and all(ID.match(i) and "<" not in i for i in ids), ids


def test_the_operator_registers_reconcile_timers_finalizer_index_and_webhook() -> None:
    reg = registry()
    changing = {(h.id, h.reason) for h in reg._changing.get_all_handlers()}
    assert {i for i, _ in changing} == {"resolve", "resolve/spec", "finalize"}
    # Pod counts follow pod events; the timers check sources, skips, data stalls and
    # sidecars that die (sidecar_checks).
    timers = {h.id for h in reg._spawning.get_all_handlers()}
    assert timers == {"check-source", "check-skips", "check-stalls", "check-sidecars"}
    # Pods are watched by pod_watch, not kopf: kopf indexes and watches DatasetMounts only.
    (index,) = reg._indexing.get_all_handlers()
    assert index.id == handlers.MOUNT_INDEX
    # Indexing a mount wakes the pod-count writer: no per-event handler (issue 18).
    assert reg._watching.get_all_handlers() == []
    every = [*reg._indexing.get_all_handlers(), *reg._watching.get_all_handlers()]
    every += [*reg._changing.get_all_handlers(), *reg._spawning.get_all_handlers()]
    assert all(h.selector.any_name == "datasetmounts" for h in every)
    # Pods: CREATE injects, UPDATE guards the sidecar; their ephemeral containers
    # (kubectl debug) are a subresource, which kopf gives a handler of its own.
    pods, ephemeral = reg._webhooks.get_all_handlers()
    assert (pods.id, pods.subresource) == (webhook.HANDLER_ID, None)
    assert list(pods.operations or []) == ["CREATE", "UPDATE"]
    assert (ephemeral.id, ephemeral.subresource) == (
        webhook.EPHEMERAL_HANDLER_ID,
        "ephemeralcontainers",
    )
    assert list(ephemeral.operations or []) == ["UPDATE"]
    for mutate in (pods, ephemeral):
        assert mutate.fn is webhook.inject
        assert mutate.labels == {injection.LABEL_MOUNT: kopf.PRESENT}
        assert mutate.persistent is True
    activities = {h.id for h in reg._activities.get_all_handlers()}
    # check-crd: the installed CRD is judged before any mount is handled (crd_version).
    assert activities == {"login", "configure", "check-crd"}


def test_without_the_webhook_no_admission_handler_is_registered() -> None:
    assert registry(webhook_enabled=False)._webhooks.get_all_handlers() == []


def test_handlers_are_module_level_functions_not_closures() -> None:
    # State travels in kopf's memo (context.Context); a closure would hide it.
    fns = [h.fn for h in all_handlers(registry())]
    assert fns and all(fn.__qualname__ == fn.__name__ for fn in fns), fns
    assert {fn.__module__ for fn in fns} == {
        "shardcache_operator.app",
        "shardcache_operator.handlers",
        "shardcache_operator.sidecar_checks",
        "shardcache_operator.webhook",
    }
