"""Render cell values readably: a JSON-able description per cell, and terminal text.

Each cell becomes a dict with a `kind`: text (truncated, full length kept), tokens
(ids, optionally decoded), image (format, size, dimensions from magic bytes), binary,
turns (a `list<struct>` as a table), struct, list, value, null. The terminal, the TUI
and the web inspector all show these same dicts.

Columns are rendered through Arrow (`render_column`): text, token lists, turns and
lists are clipped by pyarrow.compute before anything becomes Python, binary cells are
read in place (only an image's header is looked at), and temporal values are
formatted by Arrow (nanoseconds and years past 9999 included, which Python's datetime
cannot hold). So a step of 1 MiB documents costs the clipped text, not the documents.

An integer JavaScript would round (beyond 2^53 - 1) keeps its exact JSON number and
gets a `display` string beside it, the exact text a page shows.

`safe` is the one sanitiser of everything the terminal views print: no control
character, escape sequence or bidi override from the data, a name or a path reaches
the terminal; each is shown escaped (`\\u001b`).
"""

from __future__ import annotations

import dataclasses
import decimal
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.types as pat

from shardcache import errors
from shardcache.inspect import images

Decode = Callable[[list[int]], str]

#: Largest integer a JavaScript number holds exactly.
JS_SAFE_INTEGER = 2**53 - 1


class Budget:
    """Bytes of Arrow data one answer may turn into Python, shared by its columns: a
    served inspector's bound on what a request materialises (`used` says how much it
    did)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self, array: pa.Array) -> None:
        size = array.nbytes
        if self.used + size > self.limit:
            raise errors.InputError(
                f"the answer would convert {self.used + size:,} bytes of values, over the "
                f"inspector's limit of {self.limit:,}: ask for fewer rows or columns"
            )
        self.used += size


@dataclasses.dataclass(frozen=True)
class RenderOptions:
    #: Characters of text shown; None shows all. 200 fits a few terminal lines.
    max_chars: int | None = 200
    #: Token ids shown; None shows all.
    max_tokens: int | None = 32
    #: Turns of a list<struct> shown; None shows all.
    max_turns: int | None = 20
    #: Characters per cell of a turns table: keeps the table one line per turn.
    max_cell_chars: int = 60
    #: Items of any other list shown; None shows all.
    max_items: int | None = 64
    #: A clipped text longer than this many bytes reports its length in bytes
    #: (`length` None, `bytes` set) instead of characters: counting characters reads the
    #: whole text. None counts every text.
    max_count_bytes: int | None = None
    #: What the values shown may convert to Python in all (after clipping); over it is
    #: an InputError. None: no limit. Give each answer its own.
    budget: Budget | None = None


FULL = RenderOptions(
    max_chars=None, max_tokens=None, max_turns=None, max_cell_chars=10_000, max_items=None
)


def load_tokenizer(path: str) -> Decode:
    """A decoder from a HuggingFace tokenizer.json (needs the `tokenizers` package)."""
    try:
        import tokenizers
    except ImportError as exc:
        raise errors.InputError(
            "--tokenizer needs the `tokenizers` package: pip install 'shardcache[inspect]'"
        ) from exc
    try:
        tok = tokenizers.Tokenizer.from_file(path)
    except Exception as exc:  # the Rust side raises a bare Exception
        raise errors.InputError(
            f"cannot read tokenizer {path!r}: expected a HuggingFace tokenizer.json ({exc})"
        ) from exc

    def decode(ids: list[int]) -> str:
        return str(tok.decode(ids, skip_special_tokens=False))

    return decode


# --- terminal safety ------------------------------------------------------------

# C0 and C1 controls, DEL, and the characters that reorder or break lines on screen
# (bidi embeddings, overrides and isolates, marks, line/paragraph separators).
_BIDI = "\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069"
_UNSAFE = re.compile(f"[\\x00-\\x1f\\x7f-\\x9f{_BIDI}]")
# Inside JSON text: C0 is escaped by json.dumps already, and the newlines of indented
# JSON are structure, not data.
_JSON_UNSAFE = re.compile(f"[\\x7f-\\x9f{_BIDI}]")


def _escape(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


def safe(text: str) -> str:
    """`text` with every control character and bidi override shown escaped (ESC as
    `\\u001b`): what the terminal views print. Idempotent."""
    return _UNSAFE.sub(_escape, text)


def safe_lines(text: str) -> str:
    """`safe` per line: keeps the line breaks of a multi-line message."""
    return "\n".join(safe(line) for line in text.split("\n"))


def safe_json(text: str) -> str:
    """JSON text (`ensure_ascii=False`) with DEL, C1 and bidi characters written as
    `\\uXXXX` escapes: the same JSON, safe to print to a terminal."""
    return _JSON_UNSAFE.sub(_escape, text)


# --- cells ----------------------------------------------------------------------


def _is_tokens(dtype: pa.DataType) -> bool:
    is_list = pat.is_list(dtype) or pat.is_large_list(dtype) or pat.is_fixed_size_list(dtype)
    return bool(is_list and pat.is_integer(dtype.value_type))


def _is_turns(dtype: pa.DataType) -> bool:
    is_list = pat.is_list(dtype) or pat.is_large_list(dtype)
    return bool(is_list and pat.is_struct(dtype.value_type))


def _is_text(dtype: pa.DataType) -> bool:
    return bool(pat.is_string(dtype) or pat.is_large_string(dtype))


def _is_binary(dtype: pa.DataType) -> bool:
    return bool(
        pat.is_binary(dtype) or pat.is_large_binary(dtype) or pat.is_fixed_size_binary(dtype)
    )


def _is_list(dtype: pa.DataType) -> bool:
    return bool(pat.is_list(dtype) or pat.is_large_list(dtype) or pat.is_fixed_size_list(dtype))


def _clip(text: str, limit: int | None) -> tuple[str, bool]:
    if limit is None or len(text) <= limit:
        return text, False
    return text[:limit], True


def jsonable(value: Any) -> Any:
    """Plain JSON types for any Arrow-to-Python value (bytes become a short hex note)."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return (
            value if value == value and value not in (float("inf"), float("-inf")) else str(value)
        )
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, Sequence):
        return [jsonable(v) for v in value]
    return str(value)


