"""One source, however its URI is spelled, has one identity (`source.identity`): the
key of its manifest kept on the node. An s3 key no request reads as written is refused
before any request, naming the key and what was expected."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardcache import errors, source

pytestmark = pytest.mark.unit


def test_spellings_of_one_local_file_have_one_identity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    spellings = [
        "data.parquet",
        "./x/../data.parquet",
        f"{tmp_path}/data.parquet",
        f"file://{tmp_path}/data.parquet",
        f"file://{tmp_path}/./data%2Eparquet",
        f"file:///{tmp_path}/data.parquet",  # four slashes: still one local path
    ]
    assert {source.identity(s) for s in spellings} == {f"file://{tmp_path}/data.parquet"}


def test_an_s3_identity_is_the_key_decoded_once_and_uris_in_that_form_keep_theirs() -> None:
    assert source.identity("s3://b/ds") == "s3://b/ds"
    assert source.identity("s3://b/ds/") == "s3://b/ds"
    assert source.identity("s3://b/dir/a%2Fb.parquet") == "s3://b/dir/a/b.parquet"
    assert source.identity("s3://b/dir/a%252Fb.parquet") == "s3://b/dir/a%2Fb.parquet"


@pytest.mark.parametrize(
    ("uri", "key"),
    [
        ("s3://b/dir/x.parquet%2F", "dir/x.parquet/"),
        ("s3://b/dir//x.parquet", "dir//x.parquet"),
        ("s3://b/dir/%2E/x.parquet", "dir/./x.parquet"),
        ("s3://b/dir/../x.parquet", "dir/../x.parquet"),
    ],
)
def test_an_s3_key_no_request_reads_as_written_is_refused(uri: str, key: str) -> None:
    with pytest.raises(errors.InputError) as caught:
        source.checked_uri(uri)
    assert f"names the key {key!r}" in str(caught.value)
    assert "expected s3://BUCKET/KEY" in str(caught.value)
