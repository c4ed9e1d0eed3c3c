"""Errors raised by shardcache, grouped by what the caller should do about them.

* `InputError`: fix your input (a URI, a spec, a state dict); retrying will not help.
  `AccessDeniedError`, one of them: the store refused the credentials.
* `SourceError`: the object store failed; it was retried with backoff already and a
  later retry may succeed.
* `CacheError`: the node cache cannot serve a request (limits, corruption that could
  not be repaired, a shard not resident within the acquire's timeout).
"""

from __future__ import annotations


class ShardcacheError(Exception):
    """Base class of every error raised by shardcache."""


class InputError(ShardcacheError, ValueError):
    """The input is wrong: fix it. The message says what was expected and what was found."""


class ShardIndexError(InputError):
    """A shard index outside the manifest (the wire's `unknown_shard`)."""


class StateMismatchError(InputError):
    """A resumable state dict does not belong to this dataset or configuration."""


class ManifestMismatchError(InputError):
    """The dataset differs from the pinned manifest digest."""


class AccessDeniedError(InputError):
    """The object store refused the credentials (HTTP 401/403: AccessDenied,
    InvalidAccessKeyId, SignatureDoesNotMatch). The same credentials fail again, so it
    is not retried; unlike other input, it is fixed outside the spec (a key rotated in a
    Secret, a bucket policy), so whoever can watch for that (the operator) tells it apart."""


class SourceError(ShardcacheError, IOError):
    """Reading from the object store failed after retries; retrying later may succeed."""


class CacheError(ShardcacheError, RuntimeError):
    """The node cache cannot serve the request."""


class AcquireTimeoutError(CacheError, TimeoutError):
    """A shard was not resident within the acquire's timeout. The message names the
    shard and what it waited on (a fetch in flight since when, room in the memory
    tier, ...). A `TimeoutError` too, for callers that catch timeouts of any origin."""


class SidecarUnavailableError(ShardcacheError, ConnectionError):
    """The sidecar did not answer on its control socket; retrying later may succeed."""


def missing_extra(exc: ModuleNotFoundError, needed_by: str, extra: str) -> ModuleNotFoundError:
    """`exc` (a framework not installed) said with what to install: a trainer's
    pyarrow-only install lacks numpy, torch and jax until it asks for them."""
    return ModuleNotFoundError(
        f"{needed_by} needs {exc.name}, which is not installed: "
        f"`pip install 'shardcache[{extra}]'`",
        name=exc.name,
    )
