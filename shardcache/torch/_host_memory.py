"""Page-locking the shard mappings a trainer holds, so the GPU copies straight from them.

A copy from pageable memory goes through the driver's own staging buffer at a fraction
of the link's speed; the same mapping registered with `cudaHostRegister` is copied by
DMA at the pinned rate (issue 16 measured 54.5 against 6.7 GB/s on an H200 host, for a
1 GiB decoded shard on tmpfs). The memory tier's files are mapped read-only, which
needs `cudaHostRegisterReadOnly`; drivers that refuse it leave the range unregistered
and the prefetcher stages those copies through pinned buffers instead.

Registration follows the mapping's lifetime (`datasets.MappingListener`): a mapping is
registered when the reader maps it, which it does while holding the shard's lease, so
nothing the memory tier wants to evict is ever pinned; it is unregistered, after the
copies in flight from it are done, before the reader lets the mapping go.
"""

from __future__ import annotations

import bisect
import ctypes
import dataclasses
import glob
import os
import sys
from collections.abc import Callable
from typing import Protocol

import pyarrow as pa

#: cudaHostRegisterReadOnly: the range is only read by the device (a PROT_READ mapping).
CUDA_HOST_REGISTER_READ_ONLY = 0x08
#: cudaMemcpyDefault: the direction is read off the pointers (unified addressing).
CUDA_MEMCPY_DEFAULT = 4


class Registrar(Protocol):
    def register(self, address: int, size: int) -> bool:
        """Page-lock [address, address + size); False where the driver refuses."""
        ...

    def unregister(self, address: int) -> None: ...


class CudaRegistrar:
    """cudaHostRegister/cudaHostUnregister through the CUDA runtime torch loaded."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._lib = library
        self._lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self._lib.cudaHostRegister.restype = ctypes.c_int
        self._lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
        self._lib.cudaHostUnregister.restype = ctypes.c_int
        self._lib.cudaGetLastError.restype = ctypes.c_int
        self._lib.cudaMemcpyAsync.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_void_p,
        ]
        self._lib.cudaMemcpyAsync.restype = ctypes.c_int
        self._copy = self._lib.cudaMemcpyAsync
        #: The error of the last refused registration (for reports), 0 if none.
        self.last_error = 0

    @classmethod
    def load(cls) -> CudaRegistrar | None:
        """The CUDA runtime library this process has loaded (torch loads it with
        CUDA), else one installed beside torch; None if there is none."""
        paths: list[str] = []
        try:
            with open("/proc/self/maps") as maps:
                paths += sorted({ln.split()[-1] for ln in maps if "libcudart.so" in ln})
        except OSError:
            pass
        for entry in sys.path:
            paths += sorted(glob.glob(os.path.join(entry, "nvidia", "*", "lib", "libcudart.so*")))
        for path in paths:
            try:
                return cls(ctypes.CDLL(path))
            except (OSError, AttributeError):
                continue
        return None

    def register(self, address: int, size: int) -> bool:
        code = self._lib.cudaHostRegister(address, size, CUDA_HOST_REGISTER_READ_ONLY)
        if code != 0:
            # Clear the runtime's sticky last error: torch checks it after kernel
            # launches and would report this refusal as its own failure.
            self._lib.cudaGetLastError()
            self.last_error = code
            return False
        return True

    def unregister(self, address: int) -> None:
        if self._lib.cudaHostUnregister(address) != 0:
            self._lib.cudaGetLastError()

    def copy_async(self, target: int, address: int, size: int, stream: int) -> None:
        """Queue a copy of `size` bytes at host `address` (inside a registered mapping)
        to device `target` on `stream` (a cudaStream_t as an int).

        One runtime call: torch's `copy_` costs tens of microseconds of CPU per copy,
        which at four copies per 16 MiB batch was a fifth of the prefetcher's CPU share
        while the link took about 0.3 ms per batch (docs/adapters.md)."""
        code = self._copy(target, address, size, CUDA_MEMCPY_DEFAULT, stream)
        if code != 0:
            self._lib.cudaGetLastError()
            raise RuntimeError(f"cudaMemcpyAsync of {size} bytes failed: CUDA error {code}")


@dataclasses.dataclass
class _Range:
    size: int
    #: Holds the mapping open until it is unregistered.
    root: pa.Buffer


class Registry:
    """The registered mappings of one reader (a `datasets.MappingListener`)."""

    def __init__(self, registrar: Registrar, *, settle: Callable[[], None]) -> None:
        self._registrar = registrar
        #: Copies from the registered mappings with one runtime call each, where the
        #: registrar is the CUDA runtime's (None: torch's `copy_`).
        self.copy_async = registrar.copy_async if isinstance(registrar, CudaRegistrar) else None
        #: Waits for the copies in flight (a stream synchronize) before unregistering.
        self._settle = settle
        self._ranges: dict[int, _Range] = {}
        self._starts: list[int] = []
        self.registered = 0
        self.refused = 0

    def mapped(self, root: pa.Buffer) -> None:
        if not root.size or root.address in self._ranges:
            return
        if not self._registrar.register(root.address, root.size):
            self.refused += 1
            return
        self.registered += 1
        self._ranges[root.address] = _Range(root.size, root)
        bisect.insort(self._starts, root.address)

    def dropped(self, root: pa.Buffer) -> None:
        if root.address not in self._ranges:
            return
        self._settle()
        self._registrar.unregister(root.address)
        del self._ranges[root.address]
        self._starts.remove(root.address)

    def covers(self, address: int, size: int) -> bool:
        """Whether [address, address + size) lies inside one registered mapping."""
        return self.locate(address, size) is not None

    def locate(self, address: int, size: int) -> int | None:
        """The start of the registered mapping [address, address + size) lies in, or
        None."""
        i = bisect.bisect_right(self._starts, address) - 1
        if i < 0:
            return None
        start = self._starts[i]
        return start if address + size <= start + self._ranges[start].size else None

    def root(self, start: int) -> pa.Buffer:
        """The registered mapping that starts at `start` (see `locate`)."""
        return self._ranges[start].root

    def close(self) -> None:
        if self._ranges:
            self._settle()
        for start in list(self._ranges):
            self._registrar.unregister(start)
        self._ranges.clear()
        self._starts.clear()
