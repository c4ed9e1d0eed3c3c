"""A trainer's client library and its pod's sidecar come from separate images, so after
an upgrade of one they may be of different releases. A sidecar serving a manifest
version the client does not read is refused naming which side is behind, not with a
bare "manifest version N is not supported".

The other release is stood in for by a socket that answers GET /v1/manifest as a
sidecar of it would: no other release's sidecar can run here."""

from __future__ import annotations

import http.server
import json
import shutil
import socketserver
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardcache import errors, manifests, sidecar_client
from shardcache.contract import protocol

pytestmark = pytest.mark.unit


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


def serve_manifest(path: Path, body: dict[str, object]) -> _Server:
    raw = json.dumps(body).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            assert self.path == protocol.MANIFEST, self.path
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args: object) -> None:
            pass

    server = _Server(str(path), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # pytest's tmp_path can exceed the 107-byte socket path limit.
    path = Path(tempfile.mkdtemp(prefix="scr-", dir="/tmp"))
    yield path
    shutil.rmtree(path)


@pytest.mark.parametrize(
    ("version", "says"),
    [
        (5, "the sidecar serves manifest version 5, newer than this shardcache client reads "
            "(3 and 4): the sidecar image is of a newer shardcache release than the "
            "trainer's"),
        (2, "the sidecar serves manifest version 2, older than this shardcache client reads "
            "(3 and 4): the sidecar image predates the trainer's shardcache release"),
        ("3", "the sidecar serves a manifest without a version number (version '3')"),
    ],
)  # fmt: skip
def test_a_sidecar_serving_a_manifest_version_the_client_does_not_read_is_named_as_skew(
    short_dir: Path, version: object, says: str
) -> None:
    body = {"version": version, "root": "s3://b/p", "format": "parquet",
            "digest": "sha256:0", "shards": []}  # fmt: skip
    server = serve_manifest(short_dir / "control.sock", body)
    settings = sidecar_client.ClientSettings(
        short_dir / "control.sock", short_dir / "mem", reconnect_timeout=1
    )
    try:
        with pytest.raises(errors.CacheError) as caught:
            sidecar_client.SidecarProvider(settings)
    finally:
        server.shutdown()
        server.server_close()
    assert str(caught.value) == manifests.served_version_note(version)
    assert str(caught.value).startswith(says)


def test_every_version_this_release_reads_is_no_skew() -> None:
    assert all(manifests.served_version_note(v) is None for v in manifests.READABLE)
