"""The mutating admission webhook for pods, around the pure `admission.decide`.

`Server` wraps kopf's HTTPS server and answers pod reviews itself (`answer`); the kopf
handler `inject` stays registered for kopf's managed mode. Both read the API client,
settings, metrics and the DatasetMounts in memory from the `context.Context` memo.

The webhook configuration selects pods by the opt-in label (objectSelector on
`shardcache.io/mount`), so unlabelled pods never reach the operator. It sees their
CREATE (injection) and their UPDATEs, of the pod and of its ephemeral containers,
which may not touch the injected sidecar (`pod_updates`). A pod created in a namespace
the operator does not serve is admitted unchanged (`served_namespaces`). TLS comes from
certificate files (the chart's Secret), reloaded when they change (`tls_reload`), or
from `certs.generate` at start-up.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import tempfile
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import kopf

from shardcache import errors
from shardcache_operator import (
    admission,
    authority,
    certs,
    configuration,
    context,
    event_gates,
    handlers,
    injection,
    job_pins,
    kube,
    lookup_failures,
    namespace_uids,
    pod_updates,
    served_namespaces,
    specs,
    tls_reload,
)

logger = logging.getLogger(__name__)


# Settings are frozen and read once at start-up: every review gets the same values, and
# building them per review was 2 % of the operator's CPU in a burst (issue 18).
@functools.lru_cache(maxsize=4)
def defaults_of(settings: configuration.Settings) -> injection.SidecarDefaults:
    return injection.SidecarDefaults(
        image=settings.sidecar_image,
        run_dir=settings.run_dir,
        run_as_user=settings.sidecar_uid,
        startup_timeout_seconds=settings.startup_timeout_seconds,
        metrics_port=settings.metrics_port_first,
        metrics_port_last=settings.metrics_port_last,
        manifest_namespaces=settings.manifest_namespaces,
    )


@functools.lru_cache(maxsize=4)
def _policy(settings: configuration.Settings) -> authority.Policy:
    return settings.policy()


#: Our patch is final: injection reads only the pod as the API server first shows it
#: and is idempotent, so a second call per pod (IfNeeded) only doubled the webhook
#: traffic of a burst (issue 18). kopf's managed mode writes no reinvocationPolicy,
#: which the API server defaults to Never too. docs/operator.md says when to change it:
#: another mutating webhook ordered after ours that adds trainer containers.
REINVOCATION_POLICY = "Never"

#: Handler id; kopf serves it at the URL path /<id>, which a configuration must name.
HANDLER_ID = "shardcache-inject"
#: The handler of `pods/ephemeralcontainers` UPDATEs (`kubectl debug`). kopf gives each
#: subresource a handler (and a webhook in managed mode) of its own; `Server` answers
#: both the same way, and the chart's one webhook sends both to HANDLER_ID's path.
EPHEMERAL_HANDLER_ID = "shardcache-ephemeral-containers"
HANDLER_IDS = (HANDLER_ID, EPHEMERAL_HANDLER_ID)

#: The API server calls the webhook for a CREATE, and for an UPDATE only when the pod's
#: spec changes: a label, annotation, finalizer or owner change (the Job controller's
#: finalizer removals, for one) can reach no container, so it costs no call and does
#: not wait for the operator (failurePolicy Fail). A CEL match condition (GA in
#: Kubernetes 1.30, beta and on in 1.28); kopf's managed mode cannot write one, so there
#: those UPDATEs come and are admitted at once (`admission.decide_update`).
MATCH_CONDITIONS = (
    {
        "name": "create-or-spec-change",
        "expression": "request.operation != 'UPDATE' || object.spec != oldObject.spec",
    },
)


def build_configuration(
    name: str,
    *,
    ca_bundle: str,
    service: str | None = None,
    namespace: str | None = None,
    port: int = 443,
    url: str | None = None,
) -> dict[str, Any]:
    """A MutatingWebhookConfiguration for the pod webhook, pointing at a Service or a URL.

    The webhooks kopf writes in managed mode (see docs/operator.md), one per handler:
    pods on CREATE and UPDATE, and `pods/ephemeralcontainers` on UPDATE; objectSelector
    on the opt-in label, failurePolicy Fail, no side effects. Beyond kopf's: the match
    conditions that spare the webhook UPDATEs which leave the spec alone.
    """
    if (service is None) == (url is None):
        raise ValueError("give either service (with namespace) or url")

    def client_config(handler: str) -> dict[str, Any]:
        if url is not None:
            return {"caBundle": ca_bundle, "url": f"{url.rstrip('/')}/{handler}"}
        path = f"/{handler}"
        return {
            "caBundle": ca_bundle,
            "service": {"name": service, "namespace": namespace, "path": path, "port": port},
        }

    def webhook(handler: str, resource: str, operations: list[str]) -> dict[str, Any]:
        return {
            # Webhook names need three dot-separated segments.
            "name": f"{handler}.{specs.GROUP}",
            "admissionReviewVersions": ["v1"],
            "clientConfig": client_config(handler),
            "rules": [
                {
                    "apiGroups": [""],
                    "apiVersions": ["v1"],
                    "resources": [resource],
                    "operations": operations,
                    "scope": "Namespaced",
                }
            ],
            "objectSelector": {
                "matchExpressions": [{"key": injection.LABEL_MOUNT, "operator": "Exists"}]
            },
            "matchConditions": [dict(c) for c in MATCH_CONDITIONS],
            "failurePolicy": "Fail",
            "sideEffects": "None",
            "matchPolicy": "Equivalent",
            "reinvocationPolicy": REINVOCATION_POLICY,
            "timeoutSeconds": 10,
        }

    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [
            webhook(HANDLER_ID, "pods", ["CREATE", "UPDATE"]),
            webhook(EPHEMERAL_HANDLER_ID, f"pods/{pod_updates.EPHEMERAL_SUBRESOURCE}", ["UPDATE"]),
        ],
    }


def server(
    settings: configuration.Settings,
    *,
    reload_interval: float = tls_reload.CHECK_INTERVAL_SECONDS,
) -> kopf.WebhookServer:
    """kopf's HTTPS server with our certificates (never kopf's oscrypto self-signing),
    reloaded when their files change (`tls_reload`: cert-manager renewals)."""
    cert_file, key_file, ca_file = (
        settings.webhook_cert_file,
        settings.webhook_key_file,
        settings.webhook_ca_file,
    )
    if not (cert_file and key_file):
        host = settings.webhook_host or settings.webhook_addr
        sans = [s for s in (host, *settings.webhook_sans) if s and s != "0.0.0.0"]
        if not sans:
            sans = ["localhost", "127.0.0.1"]
        directory = Path(settings.webhook_cert_dir or tempfile.mkdtemp(prefix="shardcache-tls-"))
        files = certs.write(certs.generate(sans), directory)
        cert_file, key_file, ca_file = (
            str(files.cert_file),
            str(files.key_file),
            str(files.ca_file),
        )
        logger.info("generated a webhook CA and certificate for %s in %s", sans, directory)
    return tls_reload.WebhookServer(
        tls_reload.Reloader(Path(cert_file), Path(key_file), interval=reload_interval),
        addr=settings.webhook_addr,
        port=settings.webhook_port,
        host=settings.webhook_host,
        cafile=ca_file,
    )


async def decide(
    pod: Mapping[str, Any], namespace: str, memo: context.Context
) -> admission.Decision:
    """`admission.decide` for one pod, its DatasetMounts found in memory, and metrics.

    Mounts come from the operator's own DatasetMount watch (`mount_watch`, live on
    standby replicas too, unlike kopf's index); one the watch has not delivered yet is
    read from the API once and then served from memory (`mounts.Store`), so a burst of
    pods costs no API reads.
    """
    started = time.monotonic()
    served = memo.settings.namespaces
    if not served_namespaces.serves(served, namespace):
        return _unserved(pod, memo, started)
    metadata: Mapping[str, Any] = pod.get("metadata") or {}
    # Find every requested DatasetMount first; the decision itself is pure.
    fetched: dict[str, Mapping[str, Any] | Exception | None] = {}
    try:
        wanted = injection.requested_mounts(metadata)
        injected = injection.injected_mounts(pod)
    except errors.InputError:
        wanted, injected = [], []  # admit() refuses with the message
    namespace_uid: str | None = None
    if any(name not in injected for name in wanted):
        try:
            namespace_uid = await memo.namespaces.uid(namespace, memo.api.read_namespace_uid)
        except namespace_uids.Unavailable as exc:
            return _refused(pod, memo, started, namespace_refusal(namespace, exc))
    for name in wanted:
        if name in injected:
            continue
        fetched[name] = memo.mounts.lookup(namespace, name, now=time.monotonic())
        if fetched[name] is not None:
            memo.metrics.admission_lookups_total.labels(source="memory").inc()
            continue
        memo.metrics.admission_lookups_total.labels(source="api").inc()
        try:
            found = await memo.api.read_datasetmount(namespace, name)
        except Exception as exc:  # the API failed: refuse this pod, keep serving
            fetched[name] = exc
            continue
        fetched[name] = found
        if found is not None:
            memo.mounts.remember(found, now=time.monotonic())

    def lookup(_namespace: str, name: str) -> Mapping[str, Any] | None:
        found = fetched.get(name)
        if isinstance(found, Exception):
            raise admission.LookupFailed(
                lookup_failures.explain(found, namespace=namespace, served=served)
            )
        return found

    # A pod of a job gets what its job's live pods of each mount were given, as the
    # operator's pod watch last saw them (`job_pins`).
    job = job_pins.job_of(metadata) if isinstance(metadata, Mapping) else None
    siblings = (
        {name: memo.pods.jobs.pins(namespace, job.key, name) for name in wanted}
        if job is not None
        else None
    )
    unpinned = (
        {name: memo.pods.jobs.unpinned(namespace, job.key, name) for name in wanted}
        if job is not None
        else None
    )
    decision = admission.admit(
        pod,
        namespace=namespace,
        namespace_uid=namespace_uid,
        siblings=siblings,
        unpinned=unpinned,
        lookup=lookup,
        defaults=defaults_of(memo.settings),
        missing_policy=memo.settings.missing_policy,
        load=functools.partial(memo.mounts.load, known=len(memo.mounts.watched)),
        policy=_policy(memo.settings),
        parts=memo.parts,
    )
    for name, reason, message in decision.events:
        obj = fetched.get(name)
        if isinstance(obj, Mapping):
            await post_event(memo, obj, reason, message, now=time.monotonic())
    memo.metrics.admission_duration.observe(time.monotonic() - started)
    result = "refused" if not decision.allowed else "injected" if decision.injected else "unchanged"
    memo.metrics.admission_total.labels(result=result).inc()
    return decision


#: Seconds the webhook waits for its Event to be created (`post_event`).
EVENT_TIMEOUT_SECONDS = 2.0


async def post_event(
    memo: context.Context, obj: Mapping[str, Any], reason: str, message: str, *, now: float
) -> None:
    """An Event on the DatasetMount `obj` for what a pod's admission skipped or chose (a
    Warning, or Normal for `admission.NORMAL_REASONS`): the pod does not exist yet, and
    its mount is what `kubectl describe` is read on.

    Through the API, not `kopf.event`: kopf's event queue is set only in its handlers'
    tasks, never the webhook's. One per mount and cause in a while (`event_gates`): the
    pods of one controller all meet the same cause, and the next Event counts the ones
    held back. Posted before answering, bounded so that a slow API server cannot stall
    the admission; a failure is logged, the admission warning says it all the same."""
    metadata = obj.get("metadata") or {}
    key = (
        str(metadata.get("namespace") or ""),
        str(metadata.get("name") or ""),
        str(metadata.get("uid") or ""),
        reason,
        message,
    )
    held = memo.events.admit(key, now=now)
    if held is None:
        logger.debug(
            "%s (Event held back: one was posted within %gs)", message, memo.events.interval_seconds
        )
        return
    message = event_gates.with_count(message, held)
    normal = reason in admission.NORMAL_REASONS
    logger.log(logging.INFO if normal else logging.WARNING, "%s", message)
    body = kube.event_body(
        obj,
        type="Normal" if normal else "Warning",
        reason=reason,
        message=message,
        now=handlers.now_text(),
    )
    try:
        await asyncio.wait_for(memo.api.post_event(body), EVENT_TIMEOUT_SECONDS)
    except Exception as exc:  # any API failure: the pod is admitted regardless
        logger.info("posting the %s Event: %s", reason, exc)


def namespace_refusal(namespace: str, exc: namespace_uids.Unavailable) -> str:
    """Why a pod is refused when its namespace's UID cannot be read."""
    return (
        f"the UID of namespace {namespace} could not be read: {exc}; the node disk tier is "
        "keyed by it (docs/security.md), so the pod is not injected without it: its "
        "controller retries, and the operator's log says why reading it fails"
    )


