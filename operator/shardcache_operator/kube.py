"""Kubernetes API access of the operator (the `kubernetes` client, called in threads).

Works in a pod (in-cluster config) and as a local process with a kubeconfig, which is
how the e2e tests run the operator against a real API server.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ParamSpec, TypeVar, cast

import kopf
import kubernetes
import yaml

from shardcache import errors
from shardcache_operator import pod_watch, specs


class KubeconfigError(errors.InputError):
    """No API client configuration: a kubeconfig that is missing, unreadable or not a
    kubeconfig, or none at all outside a cluster. The message names the file."""


def configure(kubeconfig: str | None) -> kubernetes.client.ApiClient:
    """An API client; in-cluster config unless a kubeconfig is given or found.

    Raises `KubeconfigError` naming the kubeconfig when there is no usable config."""
    if kubeconfig:
        # kopf's login (login_via_client) calls load_kube_config() without a path, which
        # reads the library's default location: KUBECONFIG as it was at import time. Point
        # both at this file, or kopf would log in with ~/.kube/config (or not at all).
        _load_kubeconfig(kubeconfig, given=True)
        os.environ["KUBECONFIG"] = kubeconfig
        kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION = kubeconfig
    else:
        try:
            kubernetes.config.load_incluster_config()  # type: ignore[no-untyped-call]
        except kubernetes.config.ConfigException:
            _load_kubeconfig(
                kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION, given=False
            )
    return kubernetes.client.ApiClient()


def _load_kubeconfig(location: str, *, given: bool) -> None:
    """Load `location` (a path, or the library's default: paths joined by ':'), or
    raise `KubeconfigError`: the library says "No configuration found" for a missing
    file and raises TypeError for YAML that is not a mapping, naming no file."""
    where = f"kubeconfig {location or repr(location)}"
    if not given:
        where += (
            " (not in a cluster: the default from $KUBECONFIG or ~/.kube/config; or --kubeconfig)"
        )
    paths = [os.path.expanduser(p) for p in location.split(os.pathsep) if p]
    if not any(os.path.exists(path) for path in paths):
        raise KubeconfigError(f"{where}: expected a kubeconfig file, found no such file")
    try:
        kubernetes.config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=location if given else None
        )
    except OSError as exc:
        raise KubeconfigError(f"{where}: cannot be read: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        problem = " ".join(str(exc).split())
        raise KubeconfigError(
            f"{where}: expected a kubeconfig, found malformed YAML: {problem}"
        ) from exc
    except kubernetes.config.ConfigException as exc:
        raise KubeconfigError(f"{where}: {exc}") from exc
    except (TypeError, AttributeError, KeyError, ValueError) as exc:
        raise KubeconfigError(
            f"{where}: expected a kubeconfig (a mapping with clusters, users, contexts and "
            f"current-context), found a document the client cannot read ({exc})"
        ) from exc


def object_not_found(body: object, name: str) -> bool:
    """Whether a 404's body says the DatasetMount `name` does not exist, rather than its
    resource type: the API server answers a missing object with a Status whose details
    name it (reason NotFound, details.kind the plural), and a path of a resource type it
    does not serve (no CRD) with a plain "404 page not found"."""
    try:
        status = json.loads(body) if isinstance(body, str | bytes) else body
    except ValueError:
        return False
    if not isinstance(status, dict) or status.get("reason") != "NotFound":
        return False
    details = status.get("details")
    if not isinstance(details, dict):
        return False
    return details.get("kind") == specs.PLURAL and details.get("name") in (None, name)


def connection_info() -> kopf.ConnectionInfo:
    """kopf's credentials from the client configuration `configure` loaded.

    kopf's own `login_via_client` reloads the config from the default kubeconfig path,
    which the kubernetes library fixes at import time, so a --kubeconfig given later
    would be ignored; this reuses what was loaded instead.
    """
    config = kubernetes.client.Configuration.get_default_copy()
    header = config.get_api_key_with_prefix("BearerToken") or config.get_api_key_with_prefix(
        "authorization"
    )
    parts = header.split(" ", 1) if header else []
    scheme, token = (
        (None, None) if not parts else (None, parts[0]) if len(parts) == 1 else (parts[0], parts[1])
    )
    return kopf.ConnectionInfo(
        server=config.host,
        ca_path=config.ssl_ca_cert,
        insecure=not config.verify_ssl,
        username=config.username or None,
        password=config.password or None,
        scheme=scheme,
        token=token,
        certificate_path=config.cert_file,
        private_key_path=config.key_file,
    )


#: Seconds a single read waits for the API server before its thread gives up (the
#: caller may stop waiting sooner: `namespace_uids.READ_TIMEOUT_SECONDS`).
READ_TIMEOUT_SECONDS = 10

#: Where the chart grants the operator its ConfigMaps (the manifest handoff).
_MANIFEST_GRANT = "(the chart grants it in rbac.manifestNamespaces)"

_P = ParamSpec("_P")
_T = TypeVar("_T")


@contextlib.contextmanager
def _refused(action: str) -> Iterator[None]:
    """The API server's 403 as a PermissionError naming `action` ("get Secret ns/name",
    and where the chart grants it), chained from the ApiException; any other raised."""
    try:
        yield
    except kubernetes.client.ApiException as exc:
        if exc.status == 403:
            raise PermissionError(f"the operator's identity may not {action}") from exc
        raise


async def _found(
    action: str, call: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs
) -> _T | None:
    """`call` in a thread; None where the object does not exist (404), `_refused(action)`
    where the operator may not."""
    with _refused(action):
        try:
            return await asyncio.to_thread(call, *args, **kwargs)
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return None
            raise


class Api:
    """The few reads the operator needs, as coroutines."""

    def __init__(self, client: kubernetes.client.ApiClient) -> None:
        self._core = kubernetes.client.CoreV1Api(client)
        self._custom = kubernetes.client.CustomObjectsApi(client)

    async def read_secret(self, namespace: str, name: str) -> Mapping[str, str] | None:
        """The Secret's data decoded to text, or None when it does not exist."""
        # Least-privilege RBAC grants `get` on Secrets only where the chart says
        # (rbac.secretNamespaces): a status for the user, not a crash.
        secret = await _found(
            f"get Secret {namespace}/{name}", self._core.read_namespaced_secret, name, namespace
        )
        if secret is None:
            return None
        data: dict[str, str] = {}
        for key, value in (secret.data or {}).items():
            data[key] = base64.b64decode(value).decode("utf-8", errors="replace")
        for key, value in (secret.string_data or {}).items():
            data[key] = value
        return data

    async def read_namespace_uid(self, name: str) -> str | None:
        """The UID of the namespace `name`, or None when it does not exist."""
        # The chart grants get on namespaces (on the served ones when namespaced).
        namespace = await _found(
            f"get namespace {name} (the chart's ClusterRole grants it: rbac.create)",
            self._core.read_namespace,
            name,
            _request_timeout=READ_TIMEOUT_SECONDS,
        )
        if namespace is None:
            return None
        uid = namespace.metadata.uid if namespace.metadata else None
        return str(uid or "")

    async def read_datasetmount(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The DatasetMount object (spec and status), or None when it does not exist."""
        try:
            obj = await asyncio.to_thread(
                self._custom.get_namespaced_custom_object,
                specs.GROUP,
                specs.VERSION,
                namespace,
                specs.PLURAL,
                name,
            )
        except kubernetes.client.ApiException as exc:
            if exc.status == 404 and object_not_found(exc.body, name):
                return None
            # A 404 for the resource type (the CRD is not installed) is not a missing
            # mount: "create it" would be the wrong advice (`lookup_failures.explain`).
            raise
        return cast(dict[str, Any], obj)

    async def list_running_pods(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        """Running pods of `namespace` matching `label_selector`, as JSON dicts."""
        return await self._list_pods(namespace, label_selector, "status.phase=Running")

    async def list_unfinished_pods(
        self, namespace: str, label_selector: str
    ) -> list[dict[str, Any]]:
        """Pods of `namespace` matching `label_selector` not Succeeded or Failed (a pod
        whose sidecar cannot start stays Pending), as JSON dicts."""
        return await self._list_pods(namespace, label_selector, pod_watch.FIELD_SELECTOR)

    async def _list_pods(
        self, namespace: str, label_selector: str, field_selector: str
    ) -> list[dict[str, Any]]:
        # Raw JSON: the generated models would be converted back to dicts anyway.
        found: Any = await asyncio.to_thread(
            self._core.list_namespaced_pod,
            namespace,
            label_selector=label_selector,
            field_selector=field_selector,
            _preload_content=False,
        )
        try:
            body = json.loads(found.data)
        finally:
            found.release_conn()
        return list(body.get("items") or [])

    async def write_attached_pods(self, namespace: str, name: str, count: int) -> None:
        """Merge-patch status.attachedPods of a DatasetMount (its status subresource)."""
        await asyncio.to_thread(
            self._custom.patch_namespaced_custom_object_status,
            specs.GROUP,
            specs.VERSION,
            namespace,
            specs.PLURAL,
            name,
            {"status": {"attachedPods": count}},
        )

    async def read_config_map(self, namespace: str, name: str) -> dict[str, Any] | None:
        """ConfigMap `name`'s annotations and keys (not its values), as
        `{"metadata": {"annotations": ...}, "keys": [...]}`, or None when it does not
        exist. PermissionError where the operator may not get it."""
        found = await _found(
            f"get ConfigMap {namespace}/{name} {_MANIFEST_GRANT}",
            self._core.read_namespaced_config_map,
            name,
            namespace,
            _request_timeout=READ_TIMEOUT_SECONDS,
        )
        if found is None:
            return None
        annotations = dict((found.metadata.annotations if found.metadata else None) or {})
        keys = sorted({*(found.data or {}), *(found.binary_data or {})})
        return {"metadata": {"annotations": annotations}, "keys": keys}

    async def put_config_map(self, body: Mapping[str, Any]) -> None:
        """Create the ConfigMap `body`, or replace the one of its name. PermissionError
        where the operator may not (`rbac.manifestNamespaces`)."""
        metadata = body["metadata"]
        namespace, name = str(metadata["namespace"]), str(metadata["name"])
        # The client sends a dict as it is: no model round trip.
        config_map = cast(kubernetes.client.V1ConfigMap, dict(body))
        with _refused(f"write ConfigMap {namespace}/{name} {_MANIFEST_GRANT}"):
            try:
                await asyncio.to_thread(
                    self._core.create_namespaced_config_map, namespace, config_map
                )
            except kubernetes.client.ApiException as exc:
                if exc.status != 409:
                    raise
                await asyncio.to_thread(
                    self._core.replace_namespaced_config_map, name, namespace, config_map
                )

    async def delete_config_map(self, namespace: str, name: str) -> None:
        """Delete ConfigMap `name` if it exists. PermissionError where the operator may not."""
        await _found(
            f"delete ConfigMap {namespace}/{name} {_MANIFEST_GRANT}",
            self._core.delete_namespaced_config_map,
            name,
            namespace,
        )

    async def post_event(self, body: Mapping[str, Any]) -> None:
        """Create the core/v1 Event `body` (`event_body`) in its object's namespace."""
        namespace = str((body.get("metadata") or {}).get("namespace") or "")
        # The client sends a dict as it is: no model round trip for one JSON object.
        event = cast(kubernetes.client.CoreV1Event, dict(body))
        await asyncio.to_thread(self._core.create_namespaced_event, namespace, event)


#: Kubernetes refuses an Event message over 1 KiB.
EVENT_MESSAGE_LIMIT = 1024


def event_body(
    obj: Mapping[str, Any], *, type: str, reason: str, message: str, now: str
) -> dict[str, Any]:
    """A core/v1 Event about `obj` (a DatasetMount as the API serves it), as kopf posts
    its own: for what happens outside kopf's handlers (the webhook), where kopf's event
    queue does not reach. `now` is an RFC 3339 time."""
    metadata = obj.get("metadata") or {}
    namespace = str(metadata.get("namespace") or "")
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"namespace": namespace, "generateName": "shardcache-"},
        "involvedObject": {
            "apiVersion": obj.get("apiVersion"),
            "kind": obj.get("kind"),
            "name": metadata.get("name"),
            "namespace": namespace,
            "uid": metadata.get("uid"),
        },
        "type": type,
        "reason": reason,
        "message": message[:EVENT_MESSAGE_LIMIT],
        "source": {"component": "shardcache-operator"},
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
