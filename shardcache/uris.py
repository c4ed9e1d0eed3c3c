"""Dataset and checkpoint URIs as they may be shown: never with credentials.

A URI such as `s3://KEY:SECRET@bucket/prefix` carries credentials in its user info.
shardcache refuses such URIs everywhere it reads one (the CRD, the spec parser, the
contract's `URI` parser, `shardcache.source`), because a URI is copied into pod env,
status, events, `/readyz` and logs; credentials belong in the Secret named by
`spec.source.secretRef`, which only the sidecar receives (docs/security.md).

Messages about a URI show `redact(uri)`: the user info and the query string replaced,
so a refusal never echoes what it refused.
"""

from __future__ import annotations

import re

from shardcache import errors

# scheme://[userinfo@]authority: user info is whatever precedes the first "@" of the
# authority (the part before the first "/", "?" or "#").
_USERINFO = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/?#@]*@)")
_QUERY = re.compile(r"[?#].*$", re.DOTALL)

#: Azure's abfs:// names its container there (`abfs://container@account/...`): user
#: info without a ":" is that, not a credential.
_CONTAINER_SCHEMES = ("abfs://", "abfss://")

#: The patterns the CRD's CEL rule matches (RE2, as the API server evaluates it): a
#: URI with user info, and the abfs:// container form that is not one.
USERINFO_CEL_PATTERN = "^[A-Za-z][A-Za-z0-9+.-]*://[^/?#@]*@"
CONTAINER_CEL_PATTERN = "^abfss?://[^/?#@:]*@"

#: What a refusal tells the user to do instead.
ADVICE = (
    "credentials in a URI (user:password@) are refused: put them in the Secret named by "
    "spec.source.secretRef, which only the cache sidecar receives"
)


def has_userinfo(uri: str) -> bool:
    """Whether `uri` carries user info (`scheme://user[:password]@host/...`)."""
    found = _USERINFO.match(uri)
    if found is None:
        return False
    container = found["scheme"].lower() in _CONTAINER_SCHEMES and ":" not in found["userinfo"]
    return not container


def redact(uri: str) -> str:
    """`uri` fit to show: user info replaced by `***@`, query and fragment dropped."""
    text = _USERINFO.sub(r"\g<scheme>***@", uri, count=1) if has_userinfo(uri) else uri
    return _QUERY.sub("", text) if "://" in text else text


def query_or_fragment(uri: str) -> str | None:
    """The "?" or "#" that starts a query or fragment of `uri` (an empty one included:
    "s3://b/x?" drops its "?" as surely as "s3://b/x?y" drops "?y"), or None."""
    _, _, rest = uri.partition("://")
    found = [i for i in (rest.find("?"), rest.find("#")) if i >= 0]
    return rest[min(found)] if found else None


def refuse_userinfo(uri: str, *, where: str) -> None:
    """Raise `InputError` naming `where` (never the credentials) if `uri` has user info."""
    if has_userinfo(uri):
        raise errors.InputError(f"{where}: {redact(uri)}: {ADVICE}")
