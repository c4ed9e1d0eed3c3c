"""Which object store errors the checkpoint agent (and every reader, `source.with_retries`)
retries, and which it reports at once as the caller's to fix."""

from __future__ import annotations

import errno

import pytest

from shardcache import errors, source

pytestmark = pytest.mark.unit

#: As pyarrow's S3 filesystem words them (pyarrow 26 against MinIO).
KEY_TOO_LONG = (
    "When initiating multiple part upload for key 'run/step-000000000001/data/x' in bucket "
    "'b': AWS Error UNKNOWN (HTTP status 400) during CreateMultipartUpload operation: "
    "Unable to parse ExceptionName: KeyTooLongError Message: Your key is too long"
)


def aws(status: int, code: str) -> OSError:
    return OSError(
        f"When uploading part for key 'k' in bucket 'b': AWS Error UNKNOWN (HTTP status "
        f"{status}) during UploadPart operation: Unable to parse ExceptionName: {code} "
        f"Message: …"
    )


@pytest.mark.parametrize(
    "exc",
    [
        OSError(KEY_TOO_LONG),
        aws(400, "InvalidArgument"),
        aws(400, "EntityTooLarge"),
        aws(411, "MissingContentLength"),
        aws(416, "InvalidRange"),
        OSError(errno.ENAMETOOLONG, "File name too long"),
    ],
)
def test_a_request_the_store_refuses_as_malformed_is_permanent(exc: OSError) -> None:
    assert source.is_permanent(exc)


@pytest.mark.parametrize(
    "exc",
    [
        aws(408, "RequestTimeout"),
        aws(400, "RequestTimeout"),
        aws(409, "OperationAborted"),
        aws(429, "TooManyRequests"),
        aws(403, "RequestTimeTooSkewed"),
        aws(400, "ExpiredToken"),
        aws(404, "NoSuchUpload"),
        aws(503, "SlowDown"),
        aws(500, "InternalError"),
        OSError("When reading information for key 'k': AWS Error NETWORK_CONNECTION during …"),
        ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
    ],
)
def test_timeouts_conflicts_throttling_and_server_errors_are_retried(exc: OSError) -> None:
    assert not source.is_permanent(exc)


def test_a_key_too_long_is_reported_after_one_try_not_retried() -> None:
    tries = []

    def put() -> None:
        tries.append(1)
        raise OSError(KEY_TOO_LONG)

    with pytest.raises(errors.InputError, match="KeyTooLongError"):
        source.with_retries(put, what="uploading", policy=source.RetryPolicy(initial_delay=0))
    assert len(tries) == 1
