"""S3 settings no request could get past are refused before one is made, naming the
variable and never its value: in a Secret (the operator), a sidecar's environment, and
the storage options or environment of `shardcache.source`."""

from __future__ import annotations

from typing import Any

import pytest

from shardcache import errors, s3_settings, source

pytestmark = pytest.mark.unit

KEYS = {"AWS_ACCESS_KEY_ID": "AKIAVALUE", "AWS_SECRET_ACCESS_KEY": "secret-value"}
VALUES = ("AKIAVALUE", "secret-value", "USERPART", "PASSPART")


def problem(env: dict[str, str], *, pair: bool = True) -> str | None:
    return s3_settings.problem(env, origin="Secret ml/creds", pair=pair)


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"AWS_ACCESS_KEY_ID": "AKIAVALUE"}, "AWS_SECRET_ACCESS_KEY is missing"),
        ({"AWS_SECRET_ACCESS_KEY": "secret-value"}, "AWS_ACCESS_KEY_ID is missing"),
        ({**KEYS, "AWS_SECRET_ACCESS_KEY": ""}, "AWS_SECRET_ACCESS_KEY is missing"),
        ({**KEYS, "AWS_ACCESS_KEY_ID": "AKIAVALUE\n"}, "AWS_ACCESS_KEY_ID begins or ends with a newline"),
        ({**KEYS, "AWS_SECRET_ACCESS_KEY": "secret-value\r\n"}, "AWS_SECRET_ACCESS_KEY begins or ends with a newline"),
        ({**KEYS, "AWS_SECRET_ACCESS_KEY": " secret-value"}, "AWS_SECRET_ACCESS_KEY begins or ends with whitespace"),
        ({**KEYS, "AWS_ENDPOINT_URL": "http://minio:9000\n"}, "AWS_ENDPOINT_URL begins or ends with a newline"),
        ({**KEYS, "AWS_ENDPOINT_URL": "http://USERPART:PASSPART@minio:9000"}, "AWS_ENDPOINT_URL has a user name or password"),
        ({**KEYS, "AWS_ENDPOINT_URL_S3": "USERPART:PASSPART@minio:9000"}, "AWS_ENDPOINT_URL_S3 has a user name or password"),
    ],
)  # fmt: skip
def test_a_secret_that_can_only_fail_is_named_by_origin_and_variable_never_value(
    env: dict[str, str], named: str
) -> None:
    found = problem(env)
    assert found is not None
    assert found.startswith("Secret ml/creds: ") and named in found
    assert not any(value in found for value in VALUES), found


@pytest.mark.parametrize(
    "env",
    [
        KEYS,
        {**KEYS, "AWS_SESSION_TOKEN": "t", "AWS_ENDPOINT_URL": "http://minio:9000"},
        {"AWS_ENDPOINT_URL": "minio:9000", "AWS_REGION": "eu-west-1"},  # anonymous
        {},
    ],
)
def test_usable_settings_pass(env: dict[str, str]) -> None:
    assert problem(env) is None


def test_a_process_environment_may_hold_a_secret_key_without_an_id_for_its_profile() -> None:
    assert problem({"AWS_SECRET_ACCESS_KEY": "secret-value"}, pair=False) is None
    assert problem({"AWS_ACCESS_KEY_ID": "AKIAVALUE"}, pair=False) is not None


@pytest.fixture
def s3_arguments(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def record(**kwargs: Any) -> None:
        seen.update(kwargs)

    monkeypatch.setattr(source.pafs, "S3FileSystem", record)
    return seen


def test_the_client_refuses_an_endpoint_with_a_password_without_echoing_it(
    s3_arguments: dict[str, Any],
) -> None:
    options = {**KEYS, "AWS_ENDPOINT_URL": "http://USERPART:PASSPART@minio:9000"}
    with pytest.raises(errors.InputError) as info:
        source.filesystem("s3://bucket/data/", storage_options=options)
    assert "AWS_ENDPOINT_URL" in str(info.value)
    assert "USERPART" not in str(info.value) and "PASSPART" not in str(info.value)
    assert s3_arguments == {}, "a client was built with the endpoint's user info"


def test_the_client_refuses_storage_options_with_half_a_key_pair_instead_of_reading_anonymously(
    s3_arguments: dict[str, Any],
) -> None:
    with pytest.raises(errors.InputError, match="AWS_ACCESS_KEY_ID is missing"):
        source.filesystem("s3://bucket/data/", storage_options={"AWS_SECRET_ACCESS_KEY": "x"})
    assert s3_arguments == {}


def test_the_client_gets_the_key_pair_and_the_endpoints_host(
    s3_arguments: dict[str, Any],
) -> None:
    source.filesystem(
        "s3://bucket/data/", storage_options={**KEYS, "AWS_ENDPOINT_URL": "http://minio:9000"}
    )
    assert s3_arguments["access_key"] == "AKIAVALUE"
    assert s3_arguments["secret_key"] == "secret-value"
    assert (s3_arguments["scheme"], s3_arguments["endpoint_override"]) == ("http", "minio:9000")
