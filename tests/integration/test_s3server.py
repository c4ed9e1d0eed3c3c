"""The S3 test fixtures are real: MinIO answers pyarrow, and the fault proxy's faults reach it."""

from __future__ import annotations

import pyarrow.fs
import pytest

from tests.support import faultproxy, s3server, waiting

pytestmark = pytest.mark.integration

PAYLOAD = b"shard-bytes " * 1000


def proxied_fs(
    server: s3server.S3Server, proxy: faultproxy.FaultProxy, **options: object
) -> pyarrow.fs.S3FileSystem:
    return s3server.s3_filesystem(
        proxy.endpoint_url, server.access_key, server.secret_key, **options
    )


def no_retries() -> pyarrow.fs.S3RetryStrategy:
    return pyarrow.fs.AwsStandardS3RetryStrategy(max_attempts=1)


def test_pyarrow_writes_reads_and_lists_objects(
    s3_server: s3server.S3Server, s3_bucket: str
) -> None:
    fs = s3_server.filesystem()
    with fs.open_output_stream(f"{s3_bucket}/dir/a.bin") as out:
        out.write(PAYLOAD)
    with fs.open_output_stream(f"{s3_bucket}/dir/b.bin") as out:
        out.write(b"x")

    with fs.open_input_file(f"{s3_bucket}/dir/a.bin") as f:
        assert f.read() == PAYLOAD
    listed = fs.get_file_info(pyarrow.fs.FileSelector(f"{s3_bucket}/dir"))
    assert sorted((i.base_name, i.size) for i in listed) == [("a.bin", len(PAYLOAD)), ("b.bin", 1)]


def test_each_bucket_is_new_and_empty(s3_server: s3server.S3Server, s3_bucket: str) -> None:
    other = s3_server.make_bucket()
    assert other != s3_bucket
    fs = s3_server.filesystem()
    assert fs.get_file_info(pyarrow.fs.FileSelector(other)) == []


def test_env_names_the_server_for_the_sdk(s3_server: s3server.S3Server, s3_bucket: str) -> None:
    env = s3_server.env()
    assert env["AWS_ENDPOINT_URL"] == s3_server.endpoint_url
    fs = pyarrow.fs.S3FileSystem(
        access_key=env["AWS_ACCESS_KEY_ID"],
        secret_key=env["AWS_SECRET_ACCESS_KEY"],
        endpoint_override=env["AWS_ENDPOINT_URL"],
        region=env["AWS_REGION"],
    )
    assert fs.get_file_info(s3_bucket).type == pyarrow.fs.FileType.Directory


def test_data_survives_a_server_restart(s3_server: s3server.S3Server, s3_bucket: str) -> None:
    fs = s3_server.filesystem()
    with fs.open_output_stream(f"{s3_bucket}/kept") as out:
        out.write(PAYLOAD)
    s3_server.stop()
    try:
        down = s3_server.filesystem(retry_strategy=no_retries(), connect_timeout=1.0)
        with pytest.raises(OSError):
            down.get_file_info(f"{s3_bucket}/kept")
    finally:
        s3_server.start()
    with s3_server.filesystem().open_input_file(f"{s3_bucket}/kept") as f:
        assert f.read() == PAYLOAD


def test_proxy_passes_requests_through_and_counts_them(
    s3_server: s3server.S3Server, s3_bucket: str, fault_proxy: faultproxy.FaultProxy
) -> None:
    fs = proxied_fs(s3_server, fault_proxy)
    with fs.open_output_stream(f"{s3_bucket}/via-proxy") as out:
        out.write(PAYLOAD)
    with fs.open_input_file(f"{s3_bucket}/via-proxy") as f:
        assert f.read() == PAYLOAD
    assert fault_proxy.requests_seen >= 2
    assert fault_proxy.faults_injected == 0


def test_injected_503_fails_a_client_without_retries(
    s3_server: s3server.S3Server, s3_bucket: str, fault_proxy: faultproxy.FaultProxy
) -> None:
    fault_proxy.fail_next(1)
    fs = proxied_fs(s3_server, fault_proxy, retry_strategy=no_retries())
    with pytest.raises(OSError, match=r"SlowDown|503|reduce your request rate"):
        fs.get_file_info(f"{s3_bucket}/anything")
    assert fault_proxy.faults_injected == 1
    # Only the next request was faulted: the same client now succeeds.
    assert fs.get_file_info(s3_bucket).type == pyarrow.fs.FileType.Directory


def test_injected_503s_are_retried_by_a_retrying_client(
    s3_server: s3server.S3Server, s3_bucket: str, fault_proxy: faultproxy.FaultProxy
) -> None:
    with s3_server.filesystem().open_output_stream(f"{s3_bucket}/obj") as out:
        out.write(PAYLOAD)
    fs = proxied_fs(
        s3_server, fault_proxy, retry_strategy=pyarrow.fs.AwsStandardS3RetryStrategy(max_attempts=5)
    )
    fault_proxy.fail_next(2)
    with fs.open_input_file(f"{s3_bucket}/obj") as f:
        assert f.read() == PAYLOAD
    assert fault_proxy.faults_injected == 2
    assert fault_proxy.requests_seen >= 3


def test_stalled_request_times_the_client_out(
    s3_server: s3server.S3Server, s3_bucket: str, fault_proxy: faultproxy.FaultProxy
) -> None:
    fs = proxied_fs(s3_server, fault_proxy, retry_strategy=no_retries(), request_timeout=0.5)
    # An hour's stall: the call returning at all shows the client timed out rather
    # than waiting it out (the proxy cancels the held request when it closes).
    fault_proxy.stall_next(1, 3600.0)
    with pytest.raises(OSError):
        waiting.finishes(
            "a request the proxy holds for an hour, under a 0.5 s request timeout",
            lambda: fs.get_file_info(f"{s3_bucket}/anything"),
        )
    assert fault_proxy.stalls_injected == 1
    assert fs.get_file_info(s3_bucket).type == pyarrow.fs.FileType.Directory


def test_refused_connections_fail_until_accepted_again(
    s3_server: s3server.S3Server, s3_bucket: str, fault_proxy: faultproxy.FaultProxy
) -> None:
    fs = proxied_fs(s3_server, fault_proxy, retry_strategy=no_retries(), connect_timeout=1.0)
    assert fs.get_file_info(s3_bucket).type == pyarrow.fs.FileType.Directory
    fault_proxy.refuse_connections()
    seen = fault_proxy.requests_seen
    with pytest.raises(OSError):
        fs.get_file_info(s3_bucket)
    assert fault_proxy.requests_seen == seen
    fault_proxy.accept_connections()
    assert fs.get_file_info(s3_bucket).type == pyarrow.fs.FileType.Directory
    assert fault_proxy.requests_seen == seen + 1
