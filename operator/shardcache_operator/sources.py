"""The source I/O the reconcile core is given: manifest resolution and a cheap probe.

Both block (pyarrow filesystems); the core runs them in threads with a timeout. The
operator itself resolves through `resolve_children`, which runs `resolve_manifest`'s
work in a child process it bounds and kills; the probe stays here, in-process.

The operator reads sources that tenants name, so it never lends them its own identity
(`Access`, docs/security.md): an s3:// source without `spec.source.secretRef` is read
anonymously, never with the operator's ambient credentials (environment, instance
metadata, a projected service account token); other object stores, whose clients
would use the operator's cloud identity, and file:// (the operator's own filesystem)
are refused, unless the platform allows them in the chart's values. An endpoint a
tenant's Secret or URI names is connected to only if the platform's list allows it
(`endpoint_policy`): never the operator pod's loopback or the cloud metadata service.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import pyarrow.fs as pafs

from shardcache import errors, manifests, source, uris
from shardcache_operator import configuration, endpoint_policy, reconcile, skips


@dataclasses.dataclass(frozen=True)
class Access:
    """What the operator may use to read a tenant's source (chart values `policy.*`)."""

    #: Resolve file:// URIs. Off: they name the operator pod's own files, which a
    #: tenant must not list; on for single-tenant and local clusters.
    file_sources: bool = False
    #: Use the operator's ambient credentials for sources without a secretRef, and
    #: read object stores other than s3:// (their clients use the operator's identity).
    ambient_credentials: bool = False
    #: Endpoints the operator may connect to for a source (policy.sourceEndpoints): a
    #: Secret's AWS_ENDPOINT_URL, AWS S3 itself, a URI's host; empty: any but loopback,
    #: link-local and metadata addresses (`endpoint_policy`).
    source_endpoints: tuple[endpoint_policy.Origin, ...] = ()


def access(settings: configuration.Settings) -> Access:
    """The access the platform's settings (chart values `policy.*`) allow."""
    return Access(
        file_sources=settings.allow_file_sources,
        ambient_credentials=settings.allow_ambient_credentials,
        source_endpoints=settings.source_endpoints,
    )


#: How long the operator retries a source that fails transiently before it reports it
#: (`SourceUnreachable`): rides out a store restarting (a pinned mount stays Ready, and
#: its pods admitted, through a blip) and stays inside the resolve timeout; longer
#: outages are retried by the reconcile's backoff, saying so in status meanwhile.
RETRY = source.RetryPolicy(budget_seconds=30.0)


def storage_options(
    uri: str, options: Mapping[str, str] | None, access: Access
) -> Mapping[str, str] | None:
    """The storage options the operator reads `uri` with, or `reconcile.SourceRefused`
    saying why the operator does not read it at all (the URI, or the platform's policy)."""
    try:
        scheme, _ = source.checked_uri(uri)
    except errors.InputError as exc:
        raise reconcile.SourceRefused(str(exc)) from exc
    if scheme == "file":
        if not access.file_sources:
            raise reconcile.SourceRefused(
                "file:// sources are not resolved by the operator: the path would be read "
                "on the operator's own filesystem, not where your pods run; use an object "
                "store URI (a platform can allow file:// with the chart value "
                "policy.allowFileSources on a single-tenant cluster)"
            )
        return options
    if scheme != "s3":
        if not access.ambient_credentials:
            raise reconcile.SourceRefused(
                f"{scheme}:// sources are not resolved by the operator: its client would use "
                "the operator's own cloud identity; use s3:// (with spec.source.secretRef, or "
                "a public bucket read anonymously), or ask the platform for the chart value "
                "policy.allowAmbientCredentials"
            )
        # Before any connection: the URI itself names the host (and, in its query, may
        # redirect the client) that gets the operator's own cloud identity.
        _refuse(endpoint_policy.uri_refusal(uri, access.source_endpoints))
        return options
    if options is not None:
        # Before any connection: where the Secret points the operator's own pod.
        _refuse(endpoint_policy.refusal(options, access.source_endpoints))
        return options
    if access.ambient_credentials:
        # The S3 client reads the operator's environment: the platform's own settings,
        # held to its list only (with none, it trusts them).
        if access.source_endpoints:
            _refuse(
                endpoint_policy.refusal(
                    os.environ, access.source_endpoints, whence=endpoint_policy.ENVIRONMENT
                )
            )
        return None
    # No Secret: anonymous (`source.filesystem` reads an empty mapping as "no credentials"),
    # never the operator's environment; to AWS S3 itself, which a set list must allow.
    _refuse(endpoint_policy.refusal({}, access.source_endpoints, whence=endpoint_policy.NO_SECRET))
    return {}