def _unsafe_int(value: Any) -> bool:
    """Whether `value` holds an integer a JavaScript number would round."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return abs(value) > JS_SAFE_INTEGER
    if isinstance(value, Mapping):
        return any(_unsafe_int(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_unsafe_int(v) for v in value)
    return False


def exact(value: int | float | None) -> str | None:
    """The exact text of `value` when a JavaScript number would round it, else None."""
    return str(value) if _unsafe_int(value) else None


def _plain_type(dtype: pa.DataType) -> pa.DataType:
    """`dtype` with every temporal type (at any depth) made a string: Arrow formats
    those exactly, Python's datetime cannot hold nanoseconds or years past 9999."""
    if pat.is_temporal(dtype):
        return pa.string()
    if pat.is_list(dtype):
        return pa.list_(dtype.value_field.with_type(_plain_type(dtype.value_type)))
    if pat.is_large_list(dtype):
        return pa.large_list(dtype.value_field.with_type(_plain_type(dtype.value_type)))
    if pat.is_fixed_size_list(dtype):
        return pa.list_(dtype.value_field.with_type(_plain_type(dtype.value_type)), dtype.list_size)
    if pat.is_struct(dtype):
        return pa.struct([f.with_type(_plain_type(f.type)) for f in dtype])
    if pat.is_map(dtype):
        return pa.map_(_plain_type(dtype.key_type), _plain_type(dtype.item_type))
    return dtype


def _to_py(array: pa.Array, options: RenderOptions) -> list[Any]:
    """`array` as Python values: the one place a column becomes Python, so the
    answer's `budget` holds for every kind."""
    if options.budget is not None:
        options.budget.take(array)
    plain = _plain_type(array.type)
    if plain != array.type:
        array = array.cast(plain)
    return array.to_pylist()  # type: ignore[no-any-return]


def _lengths(array: pa.Array) -> list[int | None]:
    return pc.list_value_length(array).to_pylist()  # type: ignore[no-any-return]


