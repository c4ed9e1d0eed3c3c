"""The one set of parsers for settings given as text: environment variables and flags.

Every reader of a shared variable (`shardcache.contract.variables`), the sidecar's
flags and the operator's own `SHARDCACHE_OPERATOR_*` settings parse with these, so a
value means the same thing wherever it is read. A parser is given the text and the
label of where it came from (`$SHARDCACHE_SEED`, `--seed`); a bad value raises
`errors.InputError` naming the label, what was expected and what was found.

Booleans are strict everywhere: `true`/`false`, `yes`/`no`, `on`/`off` or `1`/`0`, in
any case. Anything else, a typo such as `ture` included, is an error rather than
silently off.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from collections.abc import Callable
from typing import Generic, TypeVar

from shardcache import errors, uris

T_co = TypeVar("T_co", covariant=True)

#: The words a boolean setting accepts (compared case-insensitively).
TRUE_WORDS = ("true", "yes", "on", "1")
FALSE_WORDS = ("false", "no", "off", "0")
BOOLEAN_EXPECTED = "true or false (also yes/no, on/off, 1/0)"


class ParseError(ValueError):
    """A value that is not what its setting expects; `label` is filled in by the caller."""

    def __init__(self, expected: str, found: str) -> None:
        super().__init__(f"expected {expected}, found {found}")
        self.expected = expected
        self.found = found


@dataclasses.dataclass(frozen=True)
class Parser(Generic[T_co]):
    """Text to a typed value; `kind` is how docs and `--help` describe the values."""

    kind: str
    convert: Callable[[str], T_co]
    #: Bounds of a numeric parser, so a schema can state the same range.
    minimum: int | None = None
    maximum: int | None = None

    def __call__(self, label: str, text: str) -> T_co:
        """The value of `text`, or `InputError` naming `label` (`$NAME`, `--flag`)."""
        try:
            return self.convert(text.strip())
        except ParseError as exc:
            raise errors.InputError(f"{label}: {exc}") from None

    def flag_type(self, text: str) -> T_co:
        """The value of `text` for argparse's `type=`: it names the flag itself."""
        try:
            return self.convert(text.strip())
        except ParseError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None


