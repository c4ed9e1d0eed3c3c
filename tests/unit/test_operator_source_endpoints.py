"""A tenant's Secret points the operator only at endpoints the platform allows (chart
value policy.sourceEndpoints), and never, by default, at the operator pod's loopback or
the cloud metadata service: checked before any connection (docs/security.md)."""

from __future__ import annotations

import dataclasses

import pytest
from shardcache_operator import configuration, endpoint_policy, reconcile, sources

from shardcache import errors, source
from tests.support.listener import Listener

pytestmark = pytest.mark.unit

ONE_TRY = source.RetryPolicy(attempts=1)
KEYS = {"AWS_ACCESS_KEY_ID": "AKIATENANT", "AWS_SECRET_ACCESS_KEY": "tenant-secret"}


def origins(*entries: str) -> tuple[endpoint_policy.Origin, ...]:
    return tuple(endpoint_policy.entry(e) for e in entries)


def listed(options: dict[str, str], *entries: str) -> str | None:
    return endpoint_policy.refusal(options, origins(*entries))


@pytest.mark.parametrize(
    ("text", "normal"),
    [
        ("https://minio.storage.svc:9000", "https://minio.storage.svc:9000"),
        ("HTTPS://MinIO.Storage.SVC:443/", "https://minio.storage.svc"),
        ("http://10.0.0.5", "http://10.0.0.5"),
        ("http://10.0.0.5:80", "http://10.0.0.5"),
        ("https://[FD00:0::5]:9000", "https://[fd00::5]:9000"),
        ("https://*.S3.example.internal", "https://*.s3.example.internal"),
        ("http://store.example.", "http://store.example"),
        # A loopback store may be listed (local clusters, the tests' own server).
        ("http://127.0.0.1:9000", "http://127.0.0.1:9000"),
    ],
)
def test_list_entries_are_read_as_normalised_origins(text: str, normal: str) -> None:
    assert str(endpoint_policy.entry(text)) == normal


@pytest.mark.parametrize(
    ("text", "because"),
    [
        ("ftp://store.example", "the scheme http:// or https://"),
        ("store.example:9000", "the scheme http:// or https://"),
        ("https://store.example/bucket", "no path, query or fragment"),
        ("https://store.example?x=1", "no path, query or fragment"),
        ("https://store.example:0", "a port 1-65535"),
        ("https://store.example:70000", "a port 1-65535"),
        ("https://st*re.example", "a host name"),
        ("https://*.169.254", "a DNS suffix after '*.'"),
        ("https://store/(.*)", "no path"),
        ("http://169.254.169.254", "a link-local or cloud metadata address"),
        ("http://[fe80::1]:80", "a link-local or cloud metadata address"),
        ("http://metadata.google.internal", "a cloud metadata service"),
    ],
)
def test_bad_list_entries_are_refused_saying_what_fits(text: str, because: str) -> None:
    with pytest.raises(errors.InputError) as refused:
        configuration.from_env({"SHARDCACHE_OPERATOR_SOURCE_ENDPOINTS": f"https://ok:9000,{text}"})
    message = str(refused.value)
    assert message.startswith("$SHARDCACHE_OPERATOR_SOURCE_ENDPOINTS: expected an origin like")
    assert because in message and "found" in message, message


def test_an_entry_with_a_password_is_refused_without_showing_it() -> None:
    with pytest.raises(errors.InputError) as refused:
        configuration.from_env({"SHARDCACHE_OPERATOR_SOURCE_ENDPOINTS": "https://u:hunter2@s:1"})
    assert "hunter2" not in str(refused.value)
    assert "no user name or password" in str(refused.value)


