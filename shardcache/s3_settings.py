"""S3 settings that no request could get past, found before one is made.

The S3 client reads the usual AWS variables from a Secret's data (the operator), a
sidecar's environment (made from that Secret by `envFrom`) or a process environment
(embedded mode). A key pasted with its newline, one of the key pair without the other,
or a password in the endpoint URL would each fail every request with an error that
names none of them (a 400, "access denied", "could not resolve host: USER"), or read
anonymously without a word. `problem` says which variable is wrong, never its value.
"""

from __future__ import annotations

from collections.abc import Mapping

from shardcache import contract, uris

#: The S3 settings `shardcache.source` reads; each is refused with whitespace around it.
VARIABLES = (
    contract.ENV_S3_ACCESS_KEY_ID,
    contract.ENV_S3_SECRET_ACCESS_KEY,
    contract.ENV_S3_SESSION_TOKEN,
    contract.ENV_S3_ENDPOINT_S3,
    contract.ENV_S3_ENDPOINT,
    contract.ENV_S3_REGION,
    contract.ENV_S3_DEFAULT_REGION,
)
#: The variables of an access key, both needed to sign a request.
KEY_PAIR = (contract.ENV_S3_ACCESS_KEY_ID, contract.ENV_S3_SECRET_ACCESS_KEY)


def endpoint_url(endpoint: str) -> str:
    """`endpoint` (AWS_ENDPOINT_URL) as a URL: `host:port` alone means https."""
    return endpoint if "://" in endpoint else f"https://{endpoint}"


def problem(env: Mapping[str, str], *, origin: str, pair: bool) -> str | None:
    """What is wrong with the S3 settings in `env`, or None; it names the variable,
    never its value (a key, a password in an endpoint).

    `origin` says where `env` came from in the message ("Secret ml/s3-credentials").
    `pair`: `env` is a Secret's data (or a sidecar's environment made from one), so
    `AWS_ACCESS_KEY_ID` and `AWS_SECRET_ACCESS_KEY` come both or neither (neither reads
    anonymously); else it is a process environment, where a secret key without a key
    id may be a profile's business, and only a key id without its secret is refused.
    """
    key_id, secret = KEY_PAIR
    for name in VARIABLES:
        value = env.get(name)
        if value and value != value.strip():
            what = "a newline" if value.strip(" \t") != value.strip() else "whitespace"
            return (
                f"{origin}: {name} begins or ends with {what} (base64 of `echo VALUE` keeps "
                "the newline; use `echo -n` or `kubectl create secret --from-literal`): "
                "expected the value alone"
            )
    present = [name for name in KEY_PAIR if env.get(name)]
    if present == [key_id] or (pair and present == [secret]):
        (missing,) = set(KEY_PAIR) - set(present)
        return (
            f"{origin}: {present[0]} is set but {missing} is missing or empty: expected "
            f"both {key_id} and {secret}"
            + (" (or neither, to read a public bucket anonymously)" if pair else "")
        )
    for name in (contract.ENV_S3_ENDPOINT_S3, contract.ENV_S3_ENDPOINT):
        endpoint = env.get(name)
        if endpoint and uris.has_userinfo(endpoint_url(endpoint)):
            return (
                f"{origin}: {name} has a user name or password before its host "
                f"('…@'): expected scheme://host[:port]; credentials go in {key_id} and "
                f"{secret}"
            )
    return None
