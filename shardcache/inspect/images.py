"""Recognise images in binary cells by their magic bytes, stdlib only.

Only the header is parsed (format, width, height); pixels are never decoded, so a
cell of any size costs a few bytes of work and no image library is needed.
"""

from __future__ import annotations

import dataclasses
import struct

_PNG = b"\x89PNG\r\n\x1a\n"
# SOF markers carry the frame size; C4 (DHT), C8 (JPG) and CC (DAC) share the range.
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
# Markers that stand alone, without a length field.
_JPEG_BARE = frozenset({0x01, *range(0xD0, 0xD9)})
#: Bytes every format but JPEG is recognised from (JPEG walks its marker segments).
_HEAD = 64


@dataclasses.dataclass(frozen=True)
class ImageInfo:
    format: str
    mime: str
    #: Pixels; None when the header is truncated before the size.
    width: int | None
    height: int | None


def sniff(data: bytes | memoryview) -> ImageInfo | None:
    """The image format and size of `data`, or None when it is not an image we know.

    `data` may be a cell in place (a byte memoryview): only the header is copied."""
    head = bytes(data[:_HEAD])
    if head.startswith(_PNG):
        return _png(head)
    if head[:3] == b"\xff\xd8\xff":
        return _jpeg(data)
    if head[:6] in (b"GIF87a", b"GIF89a"):
        size = struct.unpack("<HH", head[6:10]) if len(head) >= 10 else (None, None)
        return ImageInfo("gif", "image/gif", *size)
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return _webp(head)
    if head[:2] == b"BM" and len(head) >= 26:
        width, height = struct.unpack("<ii", head[18:26])
        return ImageInfo("bmp", "image/bmp", width, abs(height))
    return None


def _png(data: bytes) -> ImageInfo:
    if len(data) >= 24 and data[12:16] == b"IHDR":
        width, height = struct.unpack(">II", data[16:24])
        return ImageInfo("png", "image/png", width, height)
    return ImageInfo("png", "image/png", None, None)


def _jpeg(data: bytes | memoryview) -> ImageInfo:
    i = 2
    while i + 4 <= len(data):
        if data[i] != 0xFF:
            break
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in _JPEG_BARE:
            i += 2
            continue
        if marker in _JPEG_SOF and i + 9 <= len(data):
            height, width = struct.unpack(">HH", data[i + 5 : i + 9])
            return ImageInfo("jpeg", "image/jpeg", width, height)
        if marker == 0xDA:  # start of scan: no frame header came before it
            break
        (length,) = struct.unpack(">H", data[i + 2 : i + 4])
        i += 2 + length
    return ImageInfo("jpeg", "image/jpeg", None, None)


def _webp(data: bytes) -> ImageInfo:
    chunk = data[12:16]
    width: int | None = None
    height: int | None = None
    if chunk == b"VP8 " and len(data) >= 30 and data[23:26] == b"\x9d\x01\x2a":
        w, h = struct.unpack("<HH", data[26:30])
        width, height = w & 0x3FFF, h & 0x3FFF
    elif chunk == b"VP8L" and len(data) >= 25 and data[20] == 0x2F:
        (bits,) = struct.unpack("<I", data[21:25])
        width, height = (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    elif chunk == b"VP8X" and len(data) >= 30:
        width = 1 + int.from_bytes(data[24:27], "little")
        height = 1 + int.from_bytes(data[27:30], "little")
    return ImageInfo("webp", "image/webp", width, height)