def _refused(
    pod: Mapping[str, Any], memo: context.Context, started: float, message: str
) -> admission.Decision:
    """A pod refused before its mounts were looked at, counted as every refusal (INFO:
    a failing watch or API is warned about where it fails, not once per pod)."""
    logger.info("%s", message)
    memo.metrics.admission_duration.observe(time.monotonic() - started)
    memo.metrics.admission_total.labels(result="refused").inc()
    return admission.Decision(False, dict(pod), [], message=message)


def _unserved(pod: Mapping[str, Any], memo: context.Context, started: float) -> admission.Decision:
    """A pod created in a namespace this operator does not serve, admitted as it came.

    Its webhook should not see such pods (the chart's namespaceSelector lists the
    watched namespaces), but one configured wider must not refuse them: this operator
    may not read DatasetMounts there, and another release may serve them (each
    release's webhook sees every opted-in pod its selector matches, in name order).
    """
    decision = admission.Decision(True, dict(pod), [])
    memo.metrics.admission_duration.observe(time.monotonic() - started)
    memo.metrics.admission_total.labels(result="unchanged").inc()
    return decision


def decide_update(
    old: Mapping[str, Any], new: Mapping[str, Any], memo: context.Context
) -> admission.Decision:
    """`admission.decide_update`, with metrics. No DatasetMount is read: most UPDATEs of
    opted-in pods are admitted at the first look at their init containers. Whatever the
    namespace: the guard reads nothing this operator may lack, and an injected sidecar
    is guarded by every release whose webhook sees it."""
    started = time.monotonic()
    decision = admission.decide_update(old, new)
    memo.metrics.admission_duration.observe(time.monotonic() - started)
    memo.metrics.admission_total.labels(result="unchanged" if decision.allowed else "refused").inc()
    return decision