def render_value(
    value: Any,
    dtype: pa.DataType,
    *,
    options: RenderOptions = RenderOptions(),
    decode: Decode | None = None,
) -> dict[str, Any]:
    """Describe one cell for display; `value` is the cell as Python (`to_pylist`)."""
    return render_column(pa.array([value], type=dtype), options=options, decode=decode)[0]


def render_column(
    column: pa.Array | pa.ChunkedArray,
    *,
    options: RenderOptions = RenderOptions(),
    decode: Decode | None = None,
) -> list[dict[str, Any]]:
    """Describe every cell of `column` for display, converting to Python only what
    is shown."""
    if isinstance(column, pa.ChunkedArray):
        out: list[dict[str, Any]] = []
        for chunk in column.chunks:
            out += _render(chunk, options, decode)
        return out
    return _render(column, options, decode)


def _render(array: pa.Array, options: RenderOptions, decode: Decode | None) -> list[dict[str, Any]]:
    dtype = array.type
    if pat.is_dictionary(dtype):
        return _render(array.dictionary_decode(), options, decode)
    valid: list[bool] = array.is_valid().to_pylist()
    if _is_text(dtype):
        return _texts(array, valid, options)
    if _is_binary(dtype):
        return _binaries(array, valid)
    if _is_tokens(dtype):
        return _tokens(array, valid, options, decode)
    if _is_turns(dtype):
        return _turns(array, valid, options)
    if pat.is_struct(dtype):
        children = array.flatten()  # each child with the struct's nulls merged in
        fields = {f.name: _render(c, options, decode) for f, c in zip(dtype, children, strict=True)}
        return [
            {"kind": "struct", "fields": {name: cells[i] for name, cells in fields.items()}}
            if ok
            else {"kind": "null"}
            for i, ok in enumerate(valid)
        ]
    if _is_list(dtype):
        return _lists(array, valid, options)
    if pat.is_duration(dtype):
        # "5 ns": Arrow's cast to text drops the unit.
        counts = _to_py(array.cast(pa.int64()), options)
        return [
            {"kind": "value", "value": f"{v} {dtype.unit}"} if ok else {"kind": "null"}
            for v, ok in zip(counts, valid, strict=True)
        ]
    values = _to_py(array, options)
    if pat.is_timestamp(dtype):
        # ISO 8601's separator; Arrow writes a space.
        values = [v.replace(" ", "T", 1) if v is not None else None for v in values]
    return [_value_cell(v) if ok else {"kind": "null"} for v, ok in zip(values, valid, strict=True)]


def _value_cell(value: Any) -> dict[str, Any]:
    cell: dict[str, Any] = {"kind": "value", "value": jsonable(value)}
    if _unsafe_int(value):
        cell["display"] = str(value)
    return cell


def _texts(array: pa.Array, valid: list[bool], options: RenderOptions) -> list[dict[str, Any]]:
    limit = options.max_chars
    shown = array if limit is None else pc.utf8_slice_codeunits(array, 0, limit)
    texts: list[str | None] = _to_py(shown, options)
    # Byte lengths come from the offsets: no text is read for them.
    sizes: list[int | None] = pc.binary_length(array).to_pylist()
    shown_sizes: list[int | None] = pc.binary_length(shown).to_pylist()
    cut = [ok and shown_sizes[i] != sizes[i] for i, ok in enumerate(valid)]
    counted = _char_counts(array, sizes, cut, options.max_count_bytes)
    out: list[dict[str, Any]] = []
    for i, text in enumerate(texts):
        if text is None or not valid[i]:
            out.append({"kind": "null"})
            continue
        length = counted.get(i, len(text)) if cut[i] else len(text)
        cell: dict[str, Any] = {
            "kind": "text",
            "value": text,
            "length": length,
            "truncated": cut[i],
        }
        if length is None:
            cell["bytes"] = sizes[i]
        out.append(cell)
    return out


def _char_counts(
    array: pa.Array, sizes: list[int | None], cut: list[bool], max_bytes: int | None
) -> dict[int, int | None]:
    """Characters of each clipped text (by row); None where counting would read more
    than `max_bytes` of it."""
    rows = [i for i, c in enumerate(cut) if c]
    if max_bytes is None and rows:
        lengths = pc.utf8_length(array).to_pylist()
        return {i: lengths[i] for i in rows}
    out: dict[int, int | None] = {}
    for i in rows:
        # A zero-copy slice: only this text is read.
        fits = (sizes[i] or 0) <= (max_bytes or 0)
        out[i] = pc.utf8_length(array.slice(i, 1))[0].as_py() if fits else None
    return out


