"""Memory-mapping a shard file read-only without keeping a file descriptor open.

CPython's `mmap.mmap` dups the descriptor it is given and keeps the dup for the
object's life (`trackfd=False` only came in 3.13). A reader keeps up to
`datasets._Mappings.MAX_MAPPINGS` mappings across epochs, and every DataLoader worker
its own: 512 descriptors a process, whatever `RLIMIT_NOFILE` is, and a trainer under
`ulimit -n 1024` (with torch's own pipes and sockets) died of EMFILE after some epochs
with a bare OSError. So the file is mapped with libc's `mmap` through ctypes, the
descriptor is closed at once, and the mapping is handed to Arrow as a foreign buffer
whose base object unmaps it when Arrow lets go of the last buffer over it: a batch the
user still holds keeps its pages mapped, exactly as the `mmap.mmap` object did.

Where libc cannot be reached (not a POSIX libc), `mmap.mmap` is the fallback and
`KEEPS_FD` says so; `kept_mappings` then bounds the mappings a reader keeps by a share
of `RLIMIT_NOFILE`. A mapping that fails for lack of descriptors is a `CacheError`
that names the limit (`limit_error`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import resource
from pathlib import Path

import pyarrow as pa

from shardcache import errors

#: Linux's MADV_POPULATE_READ (5.14+; the mmap module of Python 3.11 has no name for it).
MADV_POPULATE_READ = 22
#: At most this share of the soft `RLIMIT_NOFILE` goes to kept mappings where each
#: keeps a descriptor (`KEEPS_FD`): the rest is the trainer's (torch's pipes, sockets,
#: its own files), and the sidecar client's.
NOFILE_SHARE = 4
#: ... but never fewer than this many (one window of shards and the next).
MIN_KEPT = 8


def _libc() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        lib.mmap.restype = ctypes.c_void_p
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.munmap.restype = ctypes.c_int
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        lib.madvise.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return lib


_LIBC = _libc()
#: Whether a mapping keeps a descriptor open for its life (the `mmap.mmap` fallback).
KEEPS_FD = _LIBC is None
_MAP_FAILED = ctypes.c_void_p(-1).value


class _Region:
    """One mapping made through libc: the base object of the Arrow buffer over it.

    Arrow holds a reference to it for as long as any buffer over the mapping lives
    (every slice of a batch included); the last one going unmaps it."""

    __slots__ = ("address", "size")

    # Held by the class, not looked up in the module's globals: a region freed while
    # the interpreter shuts down must still reach munmap.
    _munmap = _LIBC.munmap if _LIBC is not None else None

    def __init__(self, address: int, size: int) -> None:
        self.address = address
        self.size = size

    def __del__(self) -> None:
        if self._munmap is not None:
            self._munmap(self.address, self.size)


def map_file(fd: int, advice: int | None = None) -> pa.Buffer:
    """The whole of the regular file open as `fd`, mapped read-only and shared, as one
    read-only Arrow buffer (its `address` is the mapping's start). `fd` may be closed
    as soon as this returns: the mapping keeps no descriptor (unless `KEEPS_FD`).

    `advice` is given to madvise(2) over the whole mapping when the kernel knows it
    (`MADV_POPULATE_READ` fills the page table in one call); one it refuses changes
    nothing. An empty file is an empty buffer (there is nothing to map). Running out
    of descriptors or of mappings raises OSError, as mmap(2) says."""
    size = os.fstat(fd).st_size
    if size == 0:
        return pa.py_buffer(b"")
    if _LIBC is None:
        mapped = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        if advice is not None:
            # An advice this kernel does not know: the pages fault in as they are read.
            with contextlib.suppress(OSError, ValueError):
                mapped.madvise(advice)
        return pa.py_buffer(mapped)
    address = _LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if address is None or address == _MAP_FAILED:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    region = _Region(address, size)
    if advice is not None:
        # -1 (an advice this kernel does not know) changes nothing: the pages fault in
        # as they are read.
        _LIBC.madvise(address, size, advice)
    return pa.foreign_buffer(address, size, base=region)


def nofile_limit() -> int:
    """This process's soft `RLIMIT_NOFILE` (`RLIM_INFINITY` as a large number)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft if soft != resource.RLIM_INFINITY else 1 << 30


def kept_mappings(maximum: int) -> int:
    """How many mappings a reader may keep across epochs: `maximum`, or where each
    keeps a descriptor (`KEEPS_FD`), at most a `NOFILE_SHARE`th of `RLIMIT_NOFILE`."""
    if not KEEPS_FD:
        return maximum
    return max(MIN_KEPT, min(maximum, nofile_limit() // NOFILE_SHARE))


def open_fds() -> int | None:
    """How many descriptors this process has open (None where /proc cannot say)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None


def limit_error(exc: OSError, path: Path | str) -> errors.CacheError | None:
    """The clear error for mapping `path` having failed with `exc`, where `exc` is a
    lack of descriptors (EMFILE: this process's limit; ENFILE: the system's) or of
    mappings (ENOMEM from mmap: `vm.max_map_count`); None for any other error."""
    if exc.errno == errno.EMFILE:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        count = open_fds()
        found = f"{count} open" if count is not None else "all of them open"
        return errors.CacheError(
            f"{path}: cannot open the shard file: this process has no file descriptor "
            f"left (RLIMIT_NOFILE soft limit {soft}, hard {hard}; found {found}). "
            "The shard mappings keep none: look for descriptors the trainer leaks, or "
            "raise the limit (`ulimit -n`, or the container runtime's nofile)"
        )
    if exc.errno == errno.ENFILE:
        return errors.CacheError(
            f"{path}: cannot open the shard file: the node has no file descriptor left "
            "(ENFILE: the processes of the node together reached fs.file-max). Look for "
            "a process of the node that leaks them, or raise fs.file-max"
        )
    if exc.errno == errno.ENOMEM:
        return errors.CacheError(
            f"{path}: cannot map the shard file: the kernel refused one more mapping "
            "(ENOMEM: this process's mappings reached vm.max_map_count, or its address "
            "space is exhausted). Raise vm.max_map_count or look for a mapping leak"
        )
    return None
