"""Why the webhook could not read a pod's DatasetMount, as one sentence for the pod's
owner: what the operator tried, what the API server answered, what to do.

The refusal reaches `kubectl` and the controllers' Events; the API client's own text
(HTTP headers, audit ids, the raw Status JSON) does not belong there.
"""

from __future__ import annotations

from shardcache_operator import served_namespaces

#: How much of an error without an HTTP status (a connection failure) is quoted.
QUOTE_CHARACTERS = 200

_RETRY = "retry in a moment, and check the API server if it persists"


def explain(exc: BaseException, *, namespace: str, served: tuple[str, ...]) -> str:
    """The sentence after "DatasetMount <ns>/<name> could not be read: ".

    `exc` is what the read raised: a kubernetes ApiException (its `status` and `reason`)
    or anything else (no answer from the API server). `served` is the operator's
    namespaces (empty: all), which decides where its read permission comes from.
    """
    status = getattr(exc, "status", None)
    if not isinstance(status, int) or status == 0:
        quoted = (str(exc).splitlines() or [""])[0][:QUOTE_CHARACTERS]
        detail = f"{type(exc).__name__}: {quoted}" if quoted else type(exc).__name__
        return f"the operator got no answer from the API server ({detail}); {_RETRY}"
    reason = getattr(exc, "reason", None)
    answered = f"the API server answered {status}" + (f" {reason}" if reason else "")
    if status == 403:
        if served:
            grant = (
                f"the release's Role in {namespace} grants it (the chart creates one for "
                "each namespace in operator.watchNamespaces, which is "
                f"{served_namespaces.describe(served)})"
            )
        else:
            grant = "the release's ClusterRole grants it"
        return (
            f"the operator may not get DatasetMounts in namespace {namespace} ({answered}): "
            f"{grant}; check that it and its binding to the operator's ServiceAccount exist "
            "(`helm upgrade` restores them)"
        )
    if status == 401:
        return (
            f"the API server did not accept the operator's credentials ({answered}): its "
            "ServiceAccount token may have expired or been revoked; restart the operator "
            "(`kubectl rollout restart deployment` of the release)"
        )
    if status == 404:
        # A missing DatasetMount is no failure (`kube.read_datasetmount` returns None);
        # a 404 that gets here is for the resource type itself.
        return (
            f"the DatasetMount CRD is not installed ({answered} for the resource type "
            "datasetmounts.shardcache.io): kubectl apply -f <chart>/crds/ (helm installs "
            'them on first install only; docs/operator.md, "Upgrading")'
        )
    return f"{answered}; {_RETRY}"
