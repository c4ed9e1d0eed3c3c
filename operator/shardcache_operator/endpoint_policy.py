"""Which endpoints a tenant's source may point the operator at (chart: policy.sourceEndpoints).

A Secret's `AWS_ENDPOINT_URL_S3` or `AWS_ENDPOINT_URL`, and the host (or a query key) of
a gs://, hdfs:// or abfs:// URI, make the operator connect, from its own pod, to whatever
host and port they name, and what that address answers can surface in the mount's
status and Events: the cloud metadata service, the operator's own ports, the API server,
another tenant's services (server-side request forgery); for the other schemes with the
operator's own cloud identity. So each endpoint is checked before any connection
(`refusal`, `uri_refusal`):

- with the platform's list set, only an endpoint on it (an origin `scheme://host[:port]`,
  or `scheme://*.suffix[:port]` for every host under a DNS suffix) is read, AWS S3
  itself included (no endpoint named: `aws_refusal`);
- with no list (the default), any endpoint is read but those that are never a tenant's
  object store: link-local addresses (169.254.0.0/16, fe80::/10: cloud metadata), known
  metadata addresses and names, and the operator pod's own loopback (127.0.0.0/8, ::1,
  `localhost`) and unspecified (0.0.0.0, ::) addresses.

Names are compared as written, never resolved: a check that resolved a name and let the
S3 client resolve it again later could be answered differently the second time (DNS
rebinding). A name that resolves to an internal address is kept out by the list (names
the platform chose, in DNS it controls) or by an egress NetworkPolicy, not here
(docs/security.md).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
import socket
import urllib.parse
from collections.abc import Mapping

from shardcache import contract, s3_settings, uris
from shardcache.contract import parsers

#: The chart value that sets the list, named in every refusal.
CHART_VALUE = "policy.sourceEndpoints"
#: The Secret keys that choose the host the S3 client connects to, in the order it reads
#: them (`shardcache.source`): the first one set is the endpoint. Without either, the
#: client goes to AWS S3's own regional endpoint, whose host the region can change
#: (`region_problem`). The Secret cannot set a proxy: `source.check_storage_options`
#: refuses every other key.
ENDPOINT_KEYS = (contract.ENV_S3_ENDPOINT_S3, contract.ENV_S3_ENDPOINT)
REGION_KEYS = (contract.ENV_S3_REGION, contract.ENV_S3_DEFAULT_REGION)
DEFAULT_PORTS = {"http": 80, "https": 443}
#: Schemes a list entry may have: the endpoints' (`DEFAULT_PORTS`), and a Hadoop
#: namenode's for hdfs:// and viewfs:// sources (8020: Hadoop's default RPC port).
ENTRY_PORTS = {**DEFAULT_PORTS, "hdfs": 8020, "viewfs": 8020}
#: How many of the list's entries a refusal shows; the rest are counted.
SHOWN_ENTRIES = 5

#: Metadata services outside link-local: Alibaba Cloud's, and AWS's IPv6 one.
_METADATA_ADDRESSES = frozenset(
    {ipaddress.ip_address("100.100.100.200"), ipaddress.ip_address("fd00:ec2::254")}
)
_LOOPBACK = "the operator pod's own loopback"
#: Names of metadata services that resolve inside a cloud's pods.
_METADATA_NAMES = frozenset({"metadata", "metadata.google.internal", "instance-data"})
_LABEL = r"(?!-)[a-z0-9_-]{1,63}(?<!-)"
_NAME = re.compile(rf"{_LABEL}(\.{_LABEL})*")
#: A host an S3 region may put into AWS's endpoint (s3.REGION.amazonaws.com).
_REGION = re.compile(r"[a-z0-9][a-z0-9-]{0,62}", re.IGNORECASE)
ENTRY_EXPECTED = (
    "an origin like https://minio.storage.svc:9000, http://10.0.0.5:9000, "
    "https://[fd00::5]:9000, https://*.s3.example.internal or hdfs://namenode:8020 "
    "(http, https, hdfs or viewfs, a host, an optional port; no user, path, query or "
    "wildcard but a leading '*.')"
)


@dataclasses.dataclass(frozen=True)
class Origin:
    """An endpoint as the client connects to it: scheme, host (lower case, IPv6
    compressed, no brackets or trailing dot) and port (the scheme's default if none)."""

    scheme: str
    host: str
    port: int
    #: An entry `*.suffix`: `host` is the suffix, matched by every name below it.
    wildcard: bool = False

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        host = f"*.{host}" if self.wildcard else host
        port = "" if ENTRY_PORTS.get(self.scheme) == self.port else f":{self.port}"
        return f"{self.scheme}://{host}{port}"

    def allows(self, endpoint: Origin) -> bool:
        if (self.scheme, self.port) != (endpoint.scheme, endpoint.port):
            return False
        if not self.wildcard:
            return self.host == endpoint.host
        # An address literal is never "under" a DNS suffix, even one of digits.
        return _address(endpoint.host) is None and endpoint.host.endswith("." + self.host)


class EndpointError(ValueError):
    """Text that is not an endpoint; the message says what was expected, never the text
    (it may hold a password)."""


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """`host` as an address, if it is one in any form a resolver takes: glibc reads
    2852039166, 0xa9fea9fe and 0251.0376.0251.0376 as 169.254.169.254."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    if all(re.fullmatch(r"0x[0-9a-f]*|[0-9]+", part) for part in host.split(".")):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    return None


def _host(netloc_host: str, *, bracketed: bool) -> str:
    """The host of a URL, normalised; `EndpointError` when it is not a name or address."""
    host = urllib.parse.unquote(netloc_host).lower().rstrip(".")
    if bracketed:
        try:
            v6 = ipaddress.IPv6Address(host)
        except ValueError:
            raise EndpointError("an IPv6 address between '[' and ']'") from None
        return str(ipaddress.IPv6Address(int(v6)))  # drops a zone (%eth0)
    address = _address(host)
    if address is not None:
        return str(address)
    if not _NAME.fullmatch(host):
        raise EndpointError("a host name (letters, digits, '-', '.'), an IPv4 or [IPv6] address")
    return host


def _parts_host(parts: urllib.parse.SplitResult, *, missing: str) -> str:
    """The host of a split URL, normalised (`_host`); `EndpointError(missing)` (what
    was expected) when it names none."""
    if not parts.hostname:
        raise EndpointError(missing)
    netloc = parts.netloc.rpartition("@")[2]
    return _host(parts.hostname, bracketed=netloc.startswith("["))


def _split(text: str, schemes: Mapping[str, int] = DEFAULT_PORTS) -> urllib.parse.SplitResult:
    parts = urllib.parse.urlsplit(text)
    if parts.scheme.lower() not in schemes:
        raise EndpointError(f"the scheme {' or '.join(f'{s}://' for s in schemes)}")
    if "@" in parts.netloc:
        raise EndpointError("no user name or password before the host")
    return parts


def _port(parts: urllib.parse.SplitResult, default: int | None = None) -> int:
    """The port `parts` names, else `default`, else its scheme's (`ENTRY_PORTS`)."""
    try:
        port = parts.port
    except ValueError:
        raise EndpointError("a port 1-65535") from None
    if port == 0:
        raise EndpointError("a port 1-65535")
    if port is not None:
        return port
    return default if default is not None else ENTRY_PORTS[parts.scheme.lower()]


def endpoint(text: str) -> Origin:
    """The origin a Secret's endpoint connects to, as `shardcache.source` reads it
    (`host:port` alone is https; a path is not part of where it connects)."""
    parts = _split(s3_settings.endpoint_url(text.strip()))
    host = _parts_host(parts, missing="a host after the scheme")
    return Origin(parts.scheme.lower(), host, _port(parts))


def entry(text: str) -> Origin:
    """One entry of the platform's list; `parsers.ParseError` says what fits."""
    try:
        parts = _split(text, ENTRY_PORTS)
        if (
            parts.path not in ("", "/")
            or parts.query
            or parts.fragment
            or "?" in text
            or "#" in text
        ):
            raise EndpointError("no path, query or fragment")
        wildcard = parts.netloc.startswith("*.")
        hostname = parts.hostname or ""
        host = _host(hostname[2:] if wildcard else hostname, bracketed=parts.netloc.startswith("["))
        if not host or "*" in host:
            raise EndpointError("a host")
        if wildcard and (_address(host) is not None or not re.search("[a-z]", host.split(".")[-1])):
            raise EndpointError("a DNS suffix after '*.' (its last label has a letter)")
        origin = Origin(parts.scheme.lower(), host, _port(parts), wildcard=wildcard)
    except EndpointError as exc:
        raise parsers.ParseError(ENTRY_EXPECTED, f"{_shown(text)} (expected {exc})") from None
    never = _never_a_store(origin) if not wildcard else None
    if never is not None and never != _LOOPBACK:
        # Listing the metadata service would hand it to every tenant: no store lives there.
        raise parsers.ParseError(ENTRY_EXPECTED, f"{_shown(text)} ({never}: no store is there)")
    return origin


def _shown(text: str) -> str:
    """An entry as a message may show it: without user info."""
    return repr(re.sub(r"//[^/@]*@", "//***@", text))


def entries(text: str) -> tuple[Origin, ...]:
    """The list as `$SHARDCACHE_OPERATOR_SOURCE_ENDPOINTS` holds it: comma-separated."""
    return tuple(entry(word) for word in parsers.words(text))


PARSER: parsers.Parser[tuple[Origin, ...]] = parsers.Parser(
    "comma-separated origins (scheme://host[:port])", entries
)


def _never_a_store(origin: Origin) -> str | None:
    """Why no tenant's store is at `origin`'s host (the default refuses it), or None."""
    address = _address(origin.host)
    if address is None:
        if origin.host in _METADATA_NAMES:
            return "a cloud metadata service"
        if origin.host == "localhost" or origin.host.endswith(".localhost"):
            return _LOOPBACK
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address.is_link_local or address in _METADATA_ADDRESSES:
        return "a link-local or cloud metadata address"
    # 0.0.0.0 and :: reach the local host too.
    if address.is_loopback or address.is_unspecified:
        return _LOOPBACK
    return None


#: Where the S3 client's settings come from, as a refusal names it.
SECRET = "the Secret named by spec.source.secretRef"
NO_SECRET = "spec.source names no secretRef"
ENVIRONMENT = (
    "the operator's own environment (read without a secretRef, as "
    "policy.allowAmbientCredentials allows)"
)


def refusal(
    options: Mapping[str, str], allowed: tuple[Origin, ...], *, whence: str = SECRET
) -> str | None:
    """Why the operator does not connect where `options` (a Secret's data, or what the
    S3 client reads instead) point it, or None. `allowed` is the platform's list; empty,
    only `_never_a_store` is refused."""
    key = next((k for k in ENDPOINT_KEYS if options.get(k)), None)
    if key is None:
        return region_problem(options) or aws_refusal(options, allowed, whence=whence)
    where = f"{key} in {whence}"
    try:
        origin = endpoint(options[key])
    except EndpointError as exc:
        return f"{where}: expected {exc}, found {uris.redact(options[key])!r}"
    return _held_to(origin, allowed, f"{where} names {origin}")


def _held_to(origin: Origin, allowed: tuple[Origin, ...], named: str) -> str | None:
    """Why the operator does not connect to `origin` (`named` says who chose it), or None."""
    if allowed:
        if any(entry.allows(origin) for entry in allowed):
            return None
        return (
            f"{named}, which the platform does not let the operator connect to: it allows "
            f"only {_shown_list(allowed)} (chart value {CHART_VALUE}); use one of them, or "
            "ask the platform to add yours"
        )
    never = _never_a_store(origin)
    if never is None:
        return None
    return (
        f"{named}, {never}, never a tenant's object store: the operator does not connect "
        f"there (a platform lists the endpoints it may connect to in the chart value "
        f"{CHART_VALUE})"
    )


def _shown_list(allowed: tuple[Origin, ...]) -> str:
    shown = ", ".join(str(e) for e in allowed[:SHOWN_ENTRIES])
    more = len(allowed) - SHOWN_ENTRIES
    return shown + (f" and {more} more" if more > 0 else "")


def aws_suffix(options: Mapping[str, str]) -> str:
    """The DNS suffix of every host AWS's S3 client may use without an endpoint: the
    China regions' partition has its own."""
    region = next((options[k] for k in REGION_KEYS if options.get(k)), "")
    return "amazonaws.com.cn" if region.lower().startswith("cn-") else "amazonaws.com"


def aws_refusal(
    options: Mapping[str, str], allowed: tuple[Origin, ...], *, whence: str = SECRET
) -> str | None:
    """Without an endpoint the S3 client connects to AWS S3 itself; with a list set, only
    if the list allows every name under AWS's suffix (`https://*.amazonaws.com`).

    Which host the client picks is the SDK's choice, not one `options` fix: the region
    (or, without one, the SDK's default from the operator's environment) and the bucket
    (virtual-host addressing, the legacy global endpoint for us-east-1, the region a
    redirect names) all change it. A list naming one regional host would be matched
    against a guess, so it allows no such read; the refusal says what to list."""
    if not allowed:
        return None
    suffix = aws_suffix(options)
    if any(_allows_every_name_under(entry, suffix) for entry in allowed):
        return None
    return (
        f"{whence}: no {' or '.join(ENDPOINT_KEYS)}, so the S3 client would "
        f"connect to AWS S3 itself (https://, a host under {suffix} that the region and the "
        "bucket choose), which the platform does not let the operator connect to: it allows "
        f"only {_shown_list(allowed)} (chart value {CHART_VALUE}); name one of them as "
        f"AWS_ENDPOINT_URL in the Secret named by spec.source.secretRef, or ask the platform "
        f"to add https://*.{suffix}"
    )


def _allows_every_name_under(entry: Origin, suffix: str) -> bool:
    return (
        entry.wildcard
        and (entry.scheme, entry.port) == ("https", 443)
        and (suffix == entry.host or suffix.endswith("." + entry.host))
    )


def region_problem(options: Mapping[str, str]) -> str | None:
    """Without an endpoint the S3 client builds AWS's host from the region
    (s3.REGION.amazonaws.com): a region that is not a plain name (`x.evil.example:80/`)
    would choose another host."""
    key = next((k for k in REGION_KEYS if options.get(k)), None)
    if key is None or _REGION.fullmatch(options[key]):
        return None
    return (
        f"{key} in the Secret named by spec.source.secretRef: expected a region name "
        "(letters, digits and '-', like us-east-1), found a value that is not one (not shown)"
    )


# Sources other than s3:// (read only with policy.allowAmbientCredentials): pyarrow's
# `FileSystem.from_uri` takes the host, and for some schemes query keys, from the URI
# itself, so the tenant's URI chooses where the operator connects with its own cloud
# identity. `uri_origins` reads each URI as pyarrow's `GcsOptions::FromUri`,
# `HdfsOptions::FromUri` and `AzureOptions::FromUri` do (arrow/cpp/src/arrow/filesystem;
# tests/unit/test_operator_source_uri_endpoints.py holds it to pyarrow's own reading).

#: Where GCS's client connects without `endpoint_override`.
GCS_DEFAULT = Origin("https", "storage.googleapis.com", 443)
#: Azure's default authorities: a host ACCOUNT + authority for each of its two APIs
#: (an AzureFileSystem talks to both).
AZURE_SUFFIXES = (".blob.core.windows.net", ".dfs.core.windows.net")
#: Query keys that would send Azure's client to another host than the URI's: refused
#: outright, since the URI's own host says the same (abfs://ACCOUNT@HOST:PORT/CONTAINER)
#: and is checked.
AZURE_AUTHORITY_KEYS = ("blob_storage_authority", "dfs_storage_authority")
#: The host:port `endpoint_override` may hold: nothing that could carry a scheme, a path
#: or user info for the client to read otherwise than this module.
_HOST_PORT = re.compile(r"([A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\])(:[0-9]{1,5})?")


def uri_refusal(uri: str, allowed: tuple[Origin, ...]) -> str | None:
    """Why the operator does not read `uri` (gs, gcs, hdfs, viewfs, abfs, abfss) where it
    would connect, or None: each host the URI makes pyarrow's client connect to is held
    to the list (or, empty, to `_never_a_store`), before any connection; and with no
    list, a gs:// or abfs:// URI reaches its cloud's own service only (`_services_only`)."""
    scheme = uri.partition("://")[0].lower()
    named = f"the {scheme}:// URI {uris.redact(uri)!r}"
    try:
        origins = uri_origins(uri)
    except EndpointError as exc:
        return f"{named}: expected {exc}"
    clear = _in_clear(scheme, origins)
    if clear is not None:
        return f"{named} {clear}"
    for origin in origins:
        problem = _held_to(origin, allowed, f"{named} makes the operator connect to {origin}")
        if problem is not None:
            return problem
    if not allowed:
        elsewhere = _services_only(scheme, origins)
        if elsewhere is not None:
            return f"{named} {elsewhere}"
    return None


def _in_clear(scheme: str, origins: tuple[Origin, ...]) -> str | None:
    """Why a gs:// URI may not send the operator over plain http, listed or not, or None.
    Google's client adds the operator's own bearer token to every request, `scheme=http`
    too (a test sees it arrive), so anyone on the path could take and replay it. Azure's
    client refuses a bearer token over http by itself, and an hdfs:// namenode gets no
    token."""
    if scheme not in ("gs", "gcs"):
        return None
    plain = [o for o in origins if o.scheme == "http"]
    if not plain:
        return None
    return (
        f"makes the operator connect to {plain[0]} over plain http: Google's client would "
        "send the operator's own cloud identity (its bearer token) there in clear text; "
        "expected scheme=https (or no scheme) with endpoint_override"
    )


def _services_only(scheme: str, origins: tuple[Origin, ...]) -> str | None:
    """Why a gs:// or abfs:// URI may not send the operator elsewhere than its cloud's
    own service without a list, or None. Those clients send the operator's own cloud
    identity (its token) to whatever host they connect to: an `endpoint_override`, or an
    abfs:// host of the tenant's, would hand it to a server the tenant runs, whatever
    its address. An hdfs:// URI has no such service: its namenode is always the URI's."""
    if scheme in ("gs", "gcs"):
        other = [o for o in origins if o != GCS_DEFAULT]
        service = str(GCS_DEFAULT)
    elif scheme in ("abfs", "abfss"):
        other = [
            o
            for o in origins
            if (o.scheme, o.port) != ("https", 443) or not o.host.endswith(AZURE_SUFFIXES)
        ]
        service = "https://ACCOUNT.blob.core.windows.net and https://ACCOUNT.dfs.core.windows.net"
    else:
        return None
    if not other:
        return None
    return (
        f"makes the operator connect to {other[0]}, not {service}: its client would send "
        "the operator's own cloud identity there, and with no list (chart value "
        f"{CHART_VALUE}) the operator sends it to its cloud's own service only; a "
        "platform that runs such a store lists it"
    )


def uri_origins(uri: str) -> tuple[Origin, ...]:
    """Every origin pyarrow's client connects to for `uri`; `EndpointError` for a URI
    whose host this module does not read as pyarrow does, or that names a host in a
    query key it refuses."""
    try:
        parts = urllib.parse.urlsplit(uri)
    except ValueError:
        raise EndpointError("a URI whose host is a name or an address") from None
    scheme = parts.scheme.lower()
    query = _query(parts.query)
    if scheme in ("gs", "gcs"):
        return (_gcs_origin(query),)
    if scheme in ("hdfs", "viewfs"):
        if query:
            # Every key pyarrow does not know goes to Hadoop's configuration
            # (`extra_conf`), where fs.defaultFS or a nameservice's addresses name other
            # namenodes; `user` and `kerb_ticket` choose the identity.
            raise EndpointError(
                f"no query after an {scheme}:// URI (found the keys {sorted(query)}: Hadoop "
                "would read them as its configuration, which can name other namenodes)"
            )
        host = _uri_host(parts, scheme)
        return (Origin(scheme, host, _port(parts, ENTRY_PORTS[scheme])),)
    if scheme in ("abfs", "abfss"):
        return _azure_origins(parts, query)
    raise EndpointError(f"a URI of a scheme this check reads (found {scheme}://)")


def _query(text: str) -> dict[str, str]:
    """Query items decoded as pyarrow decodes them ('+' a space, '%XX' once), each key
    at most once: pyarrow's filesystems disagree which of two wins (GCS the first, Azure
    the last)."""
    items = urllib.parse.parse_qsl(text, keep_blank_values=True)
    keys = [k for k, _ in items]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise EndpointError(f"each query key at most once (found {twice} more than once)")
    return dict(items)


def _gcs_origin(query: Mapping[str, str]) -> Origin:
    override = query.get("endpoint_override", "")
    if not override:
        # `scheme` alone changes only the credentials, not the host (`AsGoogleCloudOptions`).
        return GCS_DEFAULT
    scheme = query.get("scheme") or "https"
    if scheme not in DEFAULT_PORTS or not _HOST_PORT.fullmatch(override):
        raise EndpointError(
            "endpoint_override=HOST[:PORT] and scheme=http or https (found another form: not shown)"
        )
    return endpoint(f"{scheme}://{override}")


def _uri_host(parts: urllib.parse.SplitResult, scheme: str) -> str:
    return _parts_host(parts, missing=f"a host after {scheme}:// (the default one is not read)")


def _azure_origins(parts: urllib.parse.SplitResult, query: Mapping[str, str]) -> tuple[Origin, ...]:
    refused = [k for k in AZURE_AUTHORITY_KEYS if k in query]
    if refused:
        raise EndpointError(
            f"no {' or '.join(refused)} in the URI: write the store's host in it instead "
            "(abfs://ACCOUNT@HOST:PORT/CONTAINER/PATH), which is checked"
        )
    userinfo, _, hostport = parts.netloc.rpartition("@")
    if hostport.startswith("["):
        # pyarrow builds Azure's URL from the host without its brackets, and the Azure
        # SDK then aborts the whole process (std::invalid_argument from stoi).
        raise EndpointError("a host name or IPv4 address (pyarrow's Azure client takes no IPv6)")
    tls = query.get("enable_tls", "true").lower()
    if tls not in ("true", "1", "false", "0"):
        raise EndpointError("enable_tls=true or false (found another value: not shown)")
    scheme = "https" if tls in ("true", "1") else "http"
    # pyarrow matches its suffixes against the decoded host as written (case and all),
    # and reads a host with a port or a dot as the store's own.
    host_text, _, port_text = hostport.rpartition(":") if ":" in hostport else (hostport, "", "")
    host = urllib.parse.unquote(host_text)
    account = urllib.parse.unquote(userinfo)
    for suffix in AZURE_SUFFIXES:
        if host.endswith(suffix):
            account = host[: -len(suffix)]
            break
    else:
        if "." in host or port_text:
            # abfs://[ACCOUNT@]HOST[:PORT]/CONTAINER: that host serves both APIs.
            port = _port(parts, DEFAULT_PORTS[scheme])
            return (Origin(scheme, _uri_host(parts, parts.scheme), port),)
    if not account or "%" in account:
        raise EndpointError("an account (abfs://CONTAINER@ACCOUNT.dfs.core.windows.net/PATH)")
    # The account becomes part of each host: one that is not a plain name would move it
    # (an account "evil.example/" connects to evil.example).
    return tuple(
        Origin(scheme, _host(account + suffix, bracketed=False), DEFAULT_PORTS[scheme])
        for suffix in AZURE_SUFFIXES
    )
