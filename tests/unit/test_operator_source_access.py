"""The operator never lends a tenant's source its own identity (issue 13, row 11).

Without `spec.source.secretRef`, an s3:// source is read anonymously, not with the
operator's ambient credentials; other object stores and file:// (the operator pod's own
files) are refused unless the platform allows them (chart values `policy.*`).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
from shardcache_operator import configuration, endpoint_policy, reconcile, sources

from shardcache import errors, manifests, source

pytestmark = pytest.mark.unit

AMBIENT = {"AWS_ACCESS_KEY_ID": "AKIAOPERATOR", "AWS_SECRET_ACCESS_KEY": "operator-secret"}


class Recorded(Exception):
    pass


@pytest.fixture
def s3_arguments(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The arguments the S3 client is built with (building it stops the call there)."""
    seen: dict[str, Any] = {}

    def record(**kwargs: Any) -> None:
        seen.update(kwargs)
        raise Recorded

    monkeypatch.setattr(source.pafs, "S3FileSystem", record)
    for name, value in AMBIENT.items():
        monkeypatch.setenv(name, value)
    return seen


@pytest.mark.parametrize("call", ["resolve", "probe"])
def test_without_a_secret_s3_is_read_anonymously_not_with_the_operators_credentials(
    s3_arguments: dict[str, Any], call: str
) -> None:
    with pytest.raises(Recorded):
        if call == "resolve":
            sources.resolve_manifest("s3://bucket/train/", "parquet", None)
        else:
            sources.probe_source("s3://bucket/train/", None)
    assert s3_arguments["anonymous"] is True
    assert "access_key" not in s3_arguments


def test_a_secret_still_supplies_the_credentials(s3_arguments: dict[str, Any]) -> None:
    secret = {"AWS_ACCESS_KEY_ID": "AKIATENANT", "AWS_SECRET_ACCESS_KEY": "tenant"}
    with pytest.raises(Recorded):
        sources.resolve_manifest("s3://bucket/train/", "parquet", secret)
    assert s3_arguments["access_key"] == "AKIATENANT"


def test_ambient_credentials_only_when_the_platform_allows_them(
    s3_arguments: dict[str, Any],
) -> None:
    with pytest.raises(Recorded):
        sources.resolve_manifest(
            "s3://bucket/train/", "parquet", None, access=sources.Access(ambient_credentials=True)
        )
    assert s3_arguments["access_key"] == "AKIAOPERATOR"


@pytest.mark.parametrize("uri", ["gs://bucket/x/", "hdfs://namenode/x", "abfs://c@acct/x"])
def test_other_object_stores_are_refused_without_ambient_access(uri: str) -> None:
    with pytest.raises(errors.InputError, match="operator's own cloud identity"):
        sources.resolve_manifest(uri, "parquet", {"AWS_ACCESS_KEY_ID": "x"})


def test_file_sources_are_refused_and_nothing_of_the_operator_is_listed(tmp_path: Path) -> None:
    (tmp_path / "operator-only.txt").write_text("x")
    with pytest.raises(errors.InputError) as caught:
        sources.resolve_manifest(tmp_path.as_uri(), "parquet", None)
    assert "operator-only" not in str(caught.value)
    assert "policy.allowFileSources" in str(caught.value)
    with pytest.raises(errors.InputError):
        sources.probe_source("file:///etc/", None)


@pytest.mark.parametrize(
    "uri", ["file:///etc/", "gs://bucket/x/", "s3:///no-bucket", "ftp://host/x", "s3://b/x?v=1"]
)
def test_what_the_operator_refuses_to_read_is_told_apart_from_what_the_store_says(
    uri: str,
) -> None:
    """A refusal before any request is the spec's to fix (Invalid, never retried); the
    reconcile retries every other InputError (`reconcile.SourceRefused`)."""
    with pytest.raises(reconcile.SourceRefused):
        sources.resolve_manifest(uri, "parquet", None)
    with pytest.raises(reconcile.SourceRefused):
        sources.probe_source(uri, None)


