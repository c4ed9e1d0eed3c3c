"""Which endpoints a tenant's Secret may point the operator at (chart: policy.sourceEndpoints).

A Secret's `AWS_ENDPOINT_URL_S3` or `AWS_ENDPOINT_URL` makes the operator connect, from
its own pod, to whatever host and port it names, and what that address answers can
surface in the mount's status and Events: the cloud metadata service, the operator's own
ports, the API server, another tenant's services (server-side request forgery). So the
endpoint is checked before any connection (`refusal`):

- with the platform's list set, only an endpoint on it (an origin `scheme://host[:port]`,
  or `scheme://*.suffix[:port]` for every host under a DNS suffix) is read;
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
    "https://[fd00::5]:9000 or https://*.s3.example.internal (http or https, a host, "
    "an optional port; no user, path, query or wildcard but a leading '*.')"
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
        port = "" if DEFAULT_PORTS.get(self.scheme) == self.port else f":{self.port}"
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


def _split(text: str) -> urllib.parse.SplitResult:
    parts = urllib.parse.urlsplit(text)
    if parts.scheme.lower() not in DEFAULT_PORTS:
        raise EndpointError("the scheme http:// or https://")
    if "@" in parts.netloc:
        raise EndpointError("no user name or password before the host")
    return parts


def _port(parts: urllib.parse.SplitResult) -> int:
    try:
        port = parts.port
    except ValueError:
        raise EndpointError("a port 1-65535") from None
    if port == 0:
        raise EndpointError("a port 1-65535")
    return port if port is not None else DEFAULT_PORTS[parts.scheme.lower()]


def endpoint(text: str) -> Origin:
    """The origin a Secret's endpoint connects to, as `shardcache.source` reads it
    (`host:port` alone is https; a path is not part of where it connects)."""
    parts = _split(s3_settings.endpoint_url(text.strip()))
    if not parts.hostname:
        raise EndpointError("a host after the scheme")
    host = _host(parts.hostname, bracketed=parts.netloc.startswith("["))
    return Origin(parts.scheme.lower(), host, _port(parts))


def entry(text: str) -> Origin:
    """One entry of the platform's list; `parsers.ParseError` says what fits."""
    try:
        parts = _split(text)
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


def refusal(options: Mapping[str, str], allowed: tuple[Origin, ...]) -> str | None:
    """Why the operator does not connect where `options` (a Secret's data) point it, or
    None. `allowed` is the platform's list; empty, only `_never_a_store` is refused."""
    key = next((k for k in ENDPOINT_KEYS if options.get(k)), None)
    if key is None:
        return region_problem(options)
    where = f"{key} in the Secret named by spec.source.secretRef"
    try:
        origin = endpoint(options[key])
    except EndpointError as exc:
        return f"{where}: expected {exc}, found {uris.redact(options[key])!r}"
    if allowed:
        if any(entry.allows(origin) for entry in allowed):
            return None
        shown = ", ".join(str(e) for e in allowed[:SHOWN_ENTRIES])
        more = len(allowed) - SHOWN_ENTRIES
        shown += f" and {more} more" if more > 0 else ""
        return (
            f"{where} names {origin}, which the platform does not let the operator "
            f"connect to: it allows only {shown} (chart value {CHART_VALUE}); use one of "
            "them, or ask the platform to add yours"
        )
    never = _never_a_store(origin)
    if never is None:
        return None
    return (
        f"{where} names {origin}, {never}, never a tenant's object store: the operator "
        f"does not connect there (a platform lists the endpoints it may connect to in the "
        f"chart value {CHART_VALUE})"
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