def _binaries(array: pa.Array, valid: list[bool]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, ok in enumerate(valid):
        if not ok:
            out.append({"kind": "null"})
            continue
        # The cell in place (no copy): only an image header is read.
        data = memoryview(array[i].as_buffer()).cast("B")
        info = images.sniff(data)
        if info is not None:
            out.append({"kind": "image", "bytes": len(data), **dataclasses.asdict(info)})
        else:
            out.append({"kind": "binary", "bytes": len(data), "head": bytes(data[:16]).hex()})
    return out


def _tokens(
    array: pa.Array, valid: list[bool], options: RenderOptions, decode: Decode | None
) -> list[dict[str, Any]]:
    lengths = _lengths(array)
    decoded: list[tuple[str, bool] | None] = [None] * len(array)
    if decode is not None:
        # Text of at most max_chars characters needs about as many tokens: decode a
        # prefix, and call the text cut when the prefix was not the whole list.
        chars = options.max_chars
        prefix = array if chars is None else pc.list_slice(array, 0, max(chars, 1))
        for i, ids in enumerate(_to_py(prefix, options)):
            if ids is not None:
                text, cut = _clip(decode(ids), chars)
                decoded[i] = (text, cut or len(ids) < (lengths[i] or 0))

    def cell(i: int, ids: list[Any], length: int) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": "tokens",
            "ids": ids,
            "length": length,
            "truncated": len(ids) < length,
        }
        if _unsafe_int(ids):
            out["display"] = ", ".join(str(v) for v in ids)
        shown_text = decoded[i]
        if shown_text is not None:
            out["decoded"], out["decoded_truncated"] = shown_text
        return out

    return _list_cells(array, valid, options, options.max_tokens, lengths, cell)


def _turns(array: pa.Array, valid: list[bool], options: RenderOptions) -> list[dict[str, Any]]:
    dtype = array.type
    fields = [f.name for f in dtype.value_type]
    lengths = _lengths(array)
    limit = options.max_turns
    shown = array if limit is None else pc.list_slice(array, 0, limit)
    turns = shown.flatten()  # the shown turns of every row, in row order
    parents: list[int] = pc.list_parent_indices(shown).to_pylist()
    columns = [_turn_cells(child, options) for child in turns.flatten()]
    rows: list[list[list[str]]] = [[] for _ in range(len(array))]
    for t, parent in enumerate(parents):
        rows[parent].append([cells[t] for cells in columns])
    out: list[dict[str, Any]] = []
    for i, ok in enumerate(valid):
        if not ok:
            out.append({"kind": "null"})
            continue
        length = lengths[i] or 0
        out.append(
            {
                "kind": "turns",
                "columns": fields,
                "rows": rows[i],
                "length": length,
                "truncated": len(rows[i]) < length,
            }
        )
    return out


def _turn_cells(child: pa.Array, options: RenderOptions) -> list[str]:
    """One table cell per turn: text clipped to `max_cell_chars` on one line."""
    limit = options.max_cell_chars
    if _is_text(child.type):
        cells = _texts(
            child, child.is_valid().to_pylist(), dataclasses.replace(options, max_chars=limit)
        )
        out = []
        for cell in cells:
            if cell["kind"] == "null":
                out.append("")
                continue
            text = cell["value"].replace("\n", " ")
            if not cell["truncated"]:
                out.append(text)
            elif cell["length"] is None:
                out.append(f"{text}… ({cell['bytes']} bytes)")
            else:
                out.append(f"{text}… ({cell['length']} chars)")
        return out
    return [_cell(v, options) for v in _to_py(child, options)]


def _cell(value: Any, options: RenderOptions) -> str:
    if value is None:
        return ""
    text = value if isinstance(value, str) else json.dumps(jsonable(value))
    clipped, cut = _clip(text.replace("\n", " "), options.max_cell_chars)
    return f"{clipped}… ({len(text)} chars)" if cut else clipped