def _refuse(refused: str | None) -> None:
    if refused is not None:
        raise reconcile.EndpointRefused(refused)


def resolve_manifest(
    uri: str,
    fmt: str,
    storage_options_: Mapping[str, str] | None,
    *,
    access: Access | None = None,
    retry: source.RetryPolicy = RETRY,
) -> reconcile.ManifestLike:
    options = storage_options(uri, storage_options_, access or Access())
    return manifests.resolve(uri, format=fmt, storage_options=options, retry=retry)


def applied_skips(
    uri: str, storage_options_: Mapping[str, str] | None, *, access: Access
) -> list[dict[str, Any]]:
    """The skips the sidecars applied under checkpoint `uri` (`skips.read_applied`), read
    with the same access as the source: the checkpoint store is the tenant's choice too."""
    return skips.read_applied(uri, storage_options(uri, storage_options_, access))


def probe_source(
    uri: str,
    storage_options_: Mapping[str, str] | None,
    *,
    access: Access | None = None,
    retry: source.RetryPolicy = RETRY,
    shard: reconcile.PinnedShard | None = None,
) -> None:
    """Is the pinned `shard` (path in the manifest, size) still there at its size? One
    metadata request. Without one (a pin that recorded none): does the dataset's root
    still exist, non-empty? One metadata request, and for a "directory" a listing of
    its first level."""
    options = storage_options(uri, storage_options_, access or Access())
    probe(uri, options, retry=retry, shard=shard)


def probe(
    uri: str,
    options: Mapping[str, str] | None,
    *,
    retry: source.RetryPolicy = RETRY,
    shard: reconcile.PinnedShard | None = None,
) -> None:
    """`probe_source`'s reads, with the options the policy gave (`storage_options`): what
    a `read_worker` runs. The root's listing is of its first level, whole: a root that
    holds millions of keys costs as much memory, which is why the operator runs it in a
    worker process with a memory limit of its own (`read_workers`); a pinned shard's
    check is one request whatever the root holds."""
    fs, root = source.filesystem(uri, storage_options=options)
    if shard is not None:
        _probe_shard(fs, root, uri, shard, retry)
        return

    def present() -> bool:
        info = fs.get_file_info(root)
        if info.type == pafs.FileType.File:
            return True
        if info.type == pafs.FileType.NotFound:
            return False
        # Object stores may keep an empty "directory" marker after the data is gone.
        selector = pafs.FileSelector(root, recursive=False, allow_not_found=True)
        return bool(fs.get_file_info(selector))

    if not source.with_retries(present, what=f"checking {uris.redact(uri)}", policy=retry):
        raise errors.InputError(
            f"nothing found at {uris.redact(uri)!r} any more: the pinned data is gone"
        )


def _probe_shard(
    fs: pafs.FileSystem,
    root: str,
    uri: str,
    shard: reconcile.PinnedShard,
    retry: source.RetryPolicy,
) -> None:
    """InputError unless the pinned shard `shard` (its path relative to `root`, "" for a
    one-file dataset, and its size) is a file of that size."""
    name, size = shard
    path = f"{root.rstrip('/')}/{name}" if name else root
    shown = uris.redact(uri)
    info = source.with_retries(
        lambda: fs.get_file_info(path), what=f"checking {shown}", policy=retry
    )
    if info.type != pafs.FileType.File:
        raise errors.InputError(
            f"the pinned shard {name or path!r} of {shown!r} is not there any more: the "
            "pinned data is gone"
        )
    if info.size != size:
        raise errors.InputError(
            f"the pinned shard {name or path!r} of {shown!r} is {info.size} bytes, not the "
            f"{size} it was pinned at: the pinned data changed"
        )
