"""The operator never lends a tenant's source its own identity (issue 13, row 11).

Without `spec.source.secretRef`, an s3:// source is read anonymously, not with the
operator's ambient credentials; other object stores and file:// (the operator pod's own
files) are refused unless the platform allows them (chart values `policy.*`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from shardcache_operator import configuration, reconcile, sources

from shardcache import errors, source

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
