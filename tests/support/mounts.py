"""A real tmpfs of a given size, for the tests that need the kernel, not the cache's
bookkeeping, to say a volume is full (the run volume the webhook sizes, a disk volume
with little room). Needs root: those tests skip without it."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def tmpfs(path: Path, size: int) -> Iterator[Path]:
    """`path`, a tmpfs of `size` bytes for the block, unmounted after it."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)