def test_file_sources_resolve_when_allowed(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"x": [1, 2, 3]}), tmp_path / "a.parquet")
    manifest = sources.resolve_manifest(
        tmp_path.as_uri(), "parquet", None, access=sources.Access(file_sources=True)
    )
    assert manifest.total_rows == 3


def test_operator_settings_default_to_no_ambient_access() -> None:
    settings = configuration.from_env({})
    assert (settings.allow_file_sources, settings.allow_ambient_credentials) == (False, False)
    allowed = configuration.from_env(
        {
            "SHARDCACHE_OPERATOR_ALLOW_FILE_SOURCES": "true",
            "SHARDCACHE_OPERATOR_ALLOW_AMBIENT_CREDENTIALS": "true",
        }
    )
    assert (allowed.allow_file_sources, allowed.allow_ambient_credentials) == (True, True)


def _mount(uri: str, *, pinned: bool) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "shardcache.io/v1alpha1",
        "kind": "DatasetMount",
        "metadata": {"name": "data", "namespace": "ml", "generation": 1},
        "spec": {"source": {"uri": uri, "secretRef": {"name": "s3-creds"}}},
    }
    if pinned:
        obj["status"] = {
            "manifestDigest": "sha256:" + "0" * 64,
            # This release's manifest version: the pin is kept and probed, not resolved again.
            "resolvedSource": {
                "uri": uri,
                "format": "parquet",
                "manifestVersion": str(manifests.MANIFEST_VERSION),
            },
        }
    return obj


@pytest.mark.parametrize("pinned", [False, True])
@pytest.mark.parametrize(
    ("endpoint", "policy"),
    [
        ("http://169.254.169.254/latest/meta-data/", ()),  # the default
        ("https://elsewhere.example:9000", ("https://minio.storage.svc:9000",)),
    ],
)
async def test_a_secrets_endpoint_the_platform_refuses_is_not_allowed_and_retried_slowly(
    endpoint: str, policy: tuple[str, ...], pinned: bool
) -> None:
    """Before a pin (resolve: Pending) and after one (the reachability probe: Degraded,
    the pin kept): the reconcile says which endpoint and which chart value, and tries
    again at the backoff's cap, since the Secret can be fixed without a spec change."""
    access = sources.Access(
        source_endpoints=tuple(endpoint_policy.entry(entry) for entry in policy)
    )
    secret = {
        "AWS_ACCESS_KEY_ID": "AKIATENANT",
        "AWS_SECRET_ACCESS_KEY": "tenant",
        "AWS_ENDPOINT_URL": endpoint,
    }

    async def read_secret(namespace: str, name: str) -> dict[str, str]:
        return secret

    result = await reconcile.reconcile(
        _mount("s3://bucket/train/", pinned=pinned),
        read_secret=read_secret,
        resolve=functools.partial(sources.resolve_manifest, access=access),
        probe=functools.partial(sources.probe_source, access=access),
        now="2026-01-01T00:00:00Z",
    )
    assert result.status["phase"] == ("Degraded" if pinned else "Pending")
    ready = {c["type"]: c for c in result.status["conditions"]}["Ready"]
    assert ready["reason"] == "EndpointNotAllowed"
    assert str(endpoint_policy.endpoint(endpoint)) in ready["message"]
    assert "policy.sourceEndpoints" in ready["message"]
    assert result.retry_in == reconcile.Backoff().max_seconds
    assert result.status.get("manifestDigest") == ("sha256:" + "0" * 64 if pinned else None)


def test_applied_skips_are_read_with_the_sources_access_not_the_operators(
    tmp_path: Path, s3_arguments: dict[str, Any]
) -> None:
    """The checkpoint store is the tenant's choice as much as the source."""
    with pytest.raises(reconcile.SourceRefused, match=r"policy\.allowFileSources"):
        sources.applied_skips(tmp_path.as_uri(), None, access=sources.Access())
    with pytest.raises(Recorded):
        sources.applied_skips("s3://bucket/ckpt/", None, access=sources.Access())
    assert s3_arguments["anonymous"] is True
    assert (
        sources.applied_skips(
            (tmp_path / "none").as_uri(), None, access=sources.Access(file_sources=True)
        )
        == []
    )