async def inject(
    *,
    body: kopf.Body,
    patch: kopf.Patch,
    warnings: list[str],
    memo: context.Context,
    operation: str | None = None,
    old: kopf.Body | None = None,
    **kwargs: Any,
) -> None:
    """Inject the requested DatasetMounts into the pod, or refuse it with the reason;
    on an UPDATE, refuse one that reaches the injected sidecar (`pod_updates`).

    The kopf handler: registered so that kopf's managed mode writes the webhook
    configuration; `Server` answers its requests without going through kopf.
    """
    if operation == "UPDATE":
        update = decide_update(dict(old or {}), dict(body), memo)
        if not update.allowed:
            raise kopf.AdmissionError(update.message, code=403)
        return
    pod = dict(body)
    namespace = str((pod.get("metadata") or {}).get("namespace") or "default")
    decision = await decide(pod, namespace, memo)
    warnings.extend(decision.warnings)
    if not decision.allowed:
        raise kopf.AdmissionError(decision.message, code=403)
    # kopf turns the merged fields into a JSON patch against the admitted pod.
    for op in decision.patch:
        _, parent, key = op["path"].split("/")
        patch.setdefault(parent, {})[key] = op["value"]


async def answer(request: Mapping[str, Any], memo: context.Context) -> dict[str, Any]:
    """The AdmissionReview response to a pod's AdmissionReview request, straight from
    `admission`: our JSON patch as computed, no kopf handler machinery."""
    if admission.is_update(request):
        pod = admission.pod_of(request)
        decision = decide_update(admission.old_pod_of(request), pod, memo)
        return admission.respond(request, decision)
    pod = admission.pod_of(request)
    namespace = admission.namespace_of(request) or "default"
    decision = await decide(pod, namespace, memo)
    return admission.respond(request, decision)


