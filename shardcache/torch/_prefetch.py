"""`DevicePrefetcher`: batches copied to the GPU ahead of the training step, with no
copy of their values on the CPU.

Each batch's pieces are copied from the memory-tier mappings the reader holds, which
are registered with the CUDA driver (`_host_memory`), on a stream of its own, `depth`
batches ahead; concatenation, offsets and padding then run on the device, where memory
bandwidth is two orders above the host link. The training stream waits on each batch's
copy event before it is handed over, so the hand-over never blocks the host.

Pieces outside a registered mapping (the driver refused the registration, or the
mapping was made before this prefetcher) are staged through pinned buffers: one CPU
copy, still asynchronous. Without CUDA (or with `device="cpu"`) the batches are the
plain path's tensors, unchanged.

The state (`state_dict()`) counts the batches handed over, not those in flight: a
resume reads again what was prefetched but never given to the training loop.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa
import torch
import torch.utils.dlpack

from shardcache import columns, stalls
from shardcache.torch import _datasets, _host_memory, _tensors


@dataclasses.dataclass
class Stats:
    """What the prefetcher did, for benchmarks and logs."""

    batches: int = 0
    #: Bytes copied by DMA straight from registered mappings.
    direct_bytes: int = 0
    #: Bytes copied through a pinned staging buffer (a CPU copy each).
    staged_bytes: int = 0
    registered: int = 0
    refused: int = 0


@dataclasses.dataclass
class _InFlight:
    tensors: dict[str, torch.Tensor]
    done: Any
    state: dict[str, Any]
    #: Host memory the copies read from, alive until they finish.
    keep: list[Any]


# torch leaves these constructors unannotated; named once here, typed as callables.
_new_stream: Callable[[torch.device], Any] = torch.cuda.Stream
_new_event: Callable[[], Any] = torch.cuda.Event


def default_device(local_rank: int) -> torch.device:
    """This rank's GPU (LOCAL_RANK), or the CPU where CUDA is absent."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


class DevicePrefetcher:
    """Iterate `dataset`'s batches as tensors on `device`, `depth` batches ahead.

    `device` defaults to the rank's GPU; `register=False` skips registering the
    mappings (everything is staged). Reads in this process (no DataLoader workers:
    there is no CPU work left to spread over them).
    """

    def __init__(
        self,
        dataset: _datasets.IterableDataset,
        *,
        device: torch.device | str | None = None,
        depth: int = 2,
        register: bool = True,
    ) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.dataset = dataset
        self.device = (
            torch.device(device) if device is not None else default_device(dataset.local_rank)
        )
        self.depth = depth
        self.register = register
        self.stats = Stats()
        #: How long the training loop waited for batches, against its steps.
        self.stalls = stalls.StallMeter()
        self._state: dict[str, Any] | None = None
        self._registered: _host_memory.Registry | None = None
        self._stream: Any = None

    # --- state --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where the batches handed over so far end."""
        return self._state if self._state is not None else self.dataset.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)
        self._state = None

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)
        self._state = None

    # --- iteration ----------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        batches = self._cuda() if self.device.type == "cuda" else self._plain()
        return self.stalls.wrap(batches)

    def _plain(self) -> Iterator[dict[str, torch.Tensor]]:
        reader = self.dataset.reader()
        self._state = reader.state_dict()
        for batch in reader:
            tensors = self.dataset.collate(batch)
            self._state = reader.state_dict()
            self.stats.batches += 1
            yield tensors

    def _registry(self, stream: Any) -> _host_memory.Registry | None:
        # One registry for the prefetcher's life: mappings stay registered across
        # epochs while the reader keeps them (they are re-read at the pinned rate), and
        # go when the reader drops them or `close()` is called.
        if self._registered is None and self.register:
            registrar = _host_memory.CudaRegistrar.load()
            if registrar is not None:
                self._registered = _host_memory.Registry(registrar, settle=stream.synchronize)
                self.dataset.shardcache_dataset().add_mapping_listener(self._registered)
        return self._registered

    def _cuda(self) -> Iterator[dict[str, torch.Tensor]]:
        device = self.device
        if self._stream is None:
            self._stream = _new_stream(device)
        stream = self._stream
        registry = self._registry(stream)
        reader = self.dataset.reader()
        self._state = reader.state_dict()
        queue: collections.deque[_InFlight] = collections.deque()
        try:
            for batch in reader:
                keep: list[Any] = []
                move = functools.partial(self._copy, registry=registry, keep=keep)
                with torch.cuda.device(device), torch.cuda.stream(stream):
                    tensors = _tensors.collate(
                        batch,
                        lists=self.dataset.lists,
                        pad_value=self.dataset.options.pad_value,
                        pad_to=self.dataset.pad_to,
                        move=move,
                    )
                    done = _new_event()
                    done.record(stream)
                queue.append(_InFlight(tensors, done, reader.state_dict(), keep))
                if len(queue) > self.depth:
                    yield self._hand_over(queue.popleft())
            while queue:
                yield self._hand_over(queue.popleft())
        finally:
            stream.synchronize()
            if registry is not None:
                self.stats.registered, self.stats.refused = registry.registered, registry.refused

    def close(self) -> None:
        """Unregister the mappings this prefetcher registered (after the copies in
        flight), and stop following the reader's mappings."""
        if self._registered is not None:
            self.dataset.shardcache_dataset().remove_mapping_listener(self._registered)
            self._registered.close()
            self._registered = None

    def __enter__(self) -> DevicePrefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _hand_over(self, flight: _InFlight) -> dict[str, torch.Tensor]:
        current = torch.cuda.current_stream(self.device)
        current.wait_event(flight.done)
        for tensor in flight.tensors.values():
            # Allocated on the copy stream, used on the training stream from now on.
            tensor.record_stream(current)
        self._state = flight.state
        self.stats.batches += 1
        return flight.tensors

    def _copy(
        self,
        array: pa.Array,
        dtype: torch.dtype,
        *,
        registry: _host_memory.Registry | None,
        keep: list[Any],
    ) -> torch.Tensor:
        raw = columns.as_bytes(array)
        size = len(raw)
        if not size:
            return torch.empty(0, dtype=dtype, device=self.device)
        host = torch.utils.dlpack.from_dlpack(raw)
        keep.append(raw)
        address = raw.buffers()[1].address
        if registry is not None and registry.covers(address, size):
            self.stats.direct_bytes += size
            moved = host.to(self.device, non_blocking=True)
        else:
            self.stats.staged_bytes += size
            try:
                staging = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            except RuntimeError:
                moved = host.to(self.device)
            else:
                staging.copy_(host)
                keep.append(staging)
                moved = staging.to(self.device, non_blocking=True)
        return moved.view(dtype)
