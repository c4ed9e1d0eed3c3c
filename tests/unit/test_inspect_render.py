from __future__ import annotations

import dataclasses
import io
import json
import re
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pytest
from PIL import Image

from shardcache import errors
from shardcache.inspect import images, render
from tests.support import inspect_data

pytestmark = pytest.mark.unit


def encoded(fmt: str, size: tuple[int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, (200, 30, 90)).save(out, format=fmt)
    return out.getvalue()


@pytest.mark.parametrize(
    "fmt,name,mime",
    [
        ("PNG", "png", "image/png"),
        ("JPEG", "jpeg", "image/jpeg"),
        ("GIF", "gif", "image/gif"),
        ("WEBP", "webp", "image/webp"),
        ("BMP", "bmp", "image/bmp"),
    ],
)
@pytest.mark.parametrize("size", [(1, 1), (37, 21), (640, 480)])
def test_image_format_and_size_come_from_the_header(
    fmt: str, name: str, mime: str, size: tuple[int, int]
) -> None:
    assert images.sniff(encoded(fmt, size)) == images.ImageInfo(name, mime, *size)


def test_lossless_webp_size_is_read() -> None:
    out = io.BytesIO()
    Image.new("RGB", (33, 17)).save(out, format="WEBP", lossless=True)
    assert images.sniff(out.getvalue()) == images.ImageInfo("webp", "image/webp", 33, 17)


def test_our_stdlib_png_encoder_is_a_real_png() -> None:
    data = inspect_data.png(24, 16, (1, 2, 3))
    assert Image.open(io.BytesIO(data)).size == (24, 16)
    assert images.sniff(data) == images.ImageInfo("png", "image/png", 24, 16)


@pytest.mark.parametrize("data", [b"", b"hello world", b"\x00" * 64, b"RIFF1234WAVE"])
def test_bytes_that_are_no_image_are_not_called_one(data: bytes) -> None:
    assert images.sniff(data) is None


def test_truncated_png_is_still_a_png_of_unknown_size() -> None:
    assert images.sniff(encoded("PNG", (5, 5))[:12]) == images.ImageInfo(
        "png", "image/png", None, None
    )


def test_long_text_is_truncated_with_its_full_length() -> None:
    cell = render.render_value("x" * 500, pa.string(), options=render.RenderOptions(max_chars=10))
    assert cell == {"kind": "text", "value": "x" * 10, "length": 500, "truncated": True}
    assert render.cell_text(cell, indent="") == ['"xxxxxxxxxx"… (500 chars)']


def test_token_ids_are_decoded_with_a_tokenizer_json(tmp_path: Path) -> None:
    decode = render.load_tokenizer(str(inspect_data.write_tokenizer(tmp_path / "tok.json")))
    ids = [inspect_data.VOCAB[w] for w in ("echo", "golf", "alpha")]
    cell = render.render_value(ids, pa.list_(pa.int32()), decode=decode)
    assert cell["ids"] == ids
    assert cell["length"] == 3
    assert cell["decoded"] == "echo golf alpha"


def test_missing_tokenizer_file_is_an_input_error(tmp_path: Path) -> None:
    with pytest.raises(errors.InputError, match=r"expected a HuggingFace tokenizer\.json"):
        render.load_tokenizer(str(tmp_path / "nope.json"))


def test_token_ids_beyond_the_limit_are_counted() -> None:
    cell = render.render_value(
        list(range(100)), pa.list_(pa.int32()), options=render.RenderOptions(max_tokens=4)
    )
    assert cell["ids"] == [0, 1, 2, 3]
    assert cell["length"] == 100
    assert cell["truncated"] is True


def test_chat_turns_render_as_a_table() -> None:
    dtype = inspect_data.SCHEMA.field("turns").type
    turns = [{"role": "user", "content": "hi\nthere"}, {"role": "assistant", "content": None}]
    cell = render.render_value(turns, dtype)
    assert cell["kind"] == "turns"
    assert cell["columns"] == ["role", "content"]
    assert cell["rows"] == [["user", "hi there"], ["assistant", ""]]
    lines = render.cell_text(cell, indent="  ")
    assert lines[0] == "2 turn(s)"
    assert lines[1].split() == ["role", "content"]
    assert lines[2].split() == ["user", "hi", "there"]


def test_image_cell_reports_format_bytes_and_dimensions() -> None:
    data = inspect_data.png(30, 20, (0, 0, 0))
    cell = render.render_value(data, pa.binary())
    assert cell == {
        "kind": "image",
        "bytes": len(data),
        "format": "png",
        "mime": "image/png",
        "width": 30,
        "height": 20,
    }
    assert render.cell_text(cell, indent="") == [f"PNG image 30x20, {len(data):,} bytes"]


def test_other_binary_shows_size_and_first_bytes() -> None:
    cell = render.render_value(b"\x01\x02abc", pa.binary())
    assert cell == {"kind": "binary", "bytes": 5, "head": "0102616263"}


def test_nested_struct_renders_each_field() -> None:
    dtype = pa.struct([("a", pa.int64()), ("b", pa.string())])
    cell = render.render_value({"a": 1, "b": None}, dtype)
    assert cell == {
        "kind": "struct",
        "fields": {"a": {"kind": "value", "value": 1}, "b": {"kind": "null"}},
    }


# --- terminal safety (escape sequences from the data) -----------------------------

ESC = "\x1b"
#: An OSC 52 clipboard write, a screen clear, a C1 CSI, DEL, a bidi override.
HOSTILE = f"hi {ESC}]52;c;cm0gLXJmIH4K\x07{ESC}[2J\x9b31m\x7f\u202egnp.exe"
CONTROL = re.compile(
    r"[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]"
)


def test_safe_shows_control_characters_and_bidi_overrides_escaped() -> None:
    shown = render.safe(HOSTILE)
    assert not CONTROL.search(shown)
    assert shown == ("hi \\u001b]52;c;cm0gLXJmIH4K\\u0007\\u001b[2J\\u009b31m\\u007f\\u202egnp.exe")
    assert render.safe(shown) == shown
    assert render.safe_lines("a\x1bb\nc") == "a\\u001bb\nc"


def test_json_for_a_terminal_keeps_its_meaning_without_raw_c1_or_bidi() -> None:
    text = json.dumps({"v": "a\x9bb\u202ec\x7f"}, ensure_ascii=False)
    safe = render.safe_json(text)
    assert not CONTROL.search(safe)
    assert json.loads(safe) == {"v": "a\x9bb\u202ec\x7f"}


def test_turns_struct_fields_and_names_print_no_control_character() -> None:
    turns_type = pa.list_(pa.struct([(f"role{ESC}[1A", pa.string()), ("content", pa.string())]))
    turns = render.render_value(
        [{f"role{ESC}[1A": f"user{ESC}[8m", "content": HOSTILE}], turns_type
    )
    struct_type = pa.struct([(f"k{ESC}[31m", pa.string()), ("n", pa.int64())])
    struct = render.render_value({f"k{ESC}[31m": HOSTILE, "n": 1}, struct_type)
    text = render.render_value(HOSTILE, pa.string())
    for cell in (turns, struct, text):
        lines = render.cell_text(cell, indent="  ")
        assert not CONTROL.search("".join(lines)), lines
        assert "\\u001b" in "".join(lines)


# --- values JavaScript or Python's datetime cannot hold ---------------------------


@pytest.mark.parametrize(
    "array,shown",
    [
        (
            pa.array([1_700_000_000_123_456_789], pa.timestamp("ns")),
            "2023-11-14T22:13:20.123456789",
        ),
        (
            pa.array([1_700_000_000_123_456_789], pa.timestamp("ns", tz="UTC")),
            "2023-11-14T22:13:20.123456789Z",
        ),
        (pa.array([5], pa.duration("ns")), "5 ns"),
        (pa.array([7], pa.time64("ns")), "00:00:00.000000007"),
        # Year 19969: past Python's datetime.
        (pa.array([568_000_000_000_000], pa.timestamp("ms")), "19969-03-16T01:46:40.000"),
    ],
)
def test_temporal_values_render_exactly_through_arrow(array: pa.Array, shown: str) -> None:
    assert render.render_column(array) == [{"kind": "value", "value": shown}]


def test_nested_nanosecond_timestamps_render() -> None:
    array = pa.array([[1, 2]], pa.list_(pa.timestamp("ns")))
    assert render.render_column(array)[0]["value"] == [
        "1970-01-01 00:00:00.000000001",
        "1970-01-01 00:00:00.000000002",
    ]


def test_integers_beyond_2_53_carry_their_exact_text() -> None:
    big = 2**62 + 1
    assert render.render_value(big, pa.int64()) == {
        "kind": "value",
        "value": big,
        "display": "4611686018427387905",
    }
    assert render.render_value(2**64 - 1, pa.uint64())["display"] == "18446744073709551615"
    assert "display" not in render.render_value(2**53 - 1, pa.int64())
    # Token ids (a list of integers) and any other list.
    assert render.render_value([big, 1], pa.list_(pa.int64()))["display"] == (
        "4611686018427387905, 1"
    )
    assert render.render_value([[big], [1]], pa.list_(pa.list_(pa.int64())))["display"] == (
        "[[4611686018427387905],[1]]"
    )
    nested = render.render_value({"id": big}, pa.struct([("id", pa.uint64())]))
    assert nested["fields"]["id"]["display"] == str(big)


# --- bounded cost: clipped in Arrow before anything becomes Python -----------------


def page_like(**changes: object) -> render.RenderOptions:
    """Options as the web page's: clipped, long texts measured in bytes."""
    options = render.RenderOptions(max_chars=2000, max_tokens=256, max_turns=50, max_cell_chars=500)
    return dataclasses.replace(options, max_count_bytes=64 << 10, **changes)


def test_long_documents_are_clipped_before_they_become_python() -> None:
    doc = "é" + "x" * (4 << 20)  # 4 MiB each
    column = pa.chunked_array([pa.array([f"{i} {doc}" for i in range(16)] + [None, "short"])])
    budget = render.Budget(32 << 20)
    tracemalloc.start()
    try:
        cells = render.render_column(column, options=page_like(budget=budget))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # 64 MiB of text; what became Python is the clipped part.
    assert peak < 4 << 20, peak
    assert budget.used < 1 << 20
    first = cells[0]
    assert first["value"] == f"0 {doc}"[:2000]
    assert first["truncated"] is True
    # Counting 4 Mi characters would read them all: the size is given in bytes.
    assert first["length"] is None
    assert first["bytes"] == len(f"0 {doc}".encode())
    assert cells[16] == {"kind": "null"}
    assert cells[17] == {"kind": "text", "value": "short", "length": 5, "truncated": False}


def test_a_clipped_text_under_the_count_limit_reports_its_characters() -> None:
    cell = render.render_column(pa.array(["é" * 3000]), options=page_like())[0]
    assert cell == {"kind": "text", "value": "é" * 2000, "length": 3000, "truncated": True}


def test_an_answer_over_its_budget_is_refused_naming_the_limit() -> None:
    column = pa.array([list(range(1000))] * 100, pa.list_(pa.float64()))
    options = page_like(max_items=None, budget=render.Budget(1 << 16))
    with pytest.raises(errors.InputError, match="over the inspector's limit of 65,536"):
        render.render_column(column, options=options)


def test_a_huge_image_cell_is_sniffed_in_place() -> None:
    image = inspect_data.png(30, 20, (0, 0, 0)) + b"\x00" * (8 << 20)
    tracemalloc.start()
    try:
        cells = render.render_column(pa.array([image] * 4, pa.large_binary()))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
    assert cells[0]["kind"] == "image"
    assert (cells[0]["width"], cells[0]["height"], cells[0]["bytes"]) == (30, 20, len(image))


def test_token_lists_and_turns_are_clipped_with_their_lengths() -> None:
    tokens = render.render_column(
        pa.array([list(range(10_000))], pa.list_(pa.int32())), options=page_like()
    )[0]
    assert tokens["ids"] == list(range(256))
    assert (tokens["length"], tokens["truncated"]) == (10_000, True)
    dtype = inspect_data.SCHEMA.field("turns").type
    turns = [{"role": "user", "content": "y" * 5000}] * 80
    cell = render.render_column(pa.array([turns], dtype), options=page_like())[0]
    assert (cell["length"], len(cell["rows"]), cell["truncated"]) == (80, 50, True)
    assert cell["rows"][0] == ["user", "y" * 500 + "… (5000 chars)"]


def test_columns_render_as_cells_rendered_one_by_one(tmp_path: Path) -> None:
    """render_column is render_value per cell, every kind of the test dataset, nulls
    and chunks included."""
    table = pa.Table.from_pylist(
        [inspect_data.row(i) for i in range(60)], schema=inspect_data.SCHEMA
    )
    for options in (render.FULL, render.RenderOptions(), page_like()):
        for name in table.schema.names:
            column = table.column(name)
            column = pa.chunked_array([column.slice(0, 25), column.slice(25)])
            t = table.schema.field(name).type
            expected = [render.render_value(v, t, options=options) for v in column.to_pylist()]
            assert render.render_column(column, options=options) == expected
