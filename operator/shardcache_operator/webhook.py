"""The mutating admission webhook for pods: a thin kopf handler around `admission.decide`.

The handler is a module-level function reading the API client, settings and metrics
from kopf's `memo` (a `context.Context`); `register` only wires it.

The webhook configuration selects pods by the opt-in label (objectSelector on
`shardcache.io/mount`), so unlabelled pods never reach the operator. TLS comes from
certificate files (the chart's Secret) or from `certs.generate` at start-up.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import kopf

from shardcache import errors
from shardcache_operator import admission, certs, configuration, context, injection, specs

logger = logging.getLogger(__name__)


def defaults_of(settings: configuration.Settings) -> injection.SidecarDefaults:
    return injection.SidecarDefaults(
        image=settings.sidecar_image,
        run_dir=settings.run_dir,
        run_as_user=settings.sidecar_uid,
        startup_timeout_seconds=settings.startup_timeout_seconds,
    )


#: Handler id; kopf serves it at the URL path /<id>, which a configuration must name.
HANDLER_ID = "shardcache-inject"


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

    The same shape kopf writes in managed mode (see docs/operator.md): pods only, CREATE
    only, objectSelector on the opt-in label, failurePolicy Fail, no side effects.
    """
    if (service is None) == (url is None):
        raise ValueError("give either service (with namespace) or url")
    client_config: dict[str, Any] = {"caBundle": ca_bundle}
    if url is not None:
        client_config["url"] = f"{url.rstrip('/')}/{HANDLER_ID}"
    else:
        client_config["service"] = {
            "name": service,
            "namespace": namespace,
            "path": f"/{HANDLER_ID}",
            "port": port,
        }
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [
            {
                # Webhook names need three dot-separated segments.
                "name": f"{HANDLER_ID}.{specs.GROUP}",
                "admissionReviewVersions": ["v1"],
                "clientConfig": client_config,
                "rules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "resources": ["pods"],
                        "operations": ["CREATE"],
                        "scope": "Namespaced",
                    }
                ],
                "objectSelector": {
                    "matchExpressions": [{"key": injection.LABEL_MOUNT, "operator": "Exists"}]
                },
                "failurePolicy": "Fail",
                "sideEffects": "None",
                "matchPolicy": "Equivalent",
                "reinvocationPolicy": "IfNeeded",
                "timeoutSeconds": 10,
            }
        ],
    }


def server(settings: configuration.Settings) -> kopf.WebhookServer:
    """kopf's HTTPS server with our certificates (never kopf's oscrypto self-signing)."""
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
    return kopf.WebhookServer(
        addr=settings.webhook_addr,
        port=settings.webhook_port,
        host=settings.webhook_host,
        certfile=cert_file,
        pkeyfile=key_file,
        cafile=ca_file,
    )


async def inject(
    *,
    body: kopf.Body,
    patch: kopf.Patch,
    warnings: list[str],
    memo: context.Context,
    **_: Any,
) -> None:
    """Inject the requested DatasetMounts into the pod, or refuse it with the reason."""
    started = time.monotonic()
    pod = dict(body)
    metadata: Mapping[str, Any] = pod.get("metadata") or {}
    namespace = str(metadata.get("namespace") or "default")
    # Read every requested DatasetMount first; the decision itself is pure.
    fetched: dict[str, Mapping[str, Any] | Exception | None] = {}
    try:
        wanted = injection.requested_mounts(metadata)
    except errors.InputError:
        wanted = []  # decide() refuses with the message
    for name in wanted:
        if name in injection.injected_mounts(pod):
            continue
        try:
            fetched[name] = await memo.api.read_datasetmount(namespace, name)
        except Exception as exc:  # the API failed: refuse this pod, keep serving
            fetched[name] = exc

    def lookup(_namespace: str, name: str) -> Mapping[str, Any] | None:
        found = fetched.get(name)
        if isinstance(found, Exception):
            raise admission.LookupFailed(str(found))
        return found

    decision = admission.decide(
        pod,
        namespace=namespace,
        lookup=lookup,
        defaults=defaults_of(memo.settings),
        missing_policy=memo.settings.missing_policy,
        policy=memo.settings.policy(),
    )
    memo.metrics.admission_duration.observe(time.monotonic() - started)
    warnings.extend(decision.warnings)
    if not decision.allowed:
        memo.metrics.admission_total.labels(result="refused").inc()
        raise kopf.AdmissionError(decision.message, code=403)
    if not decision.patch:
        memo.metrics.admission_total.labels(result="unchanged").inc()
        return
    memo.metrics.admission_total.labels(result="injected").inc()
    # kopf turns the merged fields into a JSON patch against the admitted pod.
    for op in decision.patch:
        _, parent, key = op["path"].split("/")
        patch.setdefault(parent, {})[key] = op["value"]


def register(registry: kopf.OperatorRegistry) -> None:
    """Wire the pod webhook onto `registry`; it reads the `context.Context` memo."""
    kopf.on.mutate(
        "",
        "v1",
        "pods",
        id=HANDLER_ID,
        operations=["CREATE"],
        labels={injection.LABEL_MOUNT: kopf.PRESENT},
        side_effects=False,
        # Kept in a managed webhook configuration when the operator stops: labelled pods
        # then wait for it (failurePolicy Fail) instead of starting without their data.
        persistent=True,
        registry=registry,
    )(inject)
