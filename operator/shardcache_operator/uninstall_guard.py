"""The chart's uninstall guard: `helm uninstall` refused while DatasetMounts exist.

`python3 -m shardcache_operator.uninstall_guard [--namespace NS ...]` (the chart's
`pre-delete` hook Job, `uninstallGuard`). Every DatasetMount carries the operator's
finalizer, and only a running operator removes it (docs/operator.md, "Deletion and the
finalizer"): uninstalled first, each mount would keep its namespace `Terminating` for
good. So the hook lists the DatasetMounts the release's operator serves (every
namespace, or its `operator.watchNamespaces`) and exits 1, naming them and what to do,
when there is any; helm then stops before deleting anything. `helm uninstall
--no-hooks` goes on regardless.

No DatasetMount CRD (deleted first, or never applied) means no mounts: exit 0. A list
the API refuses or cannot answer (after a few tries) refuses the uninstall too, saying
why: the guard cannot tell there is nothing to strand.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

from shardcache import errors
from shardcache_operator import specs

log = logging.getLogger(__name__)

#: Where the kubelet reads a container's termination message (`kubectl get pod -o yaml`
#: shows it under `lastState`/`state.terminated.message`).
TERMINATION_LOG = "/dev/termination-log"
#: Tries of a list that fails for another reason than a missing CRD, and the wait
#: between them: an API server restarting under the uninstall is not a refusal.
ATTEMPTS = 3
RETRY_SECONDS = 5.0
#: Mounts named one by one in the refusal; the rest are counted.
NAMED = 20


@dataclasses.dataclass(frozen=True)
class Held:
    """A DatasetMount that would be stranded, as the refusal shows it."""

    namespace: str
    name: str
    phase: str
    deleting: bool
    attached_pods: int | None

    @classmethod
    def of(cls, body: dict[str, Any]) -> Held:
        meta = body.get("metadata") or {}
        status = body.get("status") or {}
        attached = status.get("attachedPods")
        return cls(
            namespace=str(meta.get("namespace", "")),
            name=str(meta.get("name", "")),
            phase=str(status.get("phase") or "no phase yet"),
            deleting=bool(meta.get("deletionTimestamp")),
            attached_pods=attached if isinstance(attached, int) else None,
        )

    def describe(self) -> str:
        state = f"being deleted, {self.phase}" if self.deleting else self.phase
        if self.attached_pods:
            state += f", {self.attached_pods} attached pod" + "s" * (self.attached_pods != 1)
        return f"{self.namespace}/{self.name} ({state})"


@dataclasses.dataclass(frozen=True)
class Release:
    """The helm release being uninstalled (the chart passes it: `--release`,
    `--revision`, `--release-namespace`), for the way back that the refusal names."""

    name: str = "<release>"
    revision: str = "<revision>"
    namespace: str = "<namespace>"

    def keep(self) -> str:
        """helm marks a release whose pre-delete hook failed `uninstalling` though it
        removed nothing, and will not upgrade it from there (helm issue 9241): a
        rollback to the same revision makes it deployed again."""
        return (
            f"helm now lists the release as uninstalling, though nothing was removed; to "
            f"keep it instead: helm rollback {self.name} {self.revision} -n {self.namespace}"
        )


def refusal(held: Sequence[Held], scope: Sequence[str], release: Release = Release()) -> str | None:
    """Why the uninstall must not go on, or None when nothing would be stranded.
    `scope`: the namespaces listed (empty: every namespace)."""
    if not held:
        return None
    where = "" if not scope else f" in {', '.join(scope)}"
    lines = [
        f"helm uninstall refused: {len(held)} DatasetMount"
        + ("s" if len(held) != 1 else "")
        + f" still exist{'s' if len(held) == 1 else ''}{where}, and only the running operator "
        f"removes their finalizer ({specs.FINALIZER}): uninstalled first, each would keep "
        "its namespace Terminating for good.",
    ]
    ordered = sorted(held, key=lambda h: (h.namespace, h.name))
    lines += [f"  {h.describe()}" for h in ordered[:NAMED]]
    if len(ordered) > NAMED:
        lines.append(f"  ... and {len(ordered) - NAMED} more")
    lines += [
        "Delete them first (each waits for its pods to end; the annotation "
        f"{specs.ANNOTATION_FORCE_DELETE}=true does not wait), then run helm uninstall again:",
        *delete_commands(held, scope),
        "To uninstall anyway (the mounts' namespaces then cannot be deleted until the "
        "chart is installed again or the finalizers are removed by hand): "
        'helm uninstall --no-hooks. docs/operator.md, "Uninstalling".',
        release.keep() + ".",
    ]
    return "\n".join(lines)


def delete_commands(held: Sequence[Held], scope: Sequence[str]) -> list[str]:
    """The kubectl lines that delete the mounts the refusal names, and wait for them.
    A release that serves some namespaces gets one pair per namespace holding a mount:
    `--all -A` would also delete the mounts another release serves."""
    namespaces = sorted({h.namespace for h in held})
    targets = [f"-n {ns}" for ns in namespaces] if scope else ["-A"]
    lines = [f"  kubectl delete datasetmounts --all {t} --wait=false" for t in targets]
    lines += [f"  kubectl wait --for=delete datasetmounts --all {t} --timeout=10m" for t in targets]
    return lines


class ListFailed(errors.ShardcacheError):
    """The API did not say which DatasetMounts exist; the message says why. `lasting`:
    an answer another try would not change (refused, unauthorised, a bad request)."""

    def __init__(self, message: str, *, lasting: bool = False) -> None:
        super().__init__(message)
        self.lasting = lasting


#: One namespace's DatasetMounts ("" for every namespace) as API objects; raises
#: `LookupError` when the resource does not exist (no CRD), `ListFailed` otherwise.
Lister = Callable[[str], list[dict[str, Any]]]


def held_mounts(
    lister: Lister,
    scope: Sequence[str],
    *,
    attempts: int = ATTEMPTS,
    retry_seconds: float = RETRY_SECONDS,
    sleep: Callable[[float], None] = time.sleep,
) -> list[Held]:
    """Every DatasetMount in `scope` (empty: the cluster), with a few tries each."""
    held: list[Held] = []
    for namespace in scope or [""]:
        for attempt in range(1, attempts + 1):
            try:
                held += [Held.of(body) for body in lister(namespace)]
                break
            except LookupError:
                break  # no CRD: no DatasetMount anywhere
            except ListFailed as exc:
                if exc.lasting or attempt == attempts:
                    raise
                log.warning("uninstall guard: %s; trying again in %.0f s", exc, retry_seconds)
                sleep(retry_seconds)
    return held


def kubernetes_lister(kubeconfig: str | None) -> Lister:
    """DatasetMounts through the API, in pages (the operator's service account may list
    them where it serves)."""
    import kubernetes
    import urllib3

    from shardcache_operator import kube, paging

    client = kubernetes.client.CustomObjectsApi(kube.configure(kubeconfig))

    def listing(namespace: str) -> list[dict[str, Any]]:
        where = f"namespace {namespace}" if namespace else "every namespace"

        def page(token: str | None) -> tuple[list[dict[str, Any]], str | None]:
            kwargs: dict[str, Any] = {"limit": paging.PAGE_SIZE, "_request_timeout": 30}
            if token:
                kwargs["_continue"] = token
            try:
                if namespace:
                    found = client.list_namespaced_custom_object(
                        specs.GROUP, specs.VERSION, namespace, specs.PLURAL, **kwargs
                    )
                else:
                    found = client.list_cluster_custom_object(
                        specs.GROUP, specs.VERSION, specs.PLURAL, **kwargs
                    )
            except kubernetes.client.ApiException as exc:
                if exc.status == 404:
                    raise LookupError(f"{specs.PLURAL}.{specs.GROUP} is not served") from exc
                raise ListFailed(
                    f"listing DatasetMounts in {where} failed: HTTP {exc.status} "
                    f"{exc.reason}: {' '.join(str(exc.body or '').split())[:300]}",
                    # Server errors, throttling and time-outs may pass; the rest not.
                    lasting=exc.status is not None
                    and 400 <= exc.status < 500
                    and exc.status not in (408, 429),
                ) from exc
            except (OSError, ValueError, urllib3.exceptions.HTTPError) as exc:
                # Connection refused or reset, a time-out: urllib3's own errors.
                raise ListFailed(f"listing DatasetMounts in {where} failed: {exc}") from exc
            body = cast(dict[str, Any], found)
            return list(body.get("items") or []), (body.get("metadata") or {}).get("continue")

        return paging.every_item(page)

    return listing


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python3 -m shardcache_operator.uninstall_guard",
        description="Exit 1, naming them, while DatasetMounts exist (helm's pre-delete hook).",
    )
    parser.add_argument(
        "--namespace",
        action="append",
        dest="namespaces",
        default=[],
        help="list only this namespace (repeat; default: every namespace)",
    )
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster config)")
    parser.add_argument("--release", default=Release.name, help="the helm release's name")
    parser.add_argument("--revision", default=Release.revision, help="its current revision")
    parser.add_argument(
        "--release-namespace", default=Release.namespace, help="the release's namespace"
    )
    return parser.parse_args(argv)


def _say(text: str, termination_log: str) -> None:
    print(text, flush=True)
    try:
        with open(termination_log, "w", encoding="utf-8") as out:
            out.write(text[:4000])  # the kubelet keeps 4 KiB of it
    except OSError:
        pass  # not in a pod: stdout says it


def main(
    argv: Sequence[str] | None = None,
    *,
    termination_log: str = TERMINATION_LOG,
    connect: Callable[[str | None], Lister] = kubernetes_lister,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Exit status 0: nothing would be stranded; 1: the uninstall must stop (said on
    stdout and in the termination message)."""
    args = parse(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    scope: list[str] = list(dict.fromkeys(args.namespaces))
    release = Release(args.release, args.revision, args.release_namespace)
    try:
        held = held_mounts(connect(args.kubeconfig), scope, sleep=sleep)
    except (ListFailed, errors.InputError) as exc:
        _say(
            f"helm uninstall refused: the guard could not tell whether DatasetMounts exist "
            f"({exc}); uninstalled with mounts left, their namespaces could not be deleted. "
            "Run helm uninstall again once the API answers, or uninstall anyway with "
            f'helm uninstall --no-hooks (docs/operator.md, "Uninstalling"). {release.keep()}.',
            termination_log,
        )
        return 1
    text = refusal(held, scope, release)
    if text is None:
        where = ", ".join(scope) if scope else "any namespace"
        print(f"no DatasetMount in {where}: the uninstall goes on", flush=True)
        return 0
    _say(text, termination_log)
    return 1


if __name__ == "__main__":
    sys.exit(main())
