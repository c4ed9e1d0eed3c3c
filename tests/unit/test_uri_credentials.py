"""Credentials inside a URI are refused everywhere a URI is read, and never echoed.

Issue 13, row 7: `s3://KEY:SECRET@bucket/...` was accepted, copied into pod env and
shown on /readyz. Every refusal below names where the URI came from, never the secret.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import celpy
import pytest
from shardcache_operator import specs
from shardcache_sidecar import configuration

import shardcache
from shardcache import errors, source, uris
from shardcache.contract import variables
from tests.unit.test_injection import admit, dsm, pod

pytestmark = pytest.mark.unit

SECRET = "wJalrXUtnFEMIK7MDENG"
HOSTILE = [
    f"s3://AKIAEXAMPLE:{SECRET}@bucket/train/",
    f"s3://{SECRET}@bucket/train/",
    f"gs://user:{SECRET}@bucket/x",
    f"file://user:{SECRET}@/data",
    f"abfss://container:{SECRET}@account/x",
]


@pytest.mark.parametrize("uri", HOSTILE)
def test_redact_hides_user_info_and_keeps_the_rest(uri: str) -> None:
    shown = uris.redact(uri)
    assert SECRET not in shown
    assert "***@" in shown
    assert uris.has_userinfo(uri)


@pytest.mark.parametrize(
    "uri",
    [
        "s3://bucket/a@b/c.parquet",
        "file:///data/x@y",
        "s3://bucket",
        "/plain/path",
        "abfs://container@account.dfs.core.windows.net/x",
    ],
)
def test_an_at_sign_in_the_path_is_not_user_info(uri: str) -> None:
    assert not uris.has_userinfo(uri)
    assert uris.redact(uri) == uri


def test_query_strings_are_not_shown() -> None:
    assert uris.redact(f"s3://bucket/x?X-Amz-Signature={SECRET}") == "s3://bucket/x"


@pytest.mark.parametrize("uri", HOSTILE)
def test_spec_parser_refuses_credentials_without_echoing_them(uri: str) -> None:
    with pytest.raises(errors.InputError) as caught:
        specs.parse_spec({"source": {"uri": uri}})
    assert "secretRef" in str(caught.value)
    assert SECRET not in str(caught.value)
    with pytest.raises(errors.InputError) as caught:
        specs.parse_spec({"source": {"uri": "s3://b/x"}, "checkpoint": {"uri": uri}})
    assert SECRET not in str(caught.value)


@pytest.mark.parametrize("uri", HOSTILE)
def test_crd_rule_refuses_what_the_parser_refuses(uri: str) -> None:
    (rule,) = specs.SourceSpec.rules
    env = celpy.Environment()
    program = env.program(env.compile(rule.cel))
    for value, allowed in (
        (uri, False),
        ("s3://bucket/a@b/", True),
        ("abfs://container@account/x", True),
    ):
        assert bool(program.evaluate({"self": celpy.json_to_cel({"uri": value})})) is allowed


@pytest.mark.parametrize("uri", HOSTILE)
def test_contract_variable_refuses_credentials_without_echoing_them(uri: str) -> None:
    for variable in (variables.SOURCE_URI, variables.CHECKPOINT_URI):
        with pytest.raises(errors.InputError) as caught:
            variable.read({variable.env: uri})
        assert variable.env in str(caught.value)
        assert SECRET not in str(caught.value)


@pytest.mark.parametrize("uri", HOSTILE)
def test_source_and_open_refuse_credentials(uri: str, tmp_path: Path) -> None:
    with pytest.raises(errors.InputError) as caught:
        source.filesystem(uri)
    assert SECRET not in str(caught.value)
    with pytest.raises(errors.InputError) as caught:
        shardcache.open(uri, cache_dir=tmp_path)
    assert SECRET not in str(caught.value)


def test_sidecar_settings_refuse_credentials(tmp_path: Path) -> None:
    with pytest.raises(errors.InputError) as caught:
        configuration.Settings(
            source_uri=HOSTILE[0],
            socket_path=tmp_path / "s.sock",
            memory_dir=tmp_path / "mem",
            disk_dir=tmp_path / "disk",
        )
    assert SECRET not in str(caught.value)


def test_admission_refuses_a_mount_with_credentials_and_copies_nothing() -> None:
    # A DatasetMount stored before the CRD rule existed: admission is the last gate.
    mount: dict[str, Any] = dsm("imagenet")
    mount["spec"]["source"]["uri"] = HOSTILE[0]
    response, stored = admit(pod(), mount)
    assert response["allowed"] is False
    assert SECRET not in str(response)
    assert SECRET not in str(stored)
