"""Carrying out a copy plan (`_copy_plans`): one slab per window of batches.

The slab is one uint8 tensor on the device; each run of the plan is one copy into it
(`copy_(non_blocking=True)` on the caller's stream), and every batch's columns are
views of it, reinterpreted to their dtype. The window's rebased offsets are written by
numpy into one pinned buffer and copied once. Runs inside a registered mapping are
copied by DMA straight from a tensor over the whole mapping (made once per mapping);
other runs are staged through a pinned buffer (one CPU copy), as in the per-batch path.

On the CPU (tests, and the bench's CPU-side probe) the same steps copy host to host, so
the plan's exactness is checked without a GPU; with `copy=False` the byte copies are
skipped and only the per-window and per-batch work remains, which is what the bench
times as the prefetcher's CPU cost.

A handed-over batch is a view of its window's slab: the slab's memory is reused once
every batch of the window has been dropped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import torch
import torch.utils.dlpack

from shardcache.torch import _copy_plans, _tensors

#: The mapping that starts at an address, as registered (`_host_memory.Registry.root`).
Root = Callable[[int], pa.Buffer]
#: (device address, host address, bytes, stream handle): `CudaRegistrar.copy_async`.
CopyAsync = Callable[[int, int, int, int], None]


@dataclasses.dataclass
class Launched:
    """A window's batches (tensors on the device, their copies queued)."""

    batches: list[dict[str, torch.Tensor]]
    #: Host memory the queued copies read, alive until they finish.
    keep: list[Any]
    direct_bytes: int = 0
    staged_bytes: int = 0
    offsets_bytes: int = 0
    #: The window's rebased offsets as written on the host (`Plan.fill_offsets`).
    host_offsets: Any = None
    #: The window's own allocations (the slab, the offsets on the device): a batch that
    #: is views of them only needs them `record_stream`ed once per window.
    owners: list[torch.Tensor] = dataclasses.field(default_factory=list)
    #: Per batch, its tensors that are allocations of their own (padded lists).
    fresh: list[list[torch.Tensor]] = dataclasses.field(default_factory=list)


def _host_bytes(buffer: pa.Buffer) -> torch.Tensor:
    array = pa.Array.from_buffers(pa.uint8(), buffer.size, [None, buffer])
    return torch.utils.dlpack.from_dlpack(array)


class Mappings:
    """uint8 tensors over whole registered mappings, made once per mapping: slicing one
    is cheaper per run than wrapping each run's buffer."""

    def __init__(self, root: Root) -> None:
        self._root = root
        self._tensors: dict[int, tuple[pa.Buffer, torch.Tensor]] = {}

    def slice(self, start: int, address: int, size: int) -> torch.Tensor:
        root = self._root(start)
        known = self._tensors.get(start)
        # A mapping dropped and another made at the same address is a new root.
        if known is None or known[0] is not root:
            known = (root, _host_bytes(root))
            self._tensors[start] = known
        offset = address - start
        return known[1][offset : offset + size]

    def prune(self) -> None:
        """Let go of the tensors over mappings the registry no longer holds: each keeps
        its mapping (and the memory tier's pages) alive. The registry synchronised the
        copies from it before it unregistered the mapping."""
        for start, (root, _) in list(self._tensors.items()):
            try:
                live = self._root(start)
            except KeyError:
                live = None
            if live is not root:
                del self._tensors[start]

    def forget(self) -> None:
        self._tensors.clear()


def launch(
    plan: _copy_plans.Plan,
    *,
    device: torch.device,
    mappings: Mappings | None,
    lists: str,
    pad_value: int,
    pad_to: int | None,
    copy: bool = True,
    copy_async: CopyAsync | None = None,
    stream: int = 0,
) -> Launched:
    """Queue the plan's copies on the current stream and build its batches' tensors.

    With `copy_async` (CUDA only), runs inside a registered mapping are queued with one
    runtime call each on `stream` (the current stream's handle), not torch's `copy_`."""
    cuda = device.type == "cuda"
    keep: list[Any] = []
    done = Launched([], keep)
    if mappings is not None:
        mappings.prune()
    slab = torch.empty(plan.slab_bytes, dtype=torch.uint8, device=device)
    for run in plan.runs:
        target = slab[run.at : run.at + run.size]
        if run.mapping is not None and mappings is not None:
            done.direct_bytes += run.size
            if not copy:
                continue  # the probe of the CPU's share: no copy, and no source to slice
            if copy_async is not None and cuda:
                # The registry keeps the mapping until the copies from it are done.
                copy_async(slab.data_ptr() + run.at, run.address, run.size, stream)
                continue
            source = mappings.slice(run.mapping, run.address, run.size)
        else:
            buffer = run.buffer()
            keep.append(buffer)
            source = _host_bytes(buffer)
            done.staged_bytes += run.size
            if cuda and copy:
                try:
                    staging = torch.empty(run.size, dtype=torch.uint8, pin_memory=True)
                except RuntimeError:
                    target.copy_(source)  # pinning refused: a synchronous copy
                    continue
                staging.copy_(source)
                keep.append(staging)
                source = staging
        if copy:
            target.copy_(source, non_blocking=cuda)
    host_offsets = torch.empty(plan.offsets_count, dtype=torch.int64, pin_memory=cuda)
    offsets_array = host_offsets.numpy()
    plan.fill_offsets(offsets_array)
    done.host_offsets = offsets_array
    done.offsets_bytes = 8 * plan.offsets_count
    if cuda:
        keep.append(host_offsets)
        offsets = host_offsets.to(device, non_blocking=True)
    else:
        offsets = host_offsets
    done.owners = [slab, offsets] if plan.offsets_count else [slab]
    # One typed view of the slab per dtype, sliced per batch: a column's start is
    # aligned to its width (`_copy_plans`), so each batch's column costs one slice.
    typed: dict[str, torch.Tensor] = {}
    for columns in plan.batches:
        out: dict[str, torch.Tensor] = {}
        fresh: list[torch.Tensor] = []
        for column in columns:
            whole = typed.get(column.dtype)
            if whole is None:
                dtype = _tensors.DTYPES[column.dtype]
                usable = plan.slab_bytes - plan.slab_bytes % dtype.itemsize
                whole = typed[column.dtype] = slab[:usable].view(dtype)
            width = whole.element_size()
            values = whole[column.start // width : (column.start + column.size) // width]
            if column.shape is not None:
                out[column.name] = values.view(column.shape)
            elif column.offsets is not None:
                first, last = column.offsets
                batch_offsets = offsets[first:last]
                if lists == "padded":
                    longest = plan.longest(offsets_array, column)
                    out[column.name] = _tensors.padded(
                        values, batch_offsets, longest, pad_value=pad_value, pad_to=pad_to
                    )
                    fresh.append(out[column.name])
                else:
                    out[column.name] = values
                    out[f"{column.name}_offsets"] = batch_offsets
            else:
                out[column.name] = values
        done.batches.append(out)
        done.fresh.append(fresh)
    return done
