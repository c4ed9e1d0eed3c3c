"""Arrow IPC messages read from their metadata alone: row counts and decoded sizes.

An Arrow IPC stream (and a file after its 8-byte magic) is a sequence of messages:
`0xFFFFFFFF`, the metadata length (int32), a `Message` flatbuffer (Message.fbs), then
`bodyLength` bytes of buffers. A record batch's metadata holds its row count and the
offset and length of every buffer; a compressed buffer starts with its uncompressed
length (int64, -1 when stored as is). So the rows, and the bytes the shard takes once
decoded, are known from the metadata and 8 bytes per buffer, without decompressing
anything: a 10 KB file that would decode to 1 GiB is counted in kilobytes of memory
(issue 13, row 3; docs/security.md). The flatbuffer reading below is the small subset
of the format those fields need.
"""

from __future__ import annotations

import dataclasses
import struct

import pyarrow as pa

from shardcache import errors

_CONTINUATION = b"\xff\xff\xff\xff"
_FILE_MAGIC = b"ARROW1"
#: MessageHeader union members (Message.fbs).
_SCHEMA, _DICTIONARY_BATCH, _RECORD_BATCH = 1, 2, 3
#: Largest metadata of one message: far beyond any real schema or batch header.
MAX_METADATA = 64 << 20


@dataclasses.dataclass(frozen=True)
class Totals:
    rows: int
    #: Bytes of the uncompressed buffers of every record and dictionary batch: what
    #: the shard takes in memory once decoded (before being combined into one batch).
    decoded_bytes: int


class _Table:
    """One flatbuffer table: fields by slot, defaults when absent."""

    def __init__(self, buf: bytes, pos: int) -> None:
        self.buf, self.pos = buf, pos
        vtable = pos - _i32(buf, pos)
        self.vsize = _u16(buf, vtable)
        self.vtable = vtable

    def _field(self, slot: int) -> int:
        entry = 4 + 2 * slot
        if entry >= self.vsize:
            return 0
        offset = _u16(self.buf, self.vtable + entry)
        return self.pos + offset if offset else 0

    def scalar(self, slot: int, fmt: str, default: int = 0) -> int:
        at = self._field(slot)
        return int(struct.unpack_from("<" + fmt, self.buf, at)[0]) if at else default

    def table(self, slot: int) -> _Table | None:
        at = self._field(slot)
        return _Table(self.buf, at + _u32(self.buf, at)) if at else None

    def structs(self, slot: int, size: int) -> list[bytes]:
        at = self._field(slot)
        if not at:
            return []
        vec = at + _u32(self.buf, at)
        count = _u32(self.buf, vec)
        if vec + 4 + count * size > len(self.buf):
            raise errors.InputError("Arrow IPC metadata: a vector runs past its message")
        return [self.buf[vec + 4 + i * size : vec + 4 + (i + 1) * size] for i in range(count)]


def _u16(buf: bytes, at: int) -> int:
    return int(struct.unpack_from("<H", buf, at)[0])


def _u32(buf: bytes, at: int) -> int:
    return int(struct.unpack_from("<I", buf, at)[0])


def _i32(buf: bytes, at: int) -> int:
    return int(struct.unpack_from("<i", buf, at)[0])


def _read_exactly(source: pa.NativeFile, size: int) -> bytes:
    data = source.read(size)
    if len(data) != size:
        raise errors.InputError(f"Arrow IPC: truncated ({len(data)} of {size} bytes)")
    return bytes(data)


def _batch_bytes(source: pa.NativeFile, batch: _Table, body_start: int) -> int:
    """Decoded bytes of one batch's buffers (reading 8 bytes per compressed buffer)."""
    compressed = batch.table(3) is not None
    total = 0
    for raw in batch.structs(2, 16):
        offset, length = struct.unpack("<qq", raw)
        if offset < 0 or length < 0:
            raise errors.InputError("Arrow IPC metadata: a buffer with a negative offset or size")
        if not compressed or length == 0:
            total += length
            continue
        if length < 8:
            raise errors.InputError("Arrow IPC: a compressed buffer shorter than its header")
        source.seek(body_start + offset)
        (uncompressed,) = struct.unpack("<q", _read_exactly(source, 8))
        total += length - 8 if uncompressed == -1 else uncompressed
    return total


def totals(source: pa.NativeFile) -> Totals:
    """Rows and decoded bytes of an Arrow IPC file or stream, from message metadata.

    Raises `InputError` for bytes that are not Arrow IPC messages.
    """
    source.seek(0)
    head = source.read(8)
    start = 8 if bytes(head[:6]) == _FILE_MAGIC else 0
    size = source.size()
    position = start
    rows = decoded = 0
    while position + 4 <= size:
        source.seek(position)
        word = _read_exactly(source, 4)
        position += 4
        if word == _CONTINUATION:
            length = struct.unpack("<i", _read_exactly(source, 4))[0]
            position += 4
        else:
            length = struct.unpack("<i", word)[0]  # the pre-1.0 format had no marker
        if length == 0:
            break  # end of stream (the file's footer follows)
        if not 0 < length <= MAX_METADATA or position + length > size:
            raise errors.InputError(f"Arrow IPC: a message of {length} bytes of metadata")
        meta = _read_exactly(source, length)
        position += length
        message = _Table(meta, _u32(meta, 0))
        kind = message.scalar(1, "B")
        body_length = message.scalar(3, "q")
        if body_length < 0 or position + body_length > size:
            raise errors.InputError(f"Arrow IPC: a message body of {body_length} bytes")
        header = message.table(2)
        if kind == _RECORD_BATCH and header is not None:
            rows += header.scalar(0, "q")
            decoded += _batch_bytes(source, header, position)
        elif kind == _DICTIONARY_BATCH and header is not None:
            data = header.table(1)
            if data is not None:
                decoded += _batch_bytes(source, data, position)
        position += body_length
    return Totals(rows=rows, decoded_bytes=decoded)
