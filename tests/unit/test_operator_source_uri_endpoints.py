"""Sources other than s3:// (gs, gcs, hdfs, viewfs, abfs, abfss), read only with
policy.allowAmbientCredentials and then with the operator's own cloud identity: the host
each URI makes pyarrow's client connect to, and any query key that moves it, is held to
the platform's endpoint policy before any connection (docs/security.md)."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from shardcache_operator import endpoint_policy, reconcile, sources

from shardcache import errors
from tests.support.listener import Listener
from tests.unit.test_operator_source_endpoints import ONE_TRY, origins

pytestmark = pytest.mark.unit


def uri_origins(uri: str) -> list[str]:
    return [str(origin) for origin in endpoint_policy.uri_origins(uri)]


@pytest.mark.parametrize(
    ("uri", "connects_to"),
    [
        ("gs://bucket/x/", ["https://storage.googleapis.com"]),
        # `scheme` alone changes the credentials pyarrow uses, not the host.
        ("gcs://bucket/x?scheme=http", ["https://storage.googleapis.com"]),
        ("gs://b/x?endpoint_override=store.example:4443", ["https://store.example:4443"]),
        ("gs://b/x?endpoint_override=10.0.0.5:9&scheme=http", ["http://10.0.0.5:9"]),
        ("gs://b/x?endpoint%5Foverride=%31%30.0.0.5:9", ["https://10.0.0.5:9"]),
        ("gs://b/x?retry_limit_seconds=5&location=EU", ["https://storage.googleapis.com"]),
        ("hdfs://namenode/x", ["hdfs://namenode"]),
        ("hdfs://NN.example:9000/x", ["hdfs://nn.example:9000"]),
        ("viewfs://cluster/x", ["viewfs://cluster"]),
        ("abfs://c@acct/x", ["https://c.blob.core.windows.net", "https://c.dfs.core.windows.net"]),
        (
            "abfs://acct.blob.core.windows.net/c/x",
            ["https://acct.blob.core.windows.net", "https://acct.dfs.core.windows.net"],
        ),
        (
            "abfss://c@acct.dfs.core.windows.net/x",
            ["https://acct.blob.core.windows.net", "https://acct.dfs.core.windows.net"],
        ),
        ("abfs://acct@store.example:10000/c/x?enable_tls=false", ["http://store.example:10000"]),
        ("abfs://acct@Store.Example/c/x?enable_tls=1", ["https://store.example"]),
        # The container form's user info names the account, yet a host with a dot wins.
        ("abfs://x.blob.core.windows.net@evil.example/c", ["https://evil.example"]),
    ],
)
def test_each_scheme_is_read_for_the_hosts_its_client_connects_to(
    uri: str, connects_to: list[str]
) -> None:
    assert uri_origins(uri) == connects_to


def pyarrow_origins(uri: str) -> set[str]:
    """Where pyarrow's own reading of `uri` connects: its filesystem's options, built
    into URLs as pyarrow builds them (`AsGoogleCloudOptions`, `BuildBaseUrl`)."""
    fs, _ = pafs.FileSystem.from_uri(uri)
    options = fs.__reduce__()[1][0]
    if isinstance(fs, pafs.GcsFileSystem):
        override = options["endpoint_override"]
        urls = [
            f"{options['scheme']}://{override}" if override else "https://storage.googleapis.com"
        ]
    else:
        urls = []
        for api in ("blob", "dfs"):
            authority = options[f"{api}_storage_authority"]
            host = options["account_name"] + authority if authority[0] == "." else authority
            urls.append(f"{options[f'{api}_storage_scheme']}://{host}")
    return {str(endpoint_policy.endpoint(url)) for url in urls}


@pytest.mark.parametrize(
    "uri",
    [
        "gs://bucket/x/",
        "gs://b/x?scheme=http",
        "gs://b/x?endpoint_override=store.example:4443&scheme=http",
        "gs://b/x?endpoint%5Foverride=%31%30.0.0.5:9",
        "gs://b/x#?endpoint_override=elsewhere.example:1",
        "abfs://c@acct/x",
        "abfs://%41cct@c/x",
        "abfs://acct.blob.core.windows.net:99/c/x",
        "abfss://c@acct.dfs.core.windows.net/x",
        "abfs://acct@store.example:10000/c/x?enable_tls=FALSE",
        "abfs://acct@store.example:10000/c/x?enable%5Ftls=0",
        "abfs://acct@st%6Fre.example/c/x",
        "abfs://acct@store.example:/c/x",
        "abfs://x.blob.core.windows.net@evil.example/c",
        "abfs://acct@store:10000/c/x",
    ],
)
def test_the_hosts_read_are_those_pyarrow_itself_connects_to(uri: str) -> None:
    """pyarrow builds these filesystems without connecting, and says where they would."""
    assert set(uri_origins(uri)) == pyarrow_origins(uri)


@pytest.mark.parametrize(
    ("uri", "because"),
    [
        # pyarrow keeps the first of two, and Azure's the last: no guessing which.
        ("gs://b/x?endpoint_override=ok.example&endpoint_override=127.0.0.1", "at most once"),
        ("gs://b/x?endpoint_override=http://169.254.169.254/", "endpoint_override=HOST[:PORT]"),
        ("gs://b/x?endpoint_override=ok.example&scheme=ftp", "scheme=http or https"),
        ("hdfs://nn/x?fs.defaultFS=hdfs://169.254.169.254:80", "no query after an hdfs://"),
        ("hdfs://nn/x?user=hdfs", "no query after an hdfs://"),
        ("viewfs://cluster/x?dfs.nameservices=evil", "no query after an viewfs://"),
        ("hdfs:///x", "a host after hdfs://"),
        ("abfs://c@acct/x?blob_storage_authority=evil.example:1", "no blob_storage_authority"),
        ("abfs://c@acct/x?dfs_storage_authority=.evil.example", "no dfs_storage_authority"),
        ("abfs://acct@[fd00::5]:10000/c/x", "pyarrow's Azure client takes no IPv6"),
        ("abfs://acct@store.example/c/x?enable_tls=maybe", "enable_tls=true or false"),
        # Decoded, the account "evil.example/" would put pyarrow's host before the "/".
        ("abfs://evil.example%2F@c/x", "a host name"),
        ("abfs://c/x", "an account"),
    ],
)
def test_a_uri_whose_client_could_go_elsewhere_is_refused_saying_what_fits(
    uri: str, because: str
) -> None:
    message = endpoint_policy.uri_refusal(uri, ())
    assert message is not None and because in message, message
    assert message.startswith(f"the {uri.partition(':')[0]}:// URI ")


def test_an_account_that_is_not_a_name_would_move_pyarrows_host() -> None:
    """Why such an account is refused: pyarrow connects where the account says."""
    assert pyarrow_origins("abfs://evil.example%2F@c/x") == {"https://evil.example"}


@pytest.mark.parametrize(
    ("uri", "why"),
    [
        ("hdfs://169.254.169.254:80/x", "link-local or cloud metadata"),
        ("hdfs://[fe80::1]:8020/x", "link-local or cloud metadata"),
        ("viewfs://127.0.0.1/x", "the operator pod's own loopback"),
        ("gs://b/x?endpoint_override=169.254.169.254", "link-local or cloud"),
        ("gs://b/x?endpoint_override=metadata.google.internal", "a cloud metadata service"),
        ("gs://b/x?endpoint_override=0xa9fea9fe:80", "link-local or cloud"),
        ("gs://b/x?endpoint_override=localhost:8080", "the operator pod's own loopback"),
        ("abfs://acct@169.254.169.254:80/c/x?enable_tls=false", "link-local or cloud"),
        ("abfs://acct@127.0.0.1:10000/c/x", "the operator pod's own loopback"),
        ("abfs://metadata.google.internal/c/x", "a cloud metadata service"),
    ],
)
def test_by_default_each_schemes_metadata_and_loopback_hosts_are_refused(
    uri: str, why: str
) -> None:
    message = endpoint_policy.uri_refusal(uri, ())
    assert message is not None and why in message, message
    assert "policy.sourceEndpoints" in message


@pytest.mark.parametrize(
    "uri",
    [
        "gs://bucket/x/",
        "hdfs://namenode.hadoop.svc:8020/x",
        "abfs://c@acct/x",
        "abfss://c@acct.dfs.core.windows.net/x",
    ],
)
def test_by_default_ordinary_hosts_are_read(uri: str) -> None:
    assert endpoint_policy.uri_refusal(uri, ()) is None


@pytest.mark.parametrize(
    ("uri", "found"),
    [
        ("gs://b/x?endpoint_override=gcs.storage.svc:4443", "https://gcs.storage.svc:4443"),
        ("gs://b/x?endpoint_override=tenant.example", "https://tenant.example"),
        ("abfs://acct@azurite.storage.svc:10000/c/x?enable_tls=false", "http://azurite.storage.svc:10000"),
        ("abfs://acct@container/x?enable_tls=false", "http://acct.blob.core.windows.net"),
    ],
)  # fmt: skip
def test_by_default_the_operators_identity_goes_to_its_clouds_service_only(
    uri: str, found: str
) -> None:
    # The client sends the operator's own token to whatever host it connects to: a
    # tenant's endpoint_override would collect it, whatever its address.
    message = endpoint_policy.uri_refusal(uri, ())
    assert message is not None
    assert f"makes the operator connect to {found}, not " in message
    assert "operator's own cloud identity" in message and "policy.sourceEndpoints" in message


@pytest.mark.parametrize(
    ("uri", "allowed", "listed"),
    [
        ("gs://bucket/x/", "https://storage.googleapis.com", True),
        ("gs://bucket/x/", "https://*.googleapis.com", True),
        ("gs://b/x?endpoint_override=gcs.svc:4443", "https://storage.googleapis.com", False),
        ("gs://b/x?endpoint_override=gcs.svc:4443", "https://gcs.svc:4443", True),
        ("hdfs://namenode/x", "hdfs://namenode:8020", True),
        ("hdfs://namenode:9000/x", "hdfs://namenode", False),
        ("hdfs://namenode/x", "http://namenode:8020", False),
        ("viewfs://cluster/x", "viewfs://cluster", True),
        ("abfs://c@acct/x", "https://*.core.windows.net", True),
        # Both of Azure's APIs are read: the blob host alone is not enough.
        ("abfs://c@acct/x", "https://*.blob.core.windows.net", False),
        ("abfs://acct@azurite.svc:10000/c?enable_tls=false", "http://azurite.svc:10000", True),
        ("abfs://acct@azurite.svc:10000/c", "http://azurite.svc:10000", False),
    ],
)  # fmt: skip
def test_with_a_list_only_listed_hosts_are_read(uri: str, allowed: str, listed: bool) -> None:
    message = endpoint_policy.uri_refusal(uri, origins(allowed))
    if listed:
        assert message is None
    else:
        assert message is not None
        assert f"allows only {endpoint_policy.entry(allowed)}" in message
        assert "policy.sourceEndpoints" in message


def test_a_uri_query_is_never_shown_in_a_refusal() -> None:
    message = endpoint_policy.uri_refusal(
        "abfs://acct@127.0.0.1:1/c/x?sig=hunter2&sv=2020", origins("https://store.example")
    )
    assert message is not None and "hunter2" not in message and "sig=" not in message


def test_without_ambient_credentials_other_schemes_are_refused_as_before() -> None:
    """The policy comes second: without policy.allowAmbientCredentials no host is read."""
    with pytest.raises(reconcile.SourceRefused) as refused:
        sources.storage_options("hdfs://169.254.169.254/x", None, sources.Access())
    assert "policy.allowAmbientCredentials" in str(refused.value)


class TokenServer:
    """A local OAuth2 token endpoint for Google's client: the operator's own identity,
    so that an unchecked gs:// read really connects where the URI says."""

    def __init__(self) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                body = json.dumps({"access_token": "operator-token", "expires_in": 3600,
                                   "token_type": "Bearer"}).encode()  # fmt: skip
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def operator_identity(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Google's default credentials for this process: a user credential whose token
    comes from a local `TokenServer` (the operator pod's ambient identity, in small)."""
    tokens = TokenServer()
    credentials = tmp_path / "credentials.json"
    credentials.write_text(
        json.dumps(
            {
                "type": "authorized_user",
                "client_id": "operator",
                "client_secret": "operator-secret",
                "refresh_token": "operator-refresh",
                "token_uri": f"http://127.0.0.1:{tokens.server.server_address[1]}/token",
            }
        )
    )
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(credentials))
    try:
        yield
    finally:
        tokens.close()


def listened(scheme: str, port: int) -> str:
    """A URI of `scheme` whose client connects to 127.0.0.1:`port` (gs:// over https,
    the others over http)."""
    return {
        "gs": f"gs://b/x?endpoint_override=127.0.0.1:{port}&retry_limit_seconds=1",
        "abfs": f"abfs://acct@127.0.0.1:{port}/c/x?enable_tls=false&credential_kind=anonymous",
        "hdfs": f"hdfs://127.0.0.1:{port}/x",
    }[scheme]


@pytest.mark.usefixtures("operator_identity")
@pytest.mark.parametrize("call", ["resolve", "probe", "applied skips"])
@pytest.mark.parametrize("allowed", [(), ("https://store.example",)])
@pytest.mark.parametrize("scheme", ["gs", "abfs", "hdfs"])
def test_a_refused_host_is_refused_before_any_connection(
    listener: Listener, scheme: str, call: str, allowed: tuple[str, ...]
) -> None:
    uri = listened(scheme, listener.port)
    access = sources.Access(ambient_credentials=True, source_endpoints=origins(*allowed))
    with pytest.raises(reconcile.EndpointRefused) as refused:
        if call == "resolve":
            sources.resolve_manifest(uri, "parquet", None, access=access, retry=ONE_TRY)
        elif call == "probe":
            sources.probe_source(uri, None, access=access, retry=ONE_TRY)
        else:
            sources.applied_skips(uri, None, access=access)
    assert f"127.0.0.1:{listener.port}" in str(refused.value)
    assert refused.value.reason == "EndpointNotAllowed"
    assert listener.accepts == 0


@pytest.mark.usefixtures("operator_identity")
@pytest.mark.parametrize("scheme", ["gs", "abfs"])
def test_a_listed_host_is_connected_to(listener: Listener, scheme: str) -> None:
    """The listener sees the connections the refusal above prevents (hdfs:// needs a
    JVM this machine lacks: no client to connect)."""
    web = "https" if scheme == "gs" else "http"
    access = sources.Access(
        ambient_credentials=True, source_endpoints=origins(f"{web}://127.0.0.1:{listener.port}")
    )
    with pytest.raises(errors.SourceError):
        sources.probe_source(listened(scheme, listener.port), None, access=access, retry=ONE_TRY)
    assert listener.accepts >= 1


@pytest.mark.parametrize("allowed", [(), ("http://gcs.svc:4443",), ("https://gcs.svc:4443",)])
def test_a_gs_uri_over_plain_http_is_refused_listed_or_not(allowed: tuple[str, ...]) -> None:
    # Google's client puts the operator's bearer token on every request, over http too
    # (the next test sees it arrive): anyone on the path could replay it.
    uri = "gs://b/x?endpoint_override=gcs.svc:4443&scheme=http"
    message = endpoint_policy.uri_refusal(uri, origins(*allowed))
    assert message is not None
    assert "connect to http://gcs.svc:4443 over plain http" in message
    assert "clear text" in message and "expected scheme=https" in message


@pytest.mark.usefixtures("operator_identity")
def test_googles_client_sends_the_operators_token_over_plain_http() -> None:
    """Why the refusal above: what pyarrow's GCS client itself sends to an http
    endpoint_override, with the operator's identity ambient (no check of ours between).
    Should a pyarrow upgrade stop sending it, this fails and the refusal can be revisited."""
    headers: list[str | None] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            headers.append(self.headers.get("Authorization"))
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        filesystem, path = pafs.FileSystem.from_uri(
            f"gs://b/x?endpoint_override=127.0.0.1:{port}&scheme=http&retry_limit_seconds=1"
        )
        filesystem.get_file_info(path)
    finally:
        server.shutdown()
        server.server_close()
    assert headers and headers[0] == "Bearer operator-token"