def test_the_setting_reads_a_comma_separated_list_and_defaults_to_empty() -> None:
    assert configuration.from_env({}).source_endpoints == ()
    settings = configuration.from_env(
        {"SHARDCACHE_OPERATOR_SOURCE_ENDPOINTS": " https://a.example:9000 , http://b.example "}
    )
    assert [str(o) for o in settings.source_endpoints] == [
        "https://a.example:9000",
        "http://b.example",
    ]
    # What the operator's reads are given (`app`, the skips timer).
    assert sources.access(settings).source_endpoints == settings.source_endpoints
    # A flag's value goes through the same parser, rendered back to its text.
    again = configuration.from_env({}, source_endpoints=settings.source_endpoints)
    assert again.source_endpoints == settings.source_endpoints


@pytest.mark.parametrize(
    "endpoint",
    [
        "https://minio.storage.svc:9000",
        "HTTPS://MINIO.storage.svc:9000/",
        "minio.storage.svc:9000",  # host:port alone is https, as the client reads it
        "https://minio.storage.svc.:9000/bucket",  # the path is not where it connects
    ],
)
def test_a_listed_endpoint_matches_whatever_its_case_slash_or_spelling(endpoint: str) -> None:
    assert listed({"AWS_ENDPOINT_URL": endpoint}, "https://minio.storage.svc:9000") is None


@pytest.mark.parametrize(
    ("endpoint", "entry"),
    [
        ("https://store.example", "https://store.example:443"),
        ("http://store.example:80", "http://store.example"),
        ("https://[fd00::5]:9000", "https://[fd00:0:0::5]:9000"),
        ("https://a.b.s3.example.internal", "https://*.s3.example.internal"),
    ],
)
def test_default_ports_ipv6_spellings_and_suffixes_match(endpoint: str, entry: str) -> None:
    assert listed({"AWS_ENDPOINT_URL": endpoint}, entry) is None


@pytest.mark.parametrize(
    ("endpoint", "entry"),
    [
        ("http://store.example", "https://store.example"),  # another scheme
        ("https://store.example:9000", "https://store.example"),  # another port
        ("https://s3.example.internal", "https://*.s3.example.internal"),  # the suffix itself
        ("https://evils3.example.internal", "https://*.s3.example.internal"),
        ("https://store.example.evil", "https://store.example"),
        ("https://10.0.0.5", "https://*.0.0.5.example"),
    ],
)
def test_an_endpoint_not_on_the_list_is_refused_naming_it_and_the_list(
    endpoint: str, entry: str
) -> None:
    message = listed({"AWS_ENDPOINT_URL": endpoint}, entry)
    assert message is not None
    assert str(endpoint_policy.endpoint(endpoint)) in message
    assert f"allows only {endpoint_policy.entry(entry)}" in message
    assert "policy.sourceEndpoints" in message


def test_a_long_list_is_shown_in_part_and_counted() -> None:
    entries = [f"https://store{i}.example" for i in range(8)]
    message = listed({"AWS_ENDPOINT_URL": "https://other.example"}, *entries)
    assert message is not None
    assert "https://store4.example and 3 more" in message
    assert "store5" not in message


def test_the_s3_specific_endpoint_is_the_one_checked_as_the_client_reads_it_first() -> None:
    options = {
        "AWS_ENDPOINT_URL": "https://minio.storage.svc:9000",
        "AWS_ENDPOINT_URL_S3": "http://169.254.169.254",
    }
    message = listed(options, "https://minio.storage.svc:9000")
    assert message is not None and message.startswith("AWS_ENDPOINT_URL_S3 ")


def test_user_info_in_an_endpoint_is_never_echoed() -> None:
    message = listed(
        {"AWS_ENDPOINT_URL": "https://tenant:hunter2@169.254.169.254"}, "https://store.example"
    )
    assert message is not None
    assert "hunter2" not in message and "tenant" not in message


