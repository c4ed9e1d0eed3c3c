"""Bit rot in an object store: the same size, other bytes."""

from __future__ import annotations

import pyarrow.fs as pafs


def flip_bit(fs: pafs.FileSystem, path: str, offset: int) -> None:
    """Flip the lowest bit of the byte at `offset` of the object at `path`."""
    with fs.open_input_stream(path) as f:
        content = bytearray(f.read())
    content[offset] ^= 0x01
    with fs.open_output_stream(path) as out:
        out.write(bytes(content))
