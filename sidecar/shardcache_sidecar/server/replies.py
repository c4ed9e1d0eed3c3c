"""What the sidecar answers when it refuses a request: JSON errors with a `kind`.

Every error body has the shape of docs/wire-format.md (`protocol.error_body`); the
`kind` tells the client whether to retry (unavailable, source, cache) or fix its input.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from typing import Any

from aiohttp import web

from shardcache import errors
from shardcache.contract import protocol

# The logger name the sidecar's logs carried before the server was split.
log = logging.getLogger("shardcache_sidecar.server")


class RequestError(Exception):
    """A request the sidecar refuses, with its HTTP status and wire error."""

    def __init__(self, status: int, kind: str, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind, self.code, self.message = status, kind, code, message


@dataclasses.dataclass(frozen=True)
class Problem:
    """Why data routes are not served (yet)."""

    status: int
    kind: str
    code: str
    message: str

    def error(self) -> RequestError:
        return RequestError(self.status, self.kind, self.code, self.message)


@dataclasses.dataclass(frozen=True)
class Answer:
    """An answer ready for either transport of the control socket (aiohttp's, or
    `socket_server`'s): its HTTP status and its JSON body, encoded once."""

    body: bytes
    status: int = 200


def answer(doc: Any, status: int = 200) -> Answer:
    return Answer(json.dumps(doc).encode(), status)


def error_answer(exc: RequestError) -> Answer:
    return answer(protocol.error_body(exc.kind, exc.code, exc.message), exc.status)


def response(reply: Answer) -> web.Response:
    """`reply` as aiohttp's response."""
    return web.Response(body=reply.body, status=reply.status, content_type="application/json")


def json_response(doc: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=json.dumps(doc).encode(), status=status, content_type="application/json"
    )


def error_response(exc: RequestError) -> web.Response:
    return json_response(protocol.error_body(exc.kind, exc.code, exc.message), exc.status)


def request_error(exc: BaseException) -> RequestError:
    """The wire form of an error raised by the cache or by request parsing."""
    if isinstance(exc, errors.ManifestMismatchError):
        return RequestError(409, protocol.KIND_INPUT, protocol.CODE_MANIFEST_MISMATCH, str(exc))
    if isinstance(exc, errors.ShardIndexError):
        return RequestError(400, protocol.KIND_INPUT, protocol.CODE_UNKNOWN_SHARD, str(exc))
    if isinstance(exc, errors.AccessDeniedError):
        # 400, as before it had a code of its own: an older client sees no other change.
        return RequestError(400, protocol.KIND_INPUT, protocol.CODE_ACCESS_DENIED, str(exc))
    if isinstance(exc, errors.InputError):
        return RequestError(400, protocol.KIND_INPUT, protocol.CODE_BAD_REQUEST, str(exc))
    if isinstance(exc, errors.SourceError):
        return RequestError(502, protocol.KIND_SOURCE, protocol.CODE_SOURCE_FAILED, str(exc))
    if isinstance(exc, errors.AcquireTimeoutError):
        # Its message names the shard and what it waited on.
        return RequestError(504, protocol.KIND_CACHE, protocol.CODE_TIMEOUT, str(exc))
    if isinstance(exc, TimeoutError):
        # One without a message (a future's wait) left nothing after the colon.
        detail = str(exc) or f"no detail given ({type(exc).__name__})"
        return RequestError(
            504,
            protocol.KIND_CACHE,
            protocol.CODE_TIMEOUT,
            f"timed out waiting for the shard: {detail}",
        )
    if isinstance(exc, errors.CacheError):
        return RequestError(503, protocol.KIND_CACHE, protocol.CODE_INTERNAL, str(exc))
    return RequestError(
        500,
        protocol.KIND_CACHE,
        protocol.CODE_INTERNAL,
        f"internal error: {type(exc).__name__}: {exc}",
    )


def refusal(exc: BaseException, method: str, path: str) -> RequestError:
    """What to answer for an error a handler raised, logged as it deserves: a bug with
    its traceback, anything else (bad input, a source or cache failure) as a warning."""
    if isinstance(exc, RequestError):
        return exc
    rejected = request_error(exc)
    if (
        rejected.status >= 500
        and rejected.kind == protocol.KIND_CACHE
        and rejected.code == protocol.CODE_INTERNAL
    ):
        log.error("%s %s failed", method, path, exc_info=exc)
    else:
        log.warning("%s %s: %s", method, path, rejected.message)
    return rejected


async def json_body(request: web.Request) -> dict[str, Any]:
    """The request's body, which must be a JSON object (InputError otherwise)."""
    return json_object(await request.read())


#: The C scanner `json.loads` ends in (`JSONDecoder.raw_decode`).
_DECODER = json.JSONDecoder()


def _loads(raw: bytes) -> Any:
    """`json.loads(raw)`, the same value or the same error, without its detour for the
    bodies the control client sends (`{...}` in UTF-8, nothing around it): no guess at
    the encoding, no whitespace regexes, three Python calls fewer. At an idle sidecar
    every step runs with cold caches, and that detour was most of decoding a `notes`
    body (docs/benchmarks.md, "CPU per control request, session 17").

    Exact: a body starting with `{` and a non-NUL byte is UTF-8 to `json.loads`
    (`json.detect_encoding`), and one it decodes whole from its first byte is what
    `json.loads` decodes (no whitespace before or after). Anything else, invalid UTF-8
    and every error included, goes to `json.loads` itself."""
    if raw[:1] == b"{" and raw[1:2] != b"\x00" and raw[-1:] == b"}":
        try:
            text = raw.decode("utf-8")
            value, end = _DECODER.raw_decode(text)
        except ValueError:
            pass  # json.loads says what is wrong, as it words it
        else:
            if end == len(text):
                return value
    return json.loads(raw)


def json_object(raw: bytes) -> dict[str, Any]:
    """A request body, which must be a JSON object (InputError otherwise)."""
    try:
        body = _loads(raw) if raw else None
    except ValueError as exc:
        raise errors.InputError(f"request body is not JSON: {exc}") from exc
    except RecursionError:
        # json's decoder recurses per level: a body of nested brackets is a client's
        # mistake (or an attack), not a bug of the sidecar.
        raise errors.InputError(
            f"request body is not JSON the sidecar parses: expected a JSON object, found "
            f"arrays or objects nested more than {sys.getrecursionlimit()} levels deep"
        ) from None
    if not isinstance(body, dict):
        raise errors.InputError(f"request body: expected a JSON object, found {raw[:80]!r}")
    return body
