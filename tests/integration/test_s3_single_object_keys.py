"""An s3:// URI that names one object reads that object, its key decoded exactly once,
however its last segment is encoded; a URI no request can read as written is refused
before any request, saying what was expected.

Against the real MinIO the integration tests start. Each dataset has a decoy: the
object a wrong split of the URI would name instead.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from shardcache import errors, manifests, source
from shardcache.node import pinned_manifests, tiers
from tests.support import datasets
from tests.support.s3server import S3Server

pytestmark = pytest.mark.integration


def put(fs: pafs.FileSystem, path: str, table: pa.Table) -> None:
    with fs.open_output_stream(path) as out:
        pq.write_table(table, out)


def read_back(manifest: manifests.Manifest, env: dict[str, str], tmp_path: Path) -> pa.Table:
    """The one shard, fetched as the cache fetches it: by the manifest's path, checked
    against the size and sha256 it pinned."""
    fs, _ = source.filesystem(manifest.root, storage_options=env)
    dest = tmp_path / "fetched.parquet"
    shard = manifest.shards[0]
    source.download(
        fs,
        manifest.shard_uri_path(0),
        dest,
        expected_size=shard.size,
        what="test fetch",
        identity=shard.version,
        sha256=shard.sha256,
    )
    return pq.read_table(dest)


@pytest.mark.parametrize(
    ("key", "written"),
    [
        ("dir/a/b.parquet", "dir/a%2Fb.parquet"),  # a "/" encoded in the last segment
        ("dir/a%2Fb.parquet", "dir/a%252Fb.parquet"),  # a literal "%2F" in the key
        ("dir/x y/b c.parquet", "dir/x%20y%2Fb%20c.parquet"),
    ],
)
def test_a_single_object_uri_reads_the_object_it_names(
    s3_server: S3Server, s3_bucket: str, tmp_path: Path, key: str, written: str
) -> None:
    fs = s3_server.filesystem()
    wanted = datasets.make_table(0, 50)
    put(fs, f"{s3_bucket}/{key}", wanted)
    put(fs, f"{s3_bucket}/dir/b.parquet", datasets.make_table(1000, 7))  # the decoy
    put(fs, f"{s3_bucket}/dir/b c.parquet", datasets.make_table(2000, 7))  # another
    env = s3_server.env()
    uri = f"s3://{s3_bucket}/{written}"

    manifest = manifests.resolve(uri, storage_options=env)

    assert manifest.total_rows == 50
    assert manifest.shard_uri_path(0) == f"{s3_bucket}/{key}"
    assert read_back(manifest, env, tmp_path).equals(wanted)
    # The node's saved copy is found under the same identity.
    tier = tiers.Tier(tmp_path / "disk", limit_bytes=1 << 20, name="disk", fsync=False)
    pinned_manifests.keep(tier, manifest, uri=uri)
    assert pinned_manifests.load(tier, digest=manifest.digest, uri=uri) == manifest


@pytest.mark.parametrize(
    "written",
    [
        "dir/b.parquet%2F",  # the key "dir/b.parquet/", cut to "dir/b.parquet"
        "dir//b.parquet",
        "dir/%2Fb.parquet",
        "dir/./b.parquet",
        "dir/x/%2E%2E/b.parquet",
    ],
)
def test_a_uri_that_cannot_name_one_object_is_refused_before_any_request(
    s3_server: S3Server, s3_bucket: str, written: str
) -> None:
    put(s3_server.filesystem(), f"{s3_bucket}/dir/b.parquet", datasets.make_table(0, 5))
    uri = f"s3://{s3_bucket}/{written}"
    with pytest.raises(errors.InputError) as caught:
        manifests.resolve(uri, storage_options=s3_server.env())
    message = str(caught.value)
    assert "expected s3://BUCKET/KEY" in message and uri in message
    assert not isinstance(caught.value, errors.AccessDeniedError)


def test_a_prefix_with_a_trailing_slash_is_still_a_prefix(
    s3_server: S3Server, s3_bucket: str
) -> None:
    datasets.write_dataset(s3_server.filesystem(), f"{s3_bucket}/ds", [10, 20])
    manifest = manifests.resolve(f"s3://{s3_bucket}/ds/", storage_options=s3_server.env())
    assert manifest.root == f"s3://{s3_bucket}/ds" and manifest.shard_rows == [10, 20]
