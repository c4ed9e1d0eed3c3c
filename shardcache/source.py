"""Object storage access: a pyarrow filesystem from a URI, and reads with retries.

Any URI pyarrow's filesystems open works (`file://`, `s3://`, `gs://`, `hdfs://`); a
bare path is local. A `file://` or `s3://` URI is a path and nothing else, percent-
decoded once (`%23` is a "#" in a name, `%2F` a "/" of the key); a "?" or "#" after it
is refused (`split_uri`), never dropped, and so is an s3 key no request reads as
written (`checked_uri`); `identity` writes each source one way. S3 endpoint and
credentials come from the usual AWS variables, read from `storage_options` (an env-like
mapping, e.g. a Kubernetes Secret's data) or else from the process environment;
settings no request could get past are refused first, naming the variable
(`s3_settings`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import logging
import os
import random
import re
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

import pyarrow as pa
import pyarrow.fs as pafs

from shardcache import contract, errors, s3_settings, uris

log = logging.getLogger(__name__)
T = TypeVar("T")

SUPPORTED_SCHEMES = ("file", "s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss")
#: Optional timeouts (seconds) for S3, read from storage options or the environment.
ENV_S3_CONNECT_TIMEOUT = "SHARDCACHE_S3_CONNECT_TIMEOUT"
ENV_S3_REQUEST_TIMEOUT = "SHARDCACHE_S3_REQUEST_TIMEOUT"
_COPY_CHUNK = 8 << 20


@dataclasses.dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """Backoff for transient source errors (5xx, timeouts, refused or reset connections,
    throttling), budgeted by time.

    A transient error is tried again after a delay that doubles from `initial_delay` to
    `max_delay` (full jitter), until the next try would begin more than
    `budget_seconds` after the first one began, or `attempts` tries were made, whichever
    comes first; then `with_retries` raises `SourceError`. A permanent error
    (`is_permanent`: a missing object, refused credentials, a request the store refuses)
    fails at once, whatever the budget.
    """

    #: Seconds after the first try began past which no further try begins. 60: an
    #: object store that restarts (a rolling restart, its pod rescheduled) answers again
    #: within 10-30 s, and a training loop rides that out; a store down for longer is an
    #: outage that the caller reports. A try that hangs adds its own timeouts
    #: (`SHARDCACHE_S3_REQUEST_TIMEOUT`, 30 s, twice with the SDK's own retry), so one
    #: call gives up within about two minutes, well inside the sidecar's and the client's
    #: acquire timeout (600 s).
    budget_seconds: float = 60.0
    #: Most tries, the first included; None: as many as `budget_seconds` allows (about
    #: 20 over a minute of refused connections with the delays below).
    attempts: int | None = None
    #: First delay in seconds; doubles each retry, with full jitter.
    initial_delay: float = 0.2
    #: Cap on one delay in seconds.
    max_delay: float = 5.0
    #: Once set, no further try begins: the wait ends at once and `with_retries` raises
    #: `SourceError` with the last error. How a process that is stopping ends retries
    #: it no longer needs (the checkpoint agent's start-up restore on SIGTERM).
    stop: threading.Event | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.attempts is not None and self.attempts < 1:
            raise errors.InputError(f"RetryPolicy.attempts: expected >= 1, found {self.attempts}")
        for name in ("budget_seconds", "initial_delay", "max_delay"):
            if getattr(self, name) < 0:
                raise errors.InputError(
                    f"RetryPolicy.{name}: expected seconds >= 0, found {getattr(self, name)}"
                )

    def to_json(self) -> dict[str, float | int | None]:
        """The policy as another process rebuilds it (`RetryPolicy(**data)`): every field
        but `stop`, an event that cannot cross a process boundary."""
        return {
            field.name: getattr(self, field.name)
            for field in dataclasses.fields(self)
            if field.name != "stop"
        }


#: Every key `storage_options` may hold: the AWS variables read for S3, and our timeouts.
STORAGE_OPTION_KEYS = (*s3_settings.VARIABLES, ENV_S3_CONNECT_TIMEOUT, ENV_S3_REQUEST_TIMEOUT)


def check_storage_options(options: Mapping[str, str] | None) -> None:
    """Refuse keys nobody reads: fsspec's spelling (`key`, `secret`, `endpoint_url`) or a
    typo would otherwise drop the endpoint and the credentials, and the read would go
    anonymously to another endpoint and fail, a minute later, naming neither."""
    if options is None:
        return
    unknown = sorted(str(k) for k in options if k not in STORAGE_OPTION_KEYS)
    if unknown:
        raise errors.InputError(
            f"storage_options: expected keys among {list(STORAGE_OPTION_KEYS)} (the AWS "
            f"variables; they replace the environment), found unknown {unknown}"
        )


def _env(options: Mapping[str, str] | None) -> Mapping[str, str]:
    return options if options is not None else os.environ


#: Schemes whose URI is a path and nothing else, percent-decoded: a "?" or "#" in one
#: would start a query or fragment that names no object, so it is refused (a name with
#: one is written %3F or %23). Other schemes are pyarrow's to parse (`from_uri`), whose
#: query strings carry options.
_PATH_SCHEMES = ("file", "s3")
_AZURE_SCHEMES = ("abfs", "abfss")


def split_uri(uri: str) -> tuple[str, str]:
    """(scheme, rest) of a URI; a bare path is `file`. The path of a file:// or s3://
    URI is percent-decoded (s3://bucket/v1%232 names the prefix "v1#2")."""
    if "://" not in uri:
        if not uri:
            raise errors.InputError("expected a dataset URI such as s3://bucket/prefix, got ''")
        return "file", str(Path(uri).absolute())
    uris.refuse_userinfo(uri, where="dataset URI")
    try:
        parsed = urllib.parse.urlsplit(uri)
    except ValueError as exc:  # an unclosed '[' of an IPv6 host
        raise errors.InputError(
            f"dataset URI {uris.redact(uri)!r} is not a well-formed URI ({exc}): expected "
            "scheme://host/path, an IPv6 host written [address]"
        ) from None
    scheme = parsed.scheme.lower()
    if scheme not in SUPPORTED_SCHEMES:
        raise errors.InputError(
            f"unsupported URI scheme {scheme!r} in {uris.redact(uri)!r}: expected one of "
            + ", ".join(f"{s}://" for s in SUPPORTED_SCHEMES)
        )
    mark = uris.query_or_fragment(uri)
    if scheme in _PATH_SCHEMES and mark is not None:
        # Dropped, it would read another dataset (s3://b/ds/v1#2 is then s3://b/ds/v1)
        # without a word. What follows it is not shown: a query may hold a signature.
        raise errors.InputError(
            f"dataset URI {uris.redact(uri)!r} is followed by a {mark!r}, which starts a "
            f"{'fragment' if mark == '#' else 'query'} that names no object: expected "
            "the path alone; a name with '#' or '?' in it is written %23 or %3F"
        )
    if scheme in _AZURE_SCHEMES and "[" in parsed.netloc:
        # pyarrow hands Azure's SDK the host without its brackets, and the SDK's port
        # parse throws through C++: the whole process aborts (sidecar, operator, trainer).
        raise errors.InputError(
            f"dataset URI {uris.redact(uri)!r} names an IPv6 host, which pyarrow's Azure "
            "client cannot read: expected abfs://CONTAINER@ACCOUNT.dfs.core.windows.net/PATH "
            "or a host name or IPv4 address"
        )
    if scheme == "file":
        if parsed.netloc:
            # Dropped, file://tmp/data would read /data without a word.
            raise errors.InputError(
                f"file URI {uris.redact(uri)!r} names the host {parsed.netloc!r}: expected "
                "file:///absolute/path (three slashes; a local path names no host)"
            )
        return scheme, urllib.parse.unquote(parsed.path)
    return scheme, (parsed.netloc + urllib.parse.unquote(parsed.path)).rstrip("/")


def checked_uri(uri: str) -> tuple[str, str]:
    """`split_uri`, and a bucket for s3://: every check of a URI made before a request,
    so an `InputError` here is the URI's fault, never the store's."""
    scheme, path = split_uri(uri)
    if scheme == "s3" and (not path or path.startswith("/")):
        raise errors.InputError(f"expected s3://BUCKET/PREFIX, got {uris.redact(uri)!r}")
    if scheme == "s3":
        _refuse_unreadable_key(uri)
    return scheme, path


def identity(uri: str) -> str:
    """What `uri` names, written one way, so two spellings of one source compare equal:
    the scheme and the path decoded once (`checked_uri`), a local path made absolute and
    normalised ("data.parquet", "./data.parquet" and "file:///cwd/data%2Eparquet" are
    one), no trailing "/". An object store's key is not normalised: "a/../b" is a key
    of its own there (one `checked_uri` refuses). Raises `InputError` as `checked_uri`
    does."""
    scheme, path = checked_uri(uri)
    if scheme == "file":
        path = os.path.abspath(path)
        if path.startswith("//"):
            # normpath keeps two leading slashes (POSIX leaves their meaning open);
            # Linux reads them as one.
            path = "/" + path.lstrip("/")
    return f"{scheme}://{path.rstrip('/') or '/'}"


def _refuse_unreadable_key(uri: str) -> None:
    """Refuse an s3:// URI whose key, decoded, has an empty, "." or ".." segment.

    No request reads such a key as written: pyarrow refuses an empty segment
    ("a//b"), the store or its signature normalises "." and ".." away (a read of
    another object, or a refusal that looks like bad credentials), and a trailing %2F
    is cut like a trailing "/", naming "a" where "a/" was written."""
    # A literal trailing "/" marks a prefix (s3://b/ds/); one written %2F is in the key.
    key = urllib.parse.unquote(urllib.parse.urlsplit(uri).path.rstrip("/"))[1:]
    if key and any(part in ("", ".", "..") for part in key.split("/")):
        raise errors.InputError(
            f"s3 URI {uris.redact(uri)!r} names the key {key!r}, which has an empty, '.' or "
            "'..' segment or ends in '/': no request reads such a key as written; "
            "expected s3://BUCKET/KEY with segments of at least one character other "
            "than '.' and '..' (a '%' in a key is written %25)"
        )


def filesystem(
    uri: str, *, storage_options: Mapping[str, str] | None = None
) -> tuple[pafs.FileSystem, str]:
    """The filesystem that serves `uri` and the path of the URI inside it."""
    scheme, path = checked_uri(uri)
    if scheme == "file":
        return pafs.LocalFileSystem(), path
    if scheme == "s3":
        return _s3(storage_options), path
    try:
        fs, inner = pafs.FileSystem.from_uri(uri)
    except (OSError, ValueError) as exc:
        raise errors.InputError(
            f"cannot open a filesystem for {uris.redact(uri)!r}: {exc}"
        ) from exc
    return fs, inner


def _s3(options: Mapping[str, str] | None) -> pafs.S3FileSystem:
    env = _env(options)
    problem = s3_settings.problem(
        env,
        origin="storage options" if options is not None else "the environment",
        pair=options is not None,
    )
    if problem is not None:
        raise errors.InputError(problem)
    kwargs: dict[str, object] = {}
    endpoint = env.get(contract.ENV_S3_ENDPOINT_S3) or env.get(contract.ENV_S3_ENDPOINT)
    if endpoint:
        parsed = urllib.parse.urlsplit(s3_settings.endpoint_url(endpoint))
        kwargs["endpoint_override"] = parsed.netloc
        kwargs["scheme"] = parsed.scheme
    region = env.get(contract.ENV_S3_REGION) or env.get(contract.ENV_S3_DEFAULT_REGION)
    # With a custom endpoint and no region, pyarrow would ask the endpoint for the
    # bucket's region; any region is fine for S3-compatible servers.
    kwargs["region"] = region or ("us-east-1" if endpoint else None)
    if env.get(contract.ENV_S3_ACCESS_KEY_ID):
        kwargs["access_key"] = env[contract.ENV_S3_ACCESS_KEY_ID]
        kwargs["secret_key"] = env[contract.ENV_S3_SECRET_ACCESS_KEY]
        if env.get(contract.ENV_S3_SESSION_TOKEN):
            kwargs["session_token"] = env[contract.ENV_S3_SESSION_TOKEN]
    elif options is not None:
        kwargs["anonymous"] = True
    kwargs["connect_timeout"] = float(env.get(ENV_S3_CONNECT_TIMEOUT, "5"))
    kwargs["request_timeout"] = float(env.get(ENV_S3_REQUEST_TIMEOUT, "30"))
    # Our own backoff (RetryPolicy) governs; keep the SDK's retries short.
    kwargs["retry_strategy"] = pafs.AwsStandardS3RetryStrategy(max_attempts=2)
    return pafs.S3FileSystem(**{k: v for k, v in kwargs.items() if v is not None})


#: S3 error codes (as the service and as pyarrow's SDK spell them) of refused
#: credentials: `AccessDeniedError`.
_ACCESS_DENIED_MARKERS = (
    "AccessDenied",
    "ACCESS_DENIED",
    "InvalidAccessKeyId",
    "INVALID_ACCESS_KEY_ID",
    "SignatureDoesNotMatch",
    "SIGNATURE_DOES_NOT_MATCH",
)
_PERMANENT_MARKERS = (
    "NoSuchBucket",
    "NO_SUCH_BUCKET",
    "NoSuchKey",
    "NO_SUCH_KEY",
    *_ACCESS_DENIED_MARKERS,
)


#: pyarrow's S3 errors carry the response's status: "AWS Error UNKNOWN (HTTP status 400)
#: during PutObject operation: … KeyTooLongError …".
_HTTP_STATUS = re.compile(r"\(HTTP status ([0-9]{3})\)")
#: Client errors a later try can get past: a request timeout, a conflicting operation
#: in progress, throttling.
_TRANSIENT_4XX = frozenset({408, 409, 429})
#: S3 error codes sent with another 4xx status that a later try can get past.
_TRANSIENT_4XX_MARKERS = (
    "RequestTimeout",  # 400: the connection idled; a new request goes through
    "RequestTimeTooSkewed",  # 403: the node's clock, which NTP corrects
    "ExpiredToken",  # 400: the credential provider fetches a fresh token
    "TokenRefreshRequired",
    "NoSuchUpload",  # 404: the multipart upload was aborted; a retry starts a new one
    "SlowDown",
    "Throttl",  # Throttling, ThrottlingException
)


def is_permanent(exc: BaseException) -> bool:
    """True for errors a retry cannot fix: missing objects, bad credentials, and any
    request the store refuses with a 4xx status (a key too long, a bad argument) but
    timeouts, conflicts and throttling. Without a status in the text (a connection
    error), transient."""
    if isinstance(exc, FileNotFoundError | PermissionError | NotADirectoryError):
        return True
    if isinstance(exc, OSError) and exc.errno == errno.ENAMETOOLONG:
        return True  # a filesystem store: the same path is as long on every try
    text = str(exc)
    if any(marker in text for marker in _PERMANENT_MARKERS):
        return True
    status = _HTTP_STATUS.search(text)
    if status is None:
        return False
    code = int(status.group(1))
    return (
        400 <= code < 500
        and code not in _TRANSIENT_4XX
        and not any(marker in text for marker in _TRANSIENT_4XX_MARKERS)
    )


def is_access_denied(exc: BaseException) -> bool:
    """True for a permanent error (`is_permanent`) that says the store refused the
    credentials: AccessDenied, InvalidAccessKeyId, SignatureDoesNotMatch, or a bare
    401/403 status. A 403 for a skewed clock is transient, never this."""
    if not is_permanent(exc) or isinstance(exc, FileNotFoundError | NotADirectoryError):
        return False
    text = str(exc)
    if any(marker in text for marker in _ACCESS_DENIED_MARKERS):
        return True
    status = _HTTP_STATUS.search(text)
    return status is not None and int(status.group(1)) in (401, 403)


def with_retries(op: Callable[[], T], *, what: str, policy: RetryPolicy | None = None) -> T:
    """Run `op`, retrying transient OSErrors as `policy` says (`RetryPolicy`); raise
    `SourceError` once it is spent, `AccessDeniedError` for refused credentials and
    `InputError` for any other permanent error, at once."""
    policy = policy or RetryPolicy()
    started = time.monotonic()
    delay = policy.initial_delay
    attempt = 0
    while True:
        attempt += 1
        try:
            return op()
        except errors.ShardcacheError:
            raise
        except OSError as exc:
            if is_access_denied(exc):
                raise errors.AccessDeniedError(f"{what}: {exc}") from exc
            if is_permanent(exc):
                raise errors.InputError(f"{what}: {exc}") from exc
            wait = random.uniform(delay / 2, delay)
            elapsed = time.monotonic() - started
            spent = policy.attempts is not None and attempt >= policy.attempts
            if spent or elapsed + wait > policy.budget_seconds:
                raise errors.SourceError(
                    f"{what}: failed after {attempt} attempts in {elapsed:.1f} s; last error: {exc}"
                ) from exc
            log.warning(
                "%s: attempt %d failed %.1f s after the first began (%s); retrying in "
                "%.2fs (for up to %g s)",
                what,
                attempt,
                elapsed,
                exc,
                wait,
                policy.budget_seconds,
            )
            if policy.stop is None:
                time.sleep(wait)
            elif policy.stop.wait(wait):
                raise errors.SourceError(
                    f"{what}: stopped after {attempt} attempts; last error: {exc}"
                ) from exc
            delay = min(delay * 2, policy.max_delay)


#: Content identities (`content_identity`): what a manifest pins per shard.
ETAG_PREFIX = "etag:"
SHA256_PREFIX = "sha256:"
MTIME_PREFIX = "mtime:"


def _etag(stream: pa.NativeFile) -> str | None:
    try:
        value = stream.metadata().get("ETag")
    except (OSError, NotImplementedError):
        return None
    if not value:
        return None
    text = value.decode() if isinstance(value, bytes) else str(value)
    return text.strip('"')


def content_identity(opened: pa.NativeFile, info: pafs.FileInfo) -> str:
    """The store's own identity of a shard's bytes, pinned in the manifest beside its
    sha256 (`content_sha256`) and checked on every fetch before the bytes are hashed.

    The object store's ETag where it gives one (S3: it changes whenever the object is
    written, but a multipart upload's ETag is no content hash); else the mtime. Neither
    is what a served byte is checked against: that is the sha256 (docs/security.md).
    """
    etag = _etag(opened)
    if etag:
        return ETAG_PREFIX + etag
    return MTIME_PREFIX + str(info.mtime_ns if info.mtime_ns is not None else 0)


#: Bytes read at a time by `content_sha256`: resolution hashes `_INSPECT_CONCURRENCY`
#: shards at once, so its memory stays a few MiB whatever the shards' sizes.
HASH_CHUNK = 1 << 20


def content_sha256(fs: pafs.FileSystem, path: str) -> str:
    """sha256 of an object's bytes (lowercase hex), streamed `HASH_CHUNK` at a time.

    What a manifest pins per shard and every served byte is checked against: unlike an
    ETag it is the same function of the content on every store, so a disk-tier entry
    can be checked against it without asking the store (docs/security.md)."""
    h = hashlib.sha256()
    with fs.open_input_stream(path) as f:
        while (chunk := f.read_buffer(HASH_CHUNK)).size:
            h.update(memoryview(chunk))
    return h.hexdigest()


#: A local volume out of room (a full filesystem, a quota spent): what writing a
#: download's destination may raise that is the destination's fault, never the store's.
#: Retrying the store does not fix it; the disk tier makes room (`tiers._no_space`).
NO_SPACE_ERRNOS: frozenset[int] = frozenset({errno.ENOSPC, errno.EDQUOT})


class _WriteFailed(Exception):
    """Carries an OSError of writing a download's destination out of `with_retries`
    (not an OSError itself, so it is not retried as the store's): see `download`."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


class _Destination:
    """The local file a download writes; each of its OSErrors becomes `_WriteFailed`,
    apart from the store's, which the same loop reads."""

    def __init__(self, dest: Path) -> None:
        try:
            self._out = open(dest, "wb")  # noqa: SIM115 - closed by `close`/`discard`
        except OSError as exc:
            raise _WriteFailed(exc) from exc

    def write(self, data: memoryview) -> None:
        try:
            self._out.write(data)
        except OSError as exc:
            raise _WriteFailed(exc) from exc

    def close(self) -> None:
        # The buffered tail is written here: a full volume may say so only now.
        try:
            self._out.close()
        except OSError as exc:
            raise _WriteFailed(exc) from exc

    def discard(self) -> None:
        """Close after another error, which is the one raised."""
        with contextlib.suppress(OSError):
            self._out.close()


def write_error(exc: OSError, *, dest: Path, what: str) -> OSError | errors.CacheError:
    """What `download` raises for `exc`, an error writing its destination `dest`: a
    full volume (`NO_SPACE_ERRNOS`) as the OSError it is, for the caller's tier to make
    room (the node disk tier evicts, waits, then raises a CacheError naming the
    volume); any other as a CacheError naming the local file. Never a SourceError: the
    store served the bytes."""
    if exc.errno in NO_SPACE_ERRNOS:
        return exc
    return errors.CacheError(
        f"{what}: writing the local copy {dest} failed ({exc}): the local volume's "
        "fault, not the store's; it is not retried"
    )


def download(
    fs: pafs.FileSystem,
    path: str,
    dest: Path,
    *,
    expected_size: int,
    what: str,
    policy: RetryPolicy | None = None,
    identity: str | None = None,
    sha256: str | None = None,
) -> None:
    """Copy one object to a local file, retried as a whole; checks the size and, when
    given, the store identity (`content_identity`) and the content hash
    (`content_sha256`) the manifest pinned. A changed object raises
    `ManifestMismatchError` naming both values; its bytes stay in `dest`, which the
    caller discards: they are never served.

    Only reading the store is retried (`with_retries`). Writing `dest` fails at once,
    as `write_error` says: a full local volume raises its OSError (ENOSPC, EDQUOT),
    anything else a CacheError; neither is the store's failure. Until 2026-11-27 a
    full disk tier was retried as a flaky store for the whole retry budget and then
    reported as a SourceError (kind=source) that blamed the store.

    An object the manifest pinned that the store no longer has (a file:// shard
    deleted, an S3 404) is `SourceError`, at once: the dataset changed under the pinned
    manifest, which is the store's failure, not the caller's input (`InputError`, which
    it was until 2026-11-28, said "fix your arguments" to a user who had given none)."""

    def attempt() -> None:
        written = 0
        h = hashlib.sha256()
        try:
            src_file = fs.open_input_stream(path)
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise errors.SourceError(
                f"{what}: expected the {expected_size}-byte object the manifest pinned, "
                f"found none at {path} ({exc}): it was deleted or moved after the manifest "
                "was resolved; restore it, or re-pin the dataset"
            ) from exc
        with src_file as src:
            out = _Destination(dest)
            try:
                found_etag = _etag(src)
                # pyarrow buffers, not bytes: one copy of a chunk per fetch, not three.
                while (chunk := src.read_buffer(_COPY_CHUNK)).size:
                    view = memoryview(chunk)
                    out.write(view)
                    h.update(view)
                    written += chunk.size
                    del view
            except BaseException:
                out.discard()
                raise
            out.close()
        if written != expected_size:
            raise errors.ManifestMismatchError(
                f"{what}: expected {expected_size} bytes as pinned in the manifest, "
                f"found {written}: the object changed after the manifest was resolved"
            )
        checks: list[tuple[str, str]] = []
        if identity is not None and identity.startswith(ETAG_PREFIX):
            checks.append((ETAG_PREFIX + (found_etag or "none"), identity))
        if sha256 is not None:
            checks.append((SHA256_PREFIX + h.hexdigest(), SHA256_PREFIX + sha256))
        for found, pinned in checks:
            if found != pinned:
                raise errors.ManifestMismatchError(
                    f"{what}: the object is {found}, the manifest pinned {pinned}: it "
                    "changed after the manifest was resolved and is not served; re-pin "
                    "the dataset"
                )

    try:
        with_retries(attempt, what=what, policy=policy)
    except _WriteFailed as failed:
        raise write_error(failed.error, dest=dest, what=what) from None