def render(value: object) -> str:
    """A value as a setting's text: booleans as `true`/`false`, lists comma-separated."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple | list):
        return ",".join(str(item) for item in value)
    return str(value)


def quantity(size: int) -> str:
    """Bytes as the shortest exact Kubernetes quantity: 4294967296 -> "4Gi"."""
    for unit, factor in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if size and size % factor == 0:
            return f"{size // factor}{unit}"
    return str(size)


def _boolean(text: str) -> bool:
    word = text.lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ParseError(BOOLEAN_EXPECTED, repr(text))


def _range_text(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f"{minimum}-{maximum}"
    if minimum is not None:
        return f">= {minimum}"
    if maximum is not None:
        return f"<= {maximum}"
    return ""


def integer(*, minimum: int | None = None, maximum: int | None = None) -> Parser[int]:
    """A decimal integer, optionally bounded: `integer(minimum=1)`."""

    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ParseError("an integer", repr(text)) from None
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            # The whole range, not only the bound broken: the user sees what fits.
            raise ParseError(f"an integer {bounds}", str(value))
        return value

    bounds = _range_text(minimum, maximum)
    return Parser(f"integer {bounds}".strip(), convert, minimum=minimum, maximum=maximum)


def _byte_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ParseError("a byte count >= 0", repr(text)) from None
    if value < 0:
        raise ParseError("a byte count >= 0", str(value))
    return value


def seconds(*, zero: str | None = None) -> Parser[float]:
    """Seconds, finite and > 0; with `zero` (what 0 means: `zero="off"`), 0 too.

    The one definition: the operator's intervals and the sidecar's timeouts use it, so
    `inf`, `nan` and negative seconds are refused alike wherever they are read."""
    expected = f"seconds >= 0 (0: {zero})" if zero is not None else "seconds > 0"

    def convert(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise ParseError("seconds as a number", repr(text)) from None
        # An infinite timeout or interval is never what was meant (a timer that never
        # fires), and NaN compares false with everything, so neither is taken.
        if not (math.isfinite(value) and value >= 0) or (value == 0 and zero is None):
            raise ParseError(f"finite {expected}", text)
        return value

    return Parser(expected, convert)


def _text(text: str) -> str:
    if not text:
        raise ParseError("a non-empty string", repr(text))
    return text


#: A URI setting's form: a lowercase scheme, "://", then at least one character. The
#: CRD's `uri` fields use this pattern and limit (shardcache_operator.specs imports
#: them), so a value the API server refuses in a DatasetMount is refused in a variable
#: or flag too. The wire carries URIs in this form (docs/wire-format.md).
URI_PATTERN = r"^[a-z][a-z0-9+.-]*://.+$"
MAX_URI_LENGTH = 2048
_URI = re.compile(URI_PATTERN)
URI_EXPECTED = "a URI scheme://path such as s3://bucket/prefix or file:///data"
#: A scheme with its "://" mistyped: "s3//b/p", "s3:/b/p", "file:/x", "s3:b".
_MISTYPED_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*(//|:/?)(?!/)")


def _uri_problem(text: str) -> str | None:
    """Why `text` is not of `URI_EXPECTED`'s form (what was found), or None.

    Without this, a mistyped `s3//bucket/run` is a relative local path to pyarrow: the
    checkpoint agent would publish under `$PWD/s3/bucket/run` and say it is ready."""
    if len(text) > MAX_URI_LENGTH:
        return f"{len(text)} characters, over the {MAX_URI_LENGTH} a URI may have"
    if text.startswith("file://") and not text.startswith("file:///"):
        # pyarrow takes file://tmp/x as host "tmp", path "/x"; a file:// URI names no
        # host here (`source.split_uri` refuses it too).
        return f"{text!r}, which names a host: a local path is file:///absolute/path"
    if _URI.match(text):
        return None
    if text.startswith("/"):
        return f"{text!r}, a local path: write it file://{text}"
    scheme, sep, rest = text.partition("://")
    if sep and rest and re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme):
        return f"{text!r}: the scheme is written in lowercase ({scheme.lower()}://)"
    if _MISTYPED_SCHEME.match(text):
        return f"{text!r}: the scheme is not followed by '://'"
    return repr(text)


def _uri(text: str) -> str:
    if not text:
        raise ParseError("a URI such as s3://bucket/prefix", repr(text))
    if uris.has_userinfo(text):
        # The refusal names the variable but never echoes the credentials.
        raise ParseError(f"a URI without credentials ({uris.ADVICE})", repr(uris.redact(text)))
    problem = _uri_problem(text)
    if problem is not None:
        raise ParseError(URI_EXPECTED, problem)
    return text


def _path(text: str) -> str:
    # Relative paths are fine for a sidecar started by hand; pods get absolute ones.
    if not text:
        raise ParseError("a path", repr(text))
    return text


def _one_of(choices: tuple[str, ...]) -> str:
    if len(choices) == 2:
        return f"{choices[0]} or {choices[1]}"
    return f"one of {', '.join(choices)}"


def choice(*choices: str, fold_case: bool = False) -> Parser[str]:
    """One of `choices`; with `fold_case`, in any case (the value is then lower-cased)."""

    def convert(text: str) -> str:
        value = text.lower() if fold_case else text
        if value not in choices:
            raise ParseError(_one_of(choices), repr(text))
        return value

    return Parser("/".join(choices), convert)


def pattern(regex: str, *, expected: str, kind: str) -> Parser[str]:
    """Text matching `regex` in full (case-insensitively); `expected` says what fits."""
    compiled = re.compile(regex, re.IGNORECASE)

    def convert(text: str) -> str:
        if not compiled.fullmatch(text):
            raise ParseError(expected, repr(text))
        return text

    return Parser(kind, convert)


def words(text: str) -> tuple[str, ...]:
    """A comma-separated list; blanks around and between items are dropped."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


BOOLEAN: Parser[bool] = Parser("boolean", _boolean)
#: Bytes as a plain integer: the variables say so in their names (`..._BYTES`).
BYTES: Parser[int] = Parser("bytes", _byte_count)
SECONDS: Parser[float] = seconds()
TEXT: Parser[str] = Parser("string", _text)
PATH: Parser[str] = Parser("path", _path)
#: A dataset or checkpoint URI, `scheme://…` (`URI_PATTERN`); one with credentials in it
#: is refused (`shardcache.uris`).
URI: Parser[str] = Parser("URI", _uri)
WORDS: Parser[tuple[str, ...]] = Parser("comma-separated list", words)
#: A manifest digest as the operator pins it (only the algorithm prefix is checked here;
#: the sidecar compares the whole digest with the one it resolves).
DIGEST: Parser[str] = pattern(r"sha256:\S+", expected="'sha256:<hex>'", kind="sha256 digest")