@pytest.mark.parametrize(
    "endpoint",
    [
        "http://169.254.169.254",
        "http://169.254.169.254:80/latest/meta-data/",
        "http://2852039166",  # the same address as one number, as a resolver reads it
        "http://0xa9fea9fe",
        "http://0251.0376.0251.0376",
        "http://[fe80::1%25eth0]:9000",
        "http://[::ffff:169.254.169.254]",
        "http://[fd00:ec2::254]",
        "http://metadata.google.internal",
        "http://METADATA.google.internal.",
        "http://100.100.100.200",
    ],
)
def test_by_default_the_metadata_service_is_refused(endpoint: str) -> None:
    message = listed({"AWS_ENDPOINT_URL": endpoint})
    assert message is not None
    assert "metadata" in message and "policy.sourceEndpoints" in message


@pytest.mark.parametrize(
    "endpoint",
    ["http://127.0.0.1:8080", "http://127.1:9443", "localhost:8080", "http://[::1]:8080",
     "http://0.0.0.0:8080", "http://api.localhost"],
)  # fmt: skip
def test_by_default_the_operator_pods_own_loopback_is_refused(endpoint: str) -> None:
    message = listed({"AWS_ENDPOINT_URL": endpoint})
    assert message is not None and "the operator pod's own loopback" in message


@pytest.mark.parametrize(
    "endpoint",
    ["https://minio.storage.svc:9000", "http://10.0.0.5:9000", "https://[fd00::5]:9000"],
)
def test_by_default_ordinary_endpoints_are_read(endpoint: str) -> None:
    assert listed({"AWS_ENDPOINT_URL": endpoint}) is None


def test_a_region_that_would_choose_another_host_is_refused() -> None:
    """Without an endpoint the client builds AWS's host from the region."""
    assert listed({"AWS_REGION": "eu-west-1"}) is None
    message = listed({"AWS_REGION": "x.evil.example:80/"})
    assert message is not None and "AWS_REGION" in message and "evil" not in message
    # With an endpoint the region only signs requests.
    assert listed({"AWS_ENDPOINT_URL": "https://s.example", "AWS_REGION": "any.thing"}) is None


