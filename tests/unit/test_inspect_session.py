from __future__ import annotations

import pytest

from shardcache.inspect import session

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "uri,shown",
    [
        ("s3://AKIAXXX:s3cr3t@bucket/prefix/", "s3://bucket/prefix/"),
        ("s3://bucket/data?access_key=AK&secret_key=s3cr3t", "s3://bucket/data"),
        ("gs://user@bucket:443/x", "gs://bucket:443/x"),
        ("file:///data/tokens", "file:///data/tokens"),
        ("/plain/path", "/plain/path"),
    ],
)
def test_public_uri_drops_credentials(uri: str, shown: str) -> None:
    assert session.public_uri(uri) == shown
