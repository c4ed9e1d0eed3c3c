"""`DevicePrefetcher`: batches copied to the GPU ahead of the training step, with no
copy of their values on the CPU.

Each batch's pieces are copied from the memory-tier mappings the reader holds, which
are registered with the CUDA driver (`_host_memory`), on a stream of its own, `depth`
batches ahead; concatenation, offsets and padding then run on the device, where memory
bandwidth is two orders above the host link. The training stream waits on each batch's
copy event before it is handed over, so the hand-over never blocks the host.

Batches are copied by *windows* of consecutive batches (about `window_bytes` of values,
`_copy_plans`): one device slab per window that every batch's columns are views of,
filled by a few large copies (a batch's pieces, and consecutive batches, that are
neighbours in a shard are merged into one copy), with the list offsets rebased on the
host in one numpy step per piece and copied once per window. Per batch, only the views,
the hand-over and the state remain in Python. A window the plan does not cover (bool or
null columns) goes through the per-batch path (`_copy`: a copy per piece, assembly on
the device); so does everything after a window fails on the device at run time
(`window_bytes=0` chooses it from the start).

In sample mode (`shuffle="sample"`) the reader does not gather the batches on the CPU
(`defer_gather`): each window's rows are copied to the device once, in a few long runs
of its shards, and every batch is gathered there (`_device_gather`; the device memory
it takes is a window or two of the asked columns). A window the plan does not cover,
`device_gather=False`, packed batches, and everything after a device gather fails at
run time take today's path: the batch gathered on the CPU, then copied as above.

Pieces outside a registered mapping (the driver refused the registration, or the
mapping was made before this prefetcher) are staged through pinned buffers: one CPU
copy, still asynchronous. Without CUDA (or with `device="cpu"`) the batches are the
plain path's tensors, unchanged.

The state (`state_dict()`) counts the batches handed over, not those in flight: a
resume reads again what was prefetched but never given to the training loop.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pyarrow as pa
import torch
import torch.utils.dlpack

from shardcache import batching, columns, errors, stalls
from shardcache.torch import (
    _copy_plans,
    _datasets,
    _device_gather,
    _host_memory,
    _slabs,
    _tensors,
)

log = logging.getLogger(__name__)

#: Values per window: large enough that per-copy and per-window costs vanish against
#: the copy (64 MiB is 1.2 ms at 54.8 GB/s), small enough that a window in flight and
#: one handed over stay a small share of a GPU's memory.
WINDOW_BYTES = 64 << 20
#: At most this many batches per window, whatever their size.
WINDOW_BATCHES = 16


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
    #: Windows copied through a plan, and the value copies (runs) they took, the device
    #: gather's window copies included (one offsets copy a window comes on top).
    windows: int = 0
    runs: int = 0
    #: List offsets rebased on the host (not token values) and copied from pinned memory.
    offsets_bytes: int = 0
    #: Batches that went through the per-batch path.
    per_batch: int = 0
    #: Sample mode: batches gathered on the device, the windows copied for them, and
    #: batches the device gather gave up, gathered on the CPU instead (today's path;
    #: with `device_gather=False` the reader gathers them and they are not counted).
    device_gathered: int = 0
    gather_windows: int = 0
    cpu_gathered: int = 0
    #: Why windows (or device gathers) were given up at run time (empty while they work).
    fallback: str = ""


@dataclasses.dataclass
class _InFlight:
    tensors: dict[str, torch.Tensor]
    done: Any
    state: dict[str, Any]
    #: Host memory the copies read from, alive until they finish.
    keep: list[Any]
    #: A window-path batch: its window's allocations (the tensors are views of them,
    #: recorded on the training stream once per window) and its own (padded lists).
    #: None: every tensor is an allocation of its own.
    owners: list[torch.Tensor] | None = None
    fresh: list[torch.Tensor] = dataclasses.field(default_factory=list)


#: What a device path raises at run time (torch, CUDA, an argument the runtime
#: refuses) that a slower path copes with: the prefetcher falls back rather than fail.
_RUN_TIME_ERRORS = (RuntimeError, TypeError, ValueError, AttributeError)


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
    mappings (everything is staged). `window_bytes`: values copied per window of
    batches (0: the per-batch path). `raw_copies`: on the window path, copy from the
    registered mappings with one CUDA runtime call per run (False: torch's `copy_`,
    tens of microseconds of CPU each). `device_gather`: in sample mode, gather each
    batch on the device from one copy of its window (False: on the CPU, then copy).
    Reads in this process (no DataLoader workers: there is no CPU work left to spread
    over them).
    """

    def __init__(
        self,
        dataset: _datasets.IterableDataset,
        *,
        device: torch.device | str | None = None,
        depth: int = 2,
        register: bool = True,
        window_bytes: int = WINDOW_BYTES,
        raw_copies: bool = True,
        device_gather: bool = True,
    ) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        if window_bytes < 0:
            raise ValueError(f"window_bytes must be >= 0, got {window_bytes}")
        self.window_bytes = window_bytes
        self.raw_copies = raw_copies
        self.device_gather = device_gather
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
        self._mappings: _slabs.Mappings | None = None
        self._stream: Any = None
        self._gathers: _device_gather.DeviceGather | None = None
        #: The window event the training stream last waited for, and that stream.
        self._waited: tuple[Any, int] | None = None

    # --- state --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where the batches handed over so far end."""
        return self._state if self._state is not None else self.dataset.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)
        self._state = None

    @property
    def epoch(self) -> int:
        """The epoch read next (`IterableDataset.epoch`): a resumed loop starts at it."""
        return self.dataset.epoch

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)
        self._state = None

    # --- iteration ----------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        if self.device.type != "cuda":
            batches = self._plain()
        elif self.window_bytes:
            batches = self._windowed()
        else:
            batches = self._cuda()
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
                self.dataset.add_mapping_listener(self._registered)
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
                if batch.leaves:
                    self._let_go(queue, stream)
                if len(queue) > self.depth:
                    yield self._hand_over(queue.popleft())
            while queue:
                yield self._hand_over(queue.popleft())
        finally:
            stream.synchronize()
            if registry is not None:
                self.stats.registered, self.stats.refused = registry.registered, registry.refused

    def _windowed(self, *, copy: bool = True) -> Iterator[dict[str, torch.Tensor]]:
        """Batches copied window by window (see the module docstring). On the CPU
        (tests, the bench's probe) the same plan is carried out host to host, or with
        `copy=False` without the byte copies: what is left is the CPU's share."""
        device = self.device
        cuda = device.type == "cuda"
        stream: Any = None
        registry: _host_memory.Registry | None = None
        if cuda:
            if self._stream is None:
                self._stream = _new_stream(device)
            stream = self._stream
            registry = self._registry(stream)
        else:
            # On the CPU only a registry given by a test: its runs take the DMA path's
            # steps (slices of a tensor over the whole mapping), host to host.
            registry = self._registered
        if registry is not None and self._mappings is None:
            self._mappings = _slabs.Mappings(registry.root)
        if self.device_gather and self._gathers is None:
            self._gathers = _device_gather.DeviceGather(
                device=device,
                lists=self.dataset.lists,
                pad_value=self.dataset.options.pad_value,
                pad_to=self.dataset.pad_to,
                # A reader keeps only the windows its latest batch read (one, or two
                # across a window's end); bound the whole at `depth` + 1 windows (64 MiB
                # of tokens each at 65,536 rows of 256), or two a source for a mixture,
                # whose readers would otherwise evict each other's windows.
                max_tables=max(2, self.depth + 1, 2 * self.dataset.source_count()),
            )
        reader = self.dataset.reader(defer_gather=self._gathers is not None)
        self._state = reader.state_dict()
        batches = iter(reader)
        queue: collections.deque[_InFlight] = collections.deque()
        #: Copy events of the windows launched, oldest first (CUDA only).
        launched: collections.deque[Any] = collections.deque()
        count = 1  # the first window is one batch: the first hand-over comes soon
        flight: _InFlight | None = None
        try:
            while True:
                while len(queue) <= self.depth:
                    # A loop that never waits on the device (a benchmark, a step with
                    # no sync) would otherwise run ahead of the copies without bound,
                    # each window a new slab: wait for the oldest copies once more than
                    # `depth` windows are queued on the device (the copy engine still
                    # has those to do meanwhile).
                    while len(launched) > self.depth:
                        launched.popleft().synchronize()
                    window: list[batching.HostBatch] = []
                    states: list[dict[str, Any]] = []
                    for batch in batches:
                        window.append(batch)
                        states.append(reader.state_dict())
                        # The reader acquires another shard at the next batch: the
                        # window ends with this one (a copy), see `_let_go`.
                        if len(window) == count or batch.leaves:
                            break
                    if not window:
                        break
                    count = self._launch(window, states, queue, registry, stream, copy=copy)
                    if cuda and queue and queue[-1].done is not None:
                        launched.append(queue[-1].done)
                    if window[-1].leaves:
                        self._let_go([*queue, *([flight] if flight else [])], stream)
                if not queue:
                    break
                flight = queue.popleft()
                yield self._hand_over(flight) if cuda else self._hand_over_host(flight)
        finally:
            if stream is not None:
                stream.synchronize()
            if self._gathers is not None:
                self._gathers.clear()  # the windows of this pass: not read again
            if registry is not None:
                self.stats.registered, self.stats.refused = registry.registered, registry.refused

    def _let_go(self, flights: Iterable[_InFlight], stream: Any) -> None:
        """Before the reader acquires another shard: wait for the queued copies and let
        go of the host memory they read (slices of the mapped shards) and of the
        tensors over whole mappings (`_slabs.Mappings`, made again on use).

        Why: what this holds of the shard the reader leaves keeps that shard's pages in
        the memory volume once the tier evicts it, and ranks on a volume sized from the
        tier waited for each other's room (explorer report D1; docs/reading-plan.md,
        "What it means for batches"). The reader hands the batch before that acquire as
        a copy (`HostBatch.leaves`), so after this nothing maps the shard. Costs one
        wait for the copy stream per shard read, while it has the window's copies to
        do (docs/benchmarks.md, "The batch before another shard, copied")."""
        if stream is not None:
            stream.synchronize()
        for flight in flights:
            flight.keep.clear()
        if self._mappings is not None:
            self._mappings.forget()

    def _launch(
        self,
        window: list[batching.HostBatch],
        states: list[dict[str, Any]],
        queue: collections.deque[_InFlight],
        registry: _host_memory.Registry | None,
        stream: Any,
        *,
        copy: bool,
    ) -> int:
        """Queue `window`'s copies and its batches; the next window's batch count.

        Sample-mode batches not gathered yet are gathered on the device one by one (a
        batch is one gather: nothing to merge across batches), so the next window is
        one batch; the batches between them go through the window path together."""
        if not any(batch.selections for batch in window):
            return self._launch_pieces(window, states, queue, registry, stream, copy=copy)
        group: list[batching.HostBatch] = []
        group_states: list[dict[str, Any]] = []
        for batch, state in zip(window, states, strict=True):
            if not batch.selections:
                group.append(batch)
                group_states.append(state)
                continue
            if group:
                self._launch_pieces(group, group_states, queue, registry, stream, copy=copy)
                group, group_states = [], []
            self._launch_gather(batch, state, queue, registry, stream, copy=copy)
        if group:
            self._launch_pieces(group, group_states, queue, registry, stream, copy=copy)
        return 1

    def _launch_gather(
        self,
        batch: batching.HostBatch,
        state: dict[str, Any],
        queue: collections.deque[_InFlight],
        registry: _host_memory.Registry | None,
        stream: Any,
        *,
        copy: bool,
    ) -> None:
        """Queue one sample-mode batch's gather on the device, or today's path: the
        batch gathered on the CPU, then copied as a one-batch window."""
        gathers = self._gathers
        if gathers is not None:
            cuda = stream is not None
            try:
                with self._on(stream):
                    done_batch = gathers.gather(
                        batch.selections,
                        _device_gather.Copying(
                            mappings=self._mappings,
                            locate=registry.locate if registry else None,
                            copy_async=registry.copy_async
                            if cuda and registry and self.raw_copies and copy
                            else None,
                            stream=stream.cuda_stream if cuda else 0,
                        ),
                    )
                    done = _new_event() if cuda else None
                    if done is not None:
                        done.record(stream)
            except errors.ShardcacheError:
                raise
            except (_device_gather.Unsupported, IndexError, *_RUN_TIME_ERRORS) as exc:
                # For this batch and every later one (a window that cannot be planned
                # will not be the last).
                self._fall_back(exc, stream, "gathering on the CPU")
                gathers.clear()
                self._gathers = None
                self.device_gather = False
            else:
                self.stats.device_gathered += 1
                self.stats.gather_windows += done_batch.windows
                self.stats.runs += done_batch.runs
                self.stats.direct_bytes += done_batch.direct_bytes
                self.stats.staged_bytes += done_batch.staged_bytes
                self.stats.offsets_bytes += done_batch.index_bytes
                queue.append(_InFlight(done_batch.tensors, done, state, done_batch.keep))
                return
        self.stats.cpu_gathered += 1
        self._launch_pieces([batch.gathered()], [state], queue, registry, stream, copy=copy)

    def _launch_pieces(
        self,
        window: list[batching.HostBatch],
        states: list[dict[str, Any]],
        queue: collections.deque[_InFlight],
        registry: _host_memory.Registry | None,
        stream: Any,
        *,
        copy: bool,
    ) -> int:
        """Queue the copies of `window` (batches of pieces) and its batches; the next
        window's batch count."""
        plan = None
        if self.window_bytes:
            plan = _copy_plans.plan(window, locate=registry.locate if registry else None)
        if plan is None:
            self._per_batch(window, states, queue, registry, stream)
            return max(1, min(len(window) * 2, WINDOW_BATCHES))
        cuda = stream is not None
        try:
            with self._on(stream):
                launched = _slabs.launch(
                    plan,
                    device=self.device,
                    mappings=self._mappings,
                    lists=self.dataset.lists,
                    pad_value=self.dataset.options.pad_value,
                    pad_to=self.dataset.pad_to,
                    copy=copy,
                    copy_async=registry.copy_async
                    if cuda and registry and self.raw_copies
                    else None,
                    stream=stream.cuda_stream if cuda else 0,
                )
                done = _new_event() if cuda else None
                if done is not None:
                    done.record(stream)
        except errors.ShardcacheError:
            raise
        except _RUN_TIME_ERRORS as exc:
            # The per-batch path copies the same bytes with nothing but torch's copies.
            self._fall_back(exc, stream, "windows failed, copying batch by batch")
            self.window_bytes = 0
            self._per_batch(window, states, queue, registry, stream)
            return 1
        self.stats.windows += 1
        self.stats.runs += len(plan.runs)
        self.stats.direct_bytes += launched.direct_bytes
        self.stats.staged_bytes += launched.staged_bytes
        self.stats.offsets_bytes += launched.offsets_bytes
        for tensors, state, fresh in zip(launched.batches, states, launched.fresh, strict=True):
            queue.append(_InFlight(tensors, done, state, launched.keep, launched.owners, fresh))
        per_batch = max(1, plan.slab_bytes // len(window))
        return max(1, min(WINDOW_BATCHES, math.ceil(self.window_bytes / per_batch)))

    def _fall_back(self, exc: Exception, stream: Any, instead: str) -> None:
        """Keep a slower path rather than fail the job: let the work queued so far
        finish, and say why in `stats.fallback` and the log. (Errors the plain path
        raises, `errors.ShardcacheError`, are the caller's and never reach here.)"""
        if stream is not None:
            stream.synchronize()
        self.stats.fallback = f"{type(exc).__name__}: {exc}"
        log.warning("device prefetcher: %s: %s", instead, exc)

    def _on(self, stream: Any) -> Any:
        if stream is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(self.device))
        stack.enter_context(torch.cuda.stream(stream))
        return stack

    def _per_batch(
        self,
        window: list[batching.HostBatch],
        states: list[dict[str, Any]],
        queue: collections.deque[_InFlight],
        registry: _host_memory.Registry | None,
        stream: Any,
    ) -> None:
        for batch, state in zip(window, states, strict=True):
            keep: list[Any] = []
            move = functools.partial(self._copy, registry=registry, keep=keep)
            with self._on(stream):
                tensors = _tensors.collate(
                    batch,
                    lists=self.dataset.lists,
                    pad_value=self.dataset.options.pad_value,
                    pad_to=self.dataset.pad_to,
                    move=move,
                )
                done = _new_event() if stream is not None else None
                if done is not None:
                    done.record(stream)
            self.stats.per_batch += 1
            queue.append(_InFlight(tensors, done, state, keep))

    def _hand_over_host(self, flight: _InFlight) -> dict[str, torch.Tensor]:
        self._state = flight.state
        self.stats.batches += 1
        return flight.tensors

    def close(self) -> None:
        """Unregister the mappings this prefetcher registered (after the copies in
        flight), and stop following the reader's mappings."""
        if self._registered is not None:
            self.dataset.remove_mapping_listener(self._registered)
            self._registered.close()
            self._registered = None
        if self._mappings is not None:
            self._mappings.forget()
            self._mappings = None
        if self._gathers is not None:
            self._gathers.clear()

    def __enter__(self) -> DevicePrefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _hand_over(self, flight: _InFlight) -> dict[str, torch.Tensor]:
        current = torch.cuda.current_stream(self.device)
        # Allocated on the copy stream, used on the training stream from now on. The
        # batches of one window share its event and its allocations: the training
        # stream waits, and the window's memory is recorded, once per window (per
        # training stream), which takes three runtime calls off each later batch.
        if flight.owners is None:
            current.wait_event(flight.done)
            for tensor in flight.tensors.values():
                tensor.record_stream(current)
        else:
            waited = (flight.done, current.cuda_stream)
            if self._waited != waited:
                current.wait_event(flight.done)
                for tensor in flight.owners:
                    tensor.record_stream(current)
                self._waited = waited
            for tensor in flight.fresh:
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