@pytest.mark.parametrize("call", ["resolve", "probe", "applied skips"])
@pytest.mark.parametrize("allowed", [(), ("https://store.example",)])
def test_a_refused_endpoint_is_refused_before_any_connection(
    listener: Listener, call: str, allowed: tuple[str, ...]
) -> None:
    secret = {**KEYS, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{listener.port}"}
    access = sources.Access(source_endpoints=origins(*allowed))
    with pytest.raises(reconcile.EndpointRefused) as refused:
        if call == "resolve":
            sources.resolve_manifest("s3://b/x/", "parquet", secret, access=access, retry=ONE_TRY)
        elif call == "probe":
            sources.probe_source("s3://b/x/", secret, access=access, retry=ONE_TRY)
        else:  # the timer that reads spec.checkpoint.uri with the same Secret
            sources.applied_skips("s3://b/ckpt/", secret, access=access)
    assert f"127.0.0.1:{listener.port}" in str(refused.value)
    assert refused.value.reason == "EndpointNotAllowed"
    assert listener.accepts == 0


def test_a_listed_endpoint_is_connected_to(listener: Listener) -> None:
    """The listener sees the connection the refusal above prevents."""
    secret = {**KEYS, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{listener.port}"}
    access = sources.Access(source_endpoints=origins(f"http://127.0.0.1:{listener.port}"))
    with pytest.raises(errors.SourceError):
        sources.probe_source("s3://b/x/", secret, access=access, retry=ONE_TRY)
    assert listener.accepts >= 1


@pytest.mark.parametrize(
    ("options", "allowed", "suffix"),
    [
        ({}, ("https://minio.storage.svc:9000",), "amazonaws.com"),
        ({"AWS_REGION": "eu-west-1"}, ("https://s3.eu-west-1.amazonaws.com",), "amazonaws.com"),
        ({"AWS_DEFAULT_REGION": "us-east-1"}, ("http://*.amazonaws.com",), "amazonaws.com"),
        ({"AWS_REGION": "cn-north-1"}, ("https://*.amazonaws.com",), "amazonaws.com.cn"),
        ({**KEYS}, ("https://*.s3.amazonaws.com",), "amazonaws.com"),
    ],
)
def test_with_a_list_no_endpoint_is_aws_itself_which_the_list_must_allow_whole(
    options: dict[str, str], allowed: tuple[str, ...], suffix: str
) -> None:
    """Region, bucket and redirects choose AWS's host, so one regional host listed is
    no promise that the client connects there: only every host under AWS's suffix is."""
    message = listed(options, *allowed)
    assert message is not None
    assert f"a host under {suffix}" in message
    assert f"ask the platform to add https://*.{suffix}" in message
    assert f"allows only {endpoint_policy.entry(allowed[0])}" in message


@pytest.mark.parametrize(
    ("options", "allowed"),
    [
        ({}, "https://*.amazonaws.com"),
        ({"AWS_REGION": "eu-west-1", **KEYS}, "https://*.amazonaws.com"),
        ({}, "https://*.com"),
        ({"AWS_REGION": "cn-north-1"}, "https://*.amazonaws.com.cn"),
    ],
)
def test_with_a_list_allowing_all_of_aws_no_endpoint_is_read(
    options: dict[str, str], allowed: str
) -> None:
    assert listed(options, "https://minio.storage.svc:9000", allowed) is None


def test_without_a_list_no_endpoint_is_read_as_before() -> None:
    assert listed({}) is None and listed({**KEYS, "AWS_REGION": "eu-west-1"}) is None


@pytest.mark.parametrize("call", ["resolve", "probe", "applied skips"])
def test_with_a_list_a_source_without_a_secret_is_refused_before_any_request(call: str) -> None:
    """Anonymous, to AWS S3 itself: not a listed origin (no network here: a request
    would fail otherwise, as SourceError, not EndpointRefused)."""
    access = sources.Access(source_endpoints=origins("https://minio.storage.svc:9000"))
    with pytest.raises(reconcile.EndpointRefused) as refused:
        if call == "resolve":
            sources.resolve_manifest("s3://b/x/", "parquet", None, access=access, retry=ONE_TRY)
        elif call == "probe":
            sources.probe_source("s3://b/x/", None, access=access, retry=ONE_TRY)
        else:
            sources.applied_skips("s3://b/ckpt/", None, access=access)
    assert str(refused.value).startswith("spec.source names no secretRef: no AWS_ENDPOINT_URL_S3")
    assert refused.value.reason == "EndpointNotAllowed"


def test_with_a_list_allowing_aws_a_source_without_a_secret_is_read_anonymously() -> None:
    access = sources.Access(source_endpoints=origins("https://*.amazonaws.com"))
    assert sources.storage_options("s3://b/x/", None, access) == {}


def test_with_ambient_credentials_the_operators_own_endpoint_is_held_to_a_set_list(
    listener: Listener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a Secret the S3 client reads the operator's environment: the platform's
    settings, trusted without a list, held to it with one."""
    for name, value in {**KEYS, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{listener.port}"}.items():
        monkeypatch.setenv(name, value)
    ambient = sources.Access(ambient_credentials=True)
    assert sources.storage_options("s3://b/x/", None, ambient) is None
    listing = dataclasses.replace(ambient, source_endpoints=origins("https://store.example"))
    with pytest.raises(reconcile.EndpointRefused) as refused:
        sources.probe_source("s3://b/x/", None, access=listing, retry=ONE_TRY)
    assert "AWS_ENDPOINT_URL in the operator's own environment" in str(refused.value)
    assert listener.accepts == 0
    # The positive control: listed, the operator's own endpoint is connected to.
    listing = dataclasses.replace(
        ambient, source_endpoints=origins(f"http://127.0.0.1:{listener.port}")
    )
    with pytest.raises(errors.SourceError):
        sources.probe_source("s3://b/x/", None, access=listing, retry=ONE_TRY)
    assert listener.accepts >= 1