def _lists(array: pa.Array, valid: list[bool], options: RenderOptions) -> list[dict[str, Any]]:
    def cell(_: int, items: list[Any], length: int) -> dict[str, Any]:
        shown = jsonable(items)
        out: dict[str, Any] = {"kind": "list", "value": shown, "length": length}
        if len(items) < length:
            out["truncated"] = True
        if _unsafe_int(items):
            # What the page's JSON.stringify would print, with the integers exact.
            out["display"] = json.dumps(shown, ensure_ascii=False, separators=(",", ":"))
        return out

    return _list_cells(array, valid, options, options.max_items, _lengths(array), cell)


def _list_cells(
    array: pa.Array,
    valid: list[bool],
    options: RenderOptions,
    limit: int | None,
    lengths: list[int | None],
    build: Callable[[int, list[Any], int], dict[str, Any]],
) -> list[dict[str, Any]]:
    """One cell per row of a list column: a null cell, or what `build` makes of the
    row's index, its first `limit` items (None: all) and its full length. Only the
    shown items are converted to Python, so a row of a million tokens costs what is
    shown."""
    values = _to_py(array if limit is None else pc.list_slice(array, 0, limit), options)
    out: list[dict[str, Any]] = []
    for i, ok in enumerate(valid):
        items = values[i]
        if not ok or items is None:
            out.append({"kind": "null"})
            continue
        out.append(build(i, items, lengths[i] or 0))
    return out


# --- terminal text --------------------------------------------------------------


def cell_text(cell: Mapping[str, Any], *, indent: str) -> list[str]:
    """Lines showing one rendered cell; the first goes after the column name. Every
    line is `safe` for a terminal."""
    return [safe(line) for line in _cell_lines(cell, indent=indent)]


def _length_note(cell: Mapping[str, Any]) -> str:
    if cell.get("length") is None:
        return f"{cell['bytes']:,} bytes"
    return f"{cell['length']:,} chars"


def _cell_lines(cell: Mapping[str, Any], *, indent: str) -> list[str]:
    kind = cell["kind"]
    if kind == "null":
        return ["null"]
    if kind == "text":
        more = f"… ({_length_note(cell)})" if cell["truncated"] else f" ({_length_note(cell)})"
        return [json.dumps(cell["value"], ensure_ascii=False) + more]
    if kind == "tokens":
        ids = ", ".join(str(i) for i in cell["ids"])
        lines = [f"[{ids}{', …' if cell['truncated'] else ''}] ({cell['length']:,} tokens)"]
        if "decoded" in cell:
            more = "…" if cell["decoded_truncated"] else ""
            lines.append(
                f"{indent}decoded: {json.dumps(cell['decoded'], ensure_ascii=False)}{more}"
            )
        return lines
    if kind == "image":
        size = f"{cell['width']}x{cell['height']}" if cell["width"] is not None else "size unknown"
        return [f"{cell['format'].upper()} image {size}, {cell['bytes']:,} bytes"]
    if kind == "binary":
        return [f"{cell['bytes']:,} bytes, starts {cell['head']}"]
    if kind == "turns":
        lines = [f"{cell['length']} turn(s)" + (" (first shown)" if cell["truncated"] else "")]
        # Widths of what is printed: an escaped control character is six wide.
        columns = [safe(c) for c in cell["columns"]]
        rows = [[safe(v) for v in row] for row in cell["rows"]]
        widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(columns)]
        header = "  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))
        lines.append(indent + header.rstrip())
        for row in rows:
            lines.append(
                indent + "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip()
            )
        return lines
    if kind == "struct":
        lines = ["{"]
        for name, sub in cell["fields"].items():
            sub_lines = _cell_lines(sub, indent=indent + "  ")
            lines.append(f"{indent}  {name}: {sub_lines[0]}")
            lines.extend(sub_lines[1:])
        lines.append(indent + "}")
        return lines
    if kind == "list":
        more = ", first shown" if cell.get("truncated") else ""
        return [json.dumps(cell["value"], ensure_ascii=False) + f" ({cell['length']} items{more})"]
    return [json.dumps(cell["value"], ensure_ascii=False)]
