"""A real S3-compatible server (MinIO, built from its Go module) for tests.

Fixtures:
  s3_server   (session) a running MinIO on 127.0.0.1, fresh data dir and credentials.
  s3_bucket   (function) the name of a new, empty bucket on it.
  fault_proxy (function) a FaultProxy in front of it, see tests/support/faultproxy.py.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import secrets
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pyarrow.fs
import pytest
from shardcache_sidecar.listening import free_port

from tests.support import faultproxy, processes, toolpaths

HOST = "127.0.0.1"
REGION = "us-east-1"
# MinIO in single-drive mode is ready in about a second; a cold page cache and a busy
# machine (two cores shared with builds) can take much longer.
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0


def minio_binary() -> pathlib.Path:
    return toolpaths.tool_binary("minio", "MINIO_VERSION", "minio")


class S3Server:
    """One MinIO process; `stop()` and `start()` keep its port, data and credentials."""

    def __init__(self, binary: pathlib.Path, workdir: pathlib.Path, *, host: str = HOST) -> None:
        # Loopback, or the real node's bridge address when pods must reach it.
        self.host = host
        self.binary = binary
        self.data_dir = workdir / "data"
        self.log_path = workdir / "minio.log"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port(host)
        self.console_port = free_port(host)
        self.access_key = "shardcache-" + secrets.token_hex(4)
        self.secret_key = secrets.token_urlsafe(24)
        self.region = REGION
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def host_port(self) -> str:
        return f"{self.host}:{self.port}"

    def env(self) -> dict[str, str]:
        """The AWS variables that point an SDK (or a subprocess) at this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_REGION": self.region,
        }

    def filesystem(self, **options: object) -> pyarrow.fs.S3FileSystem:
        """A pyarrow S3FileSystem on this server; `options` go to the constructor."""
        return s3_filesystem(self.endpoint_url, self.access_key, self.secret_key, **options)

    def make_bucket(self, prefix: str = "t") -> str:
        name = f"{prefix}-{secrets.token_hex(6)}".lower()
        self.filesystem(allow_bucket_creation=True).create_dir(name)
        return name

    def start(self) -> None:
        if self._process is not None and self._process.poll() is None:
            return
        env = {
            **os.environ,
            "MINIO_ROOT_USER": self.access_key,
            "MINIO_ROOT_PASSWORD": self.secret_key,
            "MINIO_REGION": self.region,
            "MINIO_BROWSER": "off",
            "MINIO_UPDATE": "off",
        }
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                [
                    str(self.binary),
                    "server",
                    "--quiet",
                    "--address",
                    self.host_port,
                    "--console-address",
                    f"{self.host}:{self.console_port}",
                    str(self.data_dir),
                ],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        url = f"{self.endpoint_url}/minio/health/ready"
        while time.monotonic() < deadline:
            assert self._process is not None
            if self._process.poll() is not None:
                raise RuntimeError(
                    f"minio exited with {self._process.returncode} while starting on "
                    f"{self.host_port}; its log:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(
            f"minio did not become ready on {self.host_port} within {START_TIMEOUT_S}s; "
            f"its log:\n{self.log_tail()}"
        )

    def stop(self) -> None:
        process, self._process = self._process, None
        processes.stop(process, STOP_TIMEOUT_S)

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"


def s3_filesystem(
    endpoint_url: str, access_key: str, secret_key: str, **options: object
) -> pyarrow.fs.S3FileSystem:
    scheme, _, host_port = endpoint_url.partition("://")
    kwargs: dict[str, object] = {
        "access_key": access_key,
        "secret_key": secret_key,
        "endpoint_override": host_port,
        "scheme": scheme,
        "region": REGION,
    }
    kwargs.update(options)
    return pyarrow.fs.S3FileSystem(**kwargs)


@contextlib.contextmanager
def own_server(prefix: str, *, host: str = HOST) -> Iterator[S3Server]:
    """A MinIO started on a fresh data directory (named with `prefix`), stopped and
    removed after: the session's, or one a test may restart with another key."""
    workdir = pathlib.Path(tempfile.mkdtemp(prefix=prefix))
    server = S3Server(minio_binary(), workdir, host=host)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    with own_server("shardcache-minio-") as server:
        yield server


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> str:
    if not s3_server.running:
        # A fault test that stopped the server and failed before restarting it.
        s3_server.start()
    return s3_server.make_bucket()


@pytest.fixture
def fault_proxy(s3_server: S3Server) -> Iterator[faultproxy.FaultProxy]:
    proxy = faultproxy.FaultProxy(HOST, s3_server.port)
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.close()