class Server:
    """kopf's HTTPS webhook server, answering the pod webhook itself.

    Through kopf, each review cost a memo recall, body wrappers, a diff, handler
    bookkeeping and a JSON-patch diff of the whole pod (`kopf.Patch.as_json_patch`),
    about as much CPU as the injection itself; in a 1,000-pod burst the operator was
    CPU-bound there (issue 18). The decision is pure and computes its own JSON patch,
    so requests for `HANDLER_ID` are answered by `answer`; anything else (none today)
    still goes to kopf. kopf keeps the handler registered, so its managed mode writes
    the configuration as before.
    """

    def __init__(self, inner: kopf.WebhookServer, memo: context.Context) -> None:
        self._inner = inner
        self._memo = memo

    async def __call__(self, fn: Any) -> AsyncIterator[Any]:
        memo = self._memo

        async def serve(request: Any, *, webhook: str | None = None, **kwargs: Any) -> Any:
            if webhook in HANDLER_IDS:
                return await answer(request, memo)
            return await fn(request, webhook=webhook, **kwargs)

        async for config in self._inner(serve):
            # kopf's server yields its client config once its site listens: from here
            # on the operator may call itself ready (`app.run`).
            memo.webhook_listening.set()
            yield config


def register(registry: kopf.OperatorRegistry) -> None:
    """Wire the pod webhook onto `registry`; it reads the `context.Context` memo.

    Two handlers, because kopf selects one subresource per handler: pods themselves
    (CREATE injects, UPDATE guards the injected sidecar) and their ephemeral containers
    (`kubectl debug`, always an UPDATE). Both are `inject`.
    """
    wiring: tuple[tuple[str, str | None, list[kopf.Operation]], ...] = (
        (HANDLER_ID, None, ["CREATE", "UPDATE"]),
        (EPHEMERAL_HANDLER_ID, pod_updates.EPHEMERAL_SUBRESOURCE, ["UPDATE"]),
    )
    for handler, subresource, operations in wiring:
        kopf.on.mutate(
            "",
            "v1",
            "pods",
            id=handler,
            subresource=subresource,
            operations=operations,
            labels={injection.LABEL_MOUNT: kopf.PRESENT},
            side_effects=False,
            # Kept in a managed webhook configuration when the operator stops: labelled
            # pods then wait for it (failurePolicy Fail) instead of starting without
            # their data, and their sidecars stay as injected.
            persistent=True,
            registry=registry,
        )(inject)
