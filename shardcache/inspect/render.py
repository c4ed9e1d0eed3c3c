"""Render cell values readably: a JSON-able description per cell, and terminal text.

Each cell becomes a dict with a `kind`: text (truncated, full length kept), tokens
(ids, optionally decoded), image (format, size, dimensions from magic bytes), binary,
turns (a `list<struct>` as a table), struct, list, value, null. The terminal, the TUI
and the web inspector all show these same dicts.
"""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.types as pat

from shardcache import errors
from shardcache.inspect import images

Decode = Callable[[list[int]], str]


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


FULL = RenderOptions(max_chars=None, max_tokens=None, max_turns=None, max_cell_chars=10_000)


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


def _is_tokens(dtype: pa.DataType) -> bool:
    is_list = pat.is_list(dtype) or pat.is_large_list(dtype) or pat.is_fixed_size_list(dtype)
    return bool(is_list and pat.is_integer(dtype.value_type))


def _is_turns(dtype: pa.DataType) -> bool:
    is_list = pat.is_list(dtype) or pat.is_large_list(dtype)
    return bool(is_list and pat.is_struct(dtype.value_type))


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
    if isinstance(value, datetime.date | datetime.time | datetime.datetime):
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, Sequence):
        return [jsonable(v) for v in value]
    return str(value)


def render_value(
    value: Any,
    dtype: pa.DataType,
    *,
    options: RenderOptions = RenderOptions(),
    decode: Decode | None = None,
) -> dict[str, Any]:
    """Describe one cell for display; `value` is the cell as Python (`to_pylist`)."""
    if value is None:
        return {"kind": "null"}
    if pat.is_string(dtype) or pat.is_large_string(dtype):
        text, cut = _clip(value, options.max_chars)
        return {"kind": "text", "value": text, "length": len(value), "truncated": cut}
    if pat.is_binary(dtype) or pat.is_large_binary(dtype) or pat.is_fixed_size_binary(dtype):
        info = images.sniff(value)
        if info is not None:
            return {"kind": "image", "bytes": len(value), **dataclasses.asdict(info)}
        return {"kind": "binary", "bytes": len(value), "head": value[:16].hex()}
    if _is_tokens(dtype):
        ids = list(value)
        shown = ids if options.max_tokens is None else ids[: options.max_tokens]
        out: dict[str, Any] = {
            "kind": "tokens",
            "ids": shown,
            "length": len(ids),
            "truncated": len(shown) < len(ids),
        }
        if decode is not None:
            text, cut = _clip(decode(ids), options.max_chars)
            out["decoded"] = text
            out["decoded_truncated"] = cut
        return out
    if _is_turns(dtype):
        fields = [f.name for f in dtype.value_type]
        turns = list(value)
        shown = turns if options.max_turns is None else turns[: options.max_turns]
        rows = [
            [_cell(turn.get(name) if turn else None, options) for name in fields] for turn in shown
        ]
        return {
            "kind": "turns",
            "columns": fields,
            "rows": rows,
            "length": len(turns),
            "truncated": len(shown) < len(turns),
        }
    if pat.is_struct(dtype):
        return {
            "kind": "struct",
            "fields": {
                f.name: render_value(value.get(f.name), f.type, options=options, decode=decode)
                for f in dtype
            },
        }
    if pat.is_list(dtype) or pat.is_large_list(dtype) or pat.is_fixed_size_list(dtype):
        return {"kind": "list", "value": jsonable(value), "length": len(value)}
    return {"kind": "value", "value": jsonable(value)}


def _cell(value: Any, options: RenderOptions) -> str:
    if value is None:
        return ""
    text = value if isinstance(value, str) else json.dumps(jsonable(value))
    clipped, cut = _clip(text.replace("\n", " "), options.max_cell_chars)
    return f"{clipped}… ({len(text)} chars)" if cut else clipped


# --- terminal text --------------------------------------------------------------


def cell_text(cell: Mapping[str, Any], *, indent: str) -> list[str]:
    """Lines showing one rendered cell; the first goes after the column name."""
    kind = cell["kind"]
    if kind == "null":
        return ["null"]
    if kind == "text":
        more = (
            f"… ({cell['length']:,} chars)" if cell["truncated"] else f" ({cell['length']:,} chars)"
        )
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
        widths = [
            max([len(c)] + [len(r[i]) for r in cell["rows"]]) for i, c in enumerate(cell["columns"])
        ]
        header = "  ".join(c.ljust(w) for c, w in zip(cell["columns"], widths, strict=True))
        lines.append(indent + header.rstrip())
        for row in cell["rows"]:
            lines.append(
                indent + "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip()
            )
        return lines
    if kind == "struct":
        lines = ["{"]
        for name, sub in cell["fields"].items():
            sub_lines = cell_text(sub, indent=indent + "  ")
            lines.append(f"{indent}  {name}: {sub_lines[0]}")
            lines.extend(sub_lines[1:])
        lines.append(indent + "}")
        return lines
    if kind == "list":
        return [json.dumps(cell["value"], ensure_ascii=False) + f" ({cell['length']} items)"]
    return [json.dumps(cell["value"], ensure_ascii=False)]
