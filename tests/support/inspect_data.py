"""A small multimodal dataset for the inspector tests: made here, nothing downloaded.

Columns: uid (int64, = global sample index), text (string, some long), tokens
(list<int32>, the word ids of `text` in `VOCAB`), image (binary: PNG encoded with zlib
and struct, every 7th row a GIF, every 11th null), turns (list<struct<role,
content>>: chat turns). Shards have uneven row counts so batches cross shard and
shuffle-block boundaries.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

SHARD_ROWS = (37, 50, 23, 61, 29)
WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india"]
VOCAB = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}


def png(width: int, height: int, rgb: tuple[int, int, int]) -> bytes:
    """A truecolor PNG of a vertical gradient from `rgb`."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    rows = b"".join(
        b"\x00" + bytes((rgb[0], rgb[1], (rgb[2] + 8 * y) % 256)) * width for y in range(height)
    )
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )


def gif(width: int, height: int, rgb: tuple[int, int, int]) -> bytes:
    """A one-colour GIF. Its LZW stream sends a clear code before every pixel, so codes
    stay 8 bits wide and need no bit packing (valid, if not small)."""
    codes = bytes([128, 0] * (width * height) + [129])  # clear, colour 0, ..., end
    blocks = b"".join(
        bytes([len(codes[i : i + 255])]) + codes[i : i + 255] for i in range(0, len(codes), 255)
    )
    return (
        b"GIF89a"
        + struct.pack("<HHBBB", width, height, 0x80, 0, 0)  # global table of 2 colours
        + bytes(rgb)
        + b"\x00\x00\x00"
        + b"\x2c"
        + struct.pack("<HHHHB", 0, 0, width, height, 0)
        + b"\x07"
        + blocks
        + b"\x00;"
    )


def words_of(uid: int) -> list[str]:
    count = 3 + uid % 5 + (60 if uid % 13 == 0 else 0)
    return [WORDS[(uid * 7 + k * 3) % len(WORDS)] for k in range(count)]


def row(uid: int) -> dict[str, object]:
    words = words_of(uid)
    if uid % 11 == 0:
        image: bytes | None = None
    elif uid % 7 == 0:
        image = gif(10 + uid % 4, 5, (250, 200, (uid * 53) % 256))
    else:
        image = png(24 + uid % 9, 16 + uid % 5, ((uid * 37) % 256, (uid * 91) % 256, 90))
    turns = [
        {"role": "user", "content": f"question {uid}: what follows {words[0]}?"},
        {"role": "assistant", "content": " ".join(words[1:4])},
    ]
    if uid % 3 == 0:
        turns.append({"role": "user", "content": "thanks"})
    return {
        "uid": uid,
        "text": " ".join(words),
        "tokens": [VOCAB[w] for w in words],
        "image": image,
        "turns": turns,
    }


SCHEMA = pa.schema(
    [
        ("uid", pa.int64()),
        ("text", pa.string()),
        ("tokens", pa.list_(pa.int32())),
        ("image", pa.binary()),
        ("turns", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ]
)


def write(root: Path, shard_rows: tuple[int, ...] = SHARD_ROWS) -> Path:
    """Write the dataset as Parquet shards under `root`; uid is the global index."""
    root.mkdir(parents=True, exist_ok=True)
    uid = 0
    for i, n in enumerate(shard_rows):
        rows = [row(uid + k) for k in range(n)]
        uid += n
        pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), root / f"part-{i:05d}.parquet")
    return root


def write_tokenizer(path: Path) -> Path:
    """A word-level HuggingFace tokenizer.json over `VOCAB`, built with `tokenizers`."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    tok = tokenizers.Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path
