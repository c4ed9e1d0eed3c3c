"""`--where` expressions: a small, safe predicate language over columns, never eval.

    expr    := compare ("and" compare)*
    compare := column op literal
    op      := == | != | < | <= | > | >=
    literal := integer | float | 'text' | "text" | true | false

A column is a name ([A-Za-z_][A-Za-z0-9_.]*) or any text in backquotes. Evaluation is
vectorised with pyarrow.compute over one shard at a time; a null never matches.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.types as pat

from shardcache import errors

Literal = int | float | str | bool

_OPS = {
    "==": pc.equal,
    "!=": pc.not_equal,
    "<": pc.less,
    "<=": pc.less_equal,
    ">": pc.greater,
    ">=": pc.greater_equal,
}
_TOKEN = re.compile(
    r"""\s*(?:
        (?P<op>==|!=|<=|>=|<|>)
      | (?P<str>'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")
      | (?P<num>[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?)
      | (?P<quoted>`[^`]+`)
      | (?P<word>[A-Za-z_][A-Za-z0-9_.]*)
    )""",
    re.VERBOSE,
)


@dataclasses.dataclass(frozen=True)
class Compare:
    column: str
    op: str
    value: Literal


@dataclasses.dataclass(frozen=True)
class Predicate:
    terms: tuple[Compare, ...]

    @property
    def columns(self) -> list[str]:
        return list(dict.fromkeys(t.column for t in self.terms))


def _tokens(text: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    text = text.rstrip()
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None or match.end() == pos:
            raise errors.InputError(
                f"cannot parse --where {text!r} at character {pos + 1} ({text[pos : pos + 10]!r}): "
                "expected `column op literal`, e.g. uid == 123 or lang == 'en'"
            )
        kind = match.lastgroup
        assert kind is not None
        out.append((kind, match.group(kind)))
        pos = match.end()
    return out


def _literal(kind: str, text: str) -> Literal:
    if kind == "str":
        return re.sub(r"\\(.)", r"\1", text[1:-1])
    if kind == "num":
        return int(text) if re.fullmatch(r"[-+]?\d+", text) else float(text)
    if kind == "word" and text in ("true", "false"):
        return text == "true"
    raise errors.InputError(
        f"expected a literal (number, 'text', true or false), found {text!r}; "
        "quote text values, e.g. lang == 'en'"
    )


def parse(text: str) -> Predicate:
    """Parse a --where expression; InputError says what was expected where."""
    tokens = _tokens(text)
    if not tokens:
        raise errors.InputError("empty --where expression: expected e.g. uid == 123")
    terms: list[Compare] = []
    i = 0
    while True:
        part = tokens[i : i + 3]
        if len(part) < 3:
            raise errors.InputError(
                f"incomplete --where {text!r}: expected `column op literal`, "
                f"found {' '.join(t for _, t in part) or 'nothing'} at the end"
            )
        (ck, column), (ok, op), (lk, lit) = part
        if ck not in ("word", "quoted"):
            raise errors.InputError(f"expected a column name, found {column!r} in {text!r}")
        if ok != "op":
            raise errors.InputError(
                f"expected an operator ({' '.join(_OPS)}) after {column!r}, found {op!r}"
            )
        name = column[1:-1] if ck == "quoted" else column
        terms.append(Compare(name, op, _literal(lk, lit)))
        i += 3
        if i == len(tokens):
            return Predicate(tuple(terms))
        if tokens[i] != ("word", "and"):
            raise errors.InputError(
                f"expected `and` or the end of the expression, found {tokens[i][1]!r} in {text!r}"
            )
        i += 1


def check(predicate: Predicate, schema: pa.Schema) -> None:
    missing = [c for c in predicate.columns if c not in schema.names]
    if missing:
        raise errors.InputError(
            f"unknown column(s) {missing} in --where: the dataset has {schema.names}"
        )


def literal(term: Compare, dtype: pa.DataType) -> pa.Scalar:
    """`term`'s literal as an Arrow scalar of the column's type where it is a number
    against numbers: inferred, an integer is int64, which holds neither a uint64 id
    above 2^63 nor says plainly that a literal is out of the column's range."""
    value = term.value
    numeric = pat.is_integer(dtype) or pat.is_floating(dtype)
    if isinstance(value, bool) or not isinstance(value, int) or not numeric:
        return pa.scalar(value)
    if pat.is_integer(dtype):
        try:
            return pa.scalar(value, type=dtype)
        except (OverflowError, pa.ArrowInvalid) as exc:
            info = _int_range(dtype)
            raise errors.InputError(
                f"{value} is out of range for column {term.column!r} ({dtype}): expected "
                f"an integer from {info[0]} to {info[1]}"
            ) from exc
    try:
        return pa.scalar(float(value), type=dtype)
    except (OverflowError, pa.ArrowInvalid) as exc:
        raise errors.InputError(
            f"{value} is out of range for column {term.column!r} ({dtype})"
        ) from exc


def _int_range(dtype: pa.DataType) -> tuple[int, int]:
    bits = dtype.bit_width
    if pat.is_signed_integer(dtype):
        return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    return 0, 2**bits - 1


def mask(predicate: Predicate, batch: pa.RecordBatch) -> pa.Array:
    """A boolean array: rows of `batch` the predicate holds for (nulls are False)."""
    result: pa.Array | None = None
    for term in predicate.terms:
        column = batch.column(term.column)
        try:
            hit = _OPS[term.op](column, literal(term, column.type))
        except (pa.ArrowNotImplementedError, pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise errors.InputError(
                f"cannot compare column {term.column!r} ({column.type}) with {term.value!r}: "
                "expected a literal of the column's kind"
            ) from exc
        hit = pc.fill_null(hit, False)
        result = hit if result is None else pc.and_(result, hit)
    assert result is not None
    return result


def matching_rows(predicate: Predicate, batch: pa.RecordBatch) -> Sequence[int]:
    return pc.indices_nonzero(mask(predicate, batch)).to_pylist()  # type: ignore[no-any-return]
