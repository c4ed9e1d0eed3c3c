from __future__ import annotations

import io
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
