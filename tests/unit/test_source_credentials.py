"""Credentials read again from the Secret's files when the store refuses those in use
(`shardcache.source_credentials`): which values count, when a new filesystem is made,
and that a refusal stands while the files hold nothing new."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import pytest

from shardcache import contract, source_credentials

pytestmark = pytest.mark.unit

URI = "s3://bucket/tokens/"
ENV = {
    contract.ENV_S3_ENDPOINT: "http://127.0.0.1:9",
    contract.ENV_S3_REGION: "us-east-1",
    contract.ENV_S3_ACCESS_KEY_ID: "AKIAOLD",
    contract.ENV_S3_SECRET_ACCESS_KEY: "old-secret",
    contract.ENV_S3_SESSION_TOKEN: "old-token",
}


def write(directory: Path, **values: str) -> None:
    directory.mkdir(exist_ok=True)
    for name in source_credentials.KEYS:
        (directory / name).unlink(missing_ok=True)
    for name, value in values.items():
        (directory / name).write_text(value)


def test_a_missing_directory_leaves_the_environment_as_it_is(tmp_path: Path) -> None:
    assert source_credentials.read(tmp_path / "none") == {}
    assert source_credentials.read(None) == {}
    renewal = source_credentials.Renewable(URI, tmp_path / "none", environ=ENV)
    assert renewal.storage_options() is None
    assert renewal.renewed(renewal.fs) is None


def test_the_files_credentials_replace_all_of_the_environments_together(tmp_path: Path) -> None:
    write(tmp_path, AWS_ACCESS_KEY_ID="AKIANEW", AWS_SECRET_ACCESS_KEY="new-secret")
    found = source_credentials.read(tmp_path)
    options = source_credentials.options(found, ENV)
    assert options is not None
    assert options[contract.ENV_S3_ACCESS_KEY_ID] == "AKIANEW"
    assert options[contract.ENV_S3_SECRET_ACCESS_KEY] == "new-secret"
    # The old session token would only have the new pair refused.
    assert contract.ENV_S3_SESSION_TOKEN not in options
    # The endpoint and region stay the environment's (the operator's policy judged them).
    assert options[contract.ENV_S3_ENDPOINT] == ENV[contract.ENV_S3_ENDPOINT]


def test_a_refusal_stands_while_the_files_hold_what_is_in_use(tmp_path: Path) -> None:
    write(tmp_path, AWS_ACCESS_KEY_ID="AKIAOLD", AWS_SECRET_ACCESS_KEY="old-secret")
    renewal = source_credentials.Renewable(URI, tmp_path, environ=ENV)
    first = renewal.fs
    assert renewal.renewed(first) is None
    write(tmp_path, AWS_ACCESS_KEY_ID="AKIANEW", AWS_SECRET_ACCESS_KEY="new-secret")
    second = renewal.renewed(first)
    assert second is not None and second is not first and renewal.fs is second
    assert renewal.storage_options() is not None
    assert renewal.storage_options()[contract.ENV_S3_ACCESS_KEY_ID] == "AKIANEW"  # type: ignore[index]
    # A thread refused with the old filesystem gets the new one, not another.
    assert renewal.renewed(first) is second
    assert renewal.renewed(second) is None


def test_credentials_that_cannot_be_used_are_not_taken(tmp_path: Path) -> None:
    write(tmp_path, AWS_ACCESS_KEY_ID="AKIAOLD", AWS_SECRET_ACCESS_KEY="old-secret")
    renewal = source_credentials.Renewable(URI, tmp_path, environ=ENV)
    used = renewal.fs
    # Half a pair (a Secret edited by hand), then a value with a newline around it.
    write(tmp_path, AWS_ACCESS_KEY_ID="AKIANEW")
    assert renewal.renewed(used) is None
    write(tmp_path, AWS_ACCESS_KEY_ID="AKIANEW\n", AWS_SECRET_ACCESS_KEY="new-secret")
    assert renewal.renewed(used) is None
    assert renewal.fs is used
    write(tmp_path, AWS_ACCESS_KEY_ID="AKIANEW", AWS_SECRET_ACCESS_KEY="new-secret")
    assert renewal.renewed(used) is not None


def test_an_oversized_or_unreadable_file_counts_as_absent(tmp_path: Path) -> None:
    write(tmp_path, AWS_ACCESS_KEY_ID="AKIANEW", AWS_SECRET_ACCESS_KEY="new-secret")
    (tmp_path / contract.ENV_S3_SESSION_TOKEN).write_bytes(
        b"x" * (source_credentials.MAX_BYTES + 1)
    )
    found = source_credentials.read(tmp_path)
    assert set(found) == {contract.ENV_S3_ACCESS_KEY_ID, contract.ENV_S3_SECRET_ACCESS_KEY}
    (tmp_path / contract.ENV_S3_SESSION_TOKEN).unlink()
    (tmp_path / contract.ENV_S3_SESSION_TOKEN).mkdir()  # not a file: read() fails
    assert set(source_credentials.read(tmp_path)) == set(found)


def test_threads_refused_together_make_one_new_filesystem(tmp_path: Path) -> None:
    write(tmp_path, AWS_ACCESS_KEY_ID="AKIAOLD", AWS_SECRET_ACCESS_KEY="old-secret")
    renewal = source_credentials.Renewable(URI, tmp_path, environ=ENV)
    used = renewal.fs
    write(tmp_path, AWS_ACCESS_KEY_ID="AKIANEW", AWS_SECRET_ACCESS_KEY="new-secret")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda _: renewal.renewed(used), range(32)))
    assert all(fs is renewal.fs for fs in got)
