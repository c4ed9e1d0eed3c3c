"""Batches of Arrow pieces as dicts of tensors.

On the host, a fixed-width column is a tensor over the Arrow buffer itself (DLPack: no
copy) when the batch is one piece, and one concatenation when it spans several. The
memory-tier mappings are read-only: writing into such a tensor faults, so clone it
first if it must change. A list column becomes its flat values plus `<name>_offsets`
(int64, from 0), or with `lists="padded"` one [rows, length] tensor padded with
`pad_value` (length: `pad_to`, or the batch's longest list). A packed batch is one
[sequences, pack] tensor under the packed column's name.

`move` puts each piece somewhere before it is assembled (the device prefetcher copies
it to the GPU); the assembly (concatenation, offsets, padding) then runs there too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pyarrow as pa
import pyarrow.compute as pc
import torch
import torch.utils.dlpack

from shardcache import batching, columns, errors

DTYPES: dict[str, torch.dtype] = {
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "uint16": torch.uint16,
    "uint32": torch.uint32,
    "uint64": torch.uint64,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "bool": torch.bool,
}

#: Puts a fixed-width Arrow array (no nulls) somewhere as a tensor of `dtype`.
Move = Callable[[pa.Array, torch.dtype], torch.Tensor]

LISTS = ("offsets", "padded")


def host_tensor(array: pa.Array, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over the array's own buffer: no copy."""
    if not len(array):
        return torch.empty(0, dtype=dtype)
    tensor = torch.utils.dlpack.from_dlpack(array)
    return tensor.view(torch.bool) if dtype is torch.bool else tensor


def _cat(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(list(parts))


def _values(pieces: Sequence[pa.Array], name: str, move: Move) -> torch.Tensor:
    parts = []
    for piece in pieces:
        array, dtype = columns.fixed(piece, name=name)
        parts.append(move(array, DTYPES[dtype]))
    return _cat(parts)


def _offsets(pieces: Sequence[pa.Array], move: Move) -> torch.Tensor:
    """The pieces' offsets rebased into one int64 tensor from 0, built where `move`
    puts them: no Python loop over rows (a batch has tens of thousands)."""
    parts: list[torch.Tensor] = []
    base = 0
    for piece in pieces:
        raw = piece.offsets  # n + 1 offsets, a zero-copy slice of the offsets buffer
        first, last = raw[0].as_py(), raw[len(raw) - 1].as_py()
        offsets = move(raw.slice(1), DTYPES[columns.DTYPES[raw.type]])
        if not parts:
            parts.append(torch.zeros(1, dtype=torch.int64, device=offsets.device))
        parts.append(offsets.to(torch.int64).sub_(first - base))
        base += last - first
    return _cat(parts)


def _longest(pieces: Sequence[pa.Array]) -> int:
    lengths = [pc.max(pc.list_value_length(piece)).as_py() for piece in pieces if len(piece)]
    return max((n for n in lengths if n is not None), default=0)


def padded(
    values: torch.Tensor,
    offsets: torch.Tensor,
    longest: int,
    *,
    pad_value: int,
    pad_to: int | None,
) -> torch.Tensor:
    width = longest if pad_to is None else pad_to
    if longest > width:
        raise errors.InputError(
            f"pad_to={pad_to}: a list in this batch has {longest} values; raise pad_to, "
            "or pack the lists with pack="
        )
    rows = len(offsets) - 1
    out = torch.full((rows, width), pad_value, dtype=values.dtype, device=values.device)
    # Scatter by (row, column) indices whose count is known on the host: no device
    # synchronisation (a boolean mask would wait for the device to count it).
    lengths = offsets[1:] - offsets[:-1]
    row = torch.repeat_interleave(
        torch.arange(rows, device=values.device), lengths, output_size=len(values)
    )
    column = torch.arange(len(values), device=values.device) - offsets[:-1][row]
    out[row, column] = values
    return out


def collate(
    batch: batching.HostBatch,
    *,
    lists: str = "offsets",
    pad_value: int = 0,
    pad_to: int | None = None,
    move: Move = host_tensor,
) -> dict[str, torch.Tensor]:
    """The batch as tensors, by column name (see the module docstring)."""
    if lists not in LISTS:
        raise errors.InputError(f"lists: expected one of {LISTS}, found {lists!r}")
    batch = batch.gathered()  # a sample-mode batch not gathered yet: on the CPU here
    if batch.shape is not None:
        assert batch.column is not None
        flat = _values(batch.tokens, batch.column, move)
        return {batch.column: flat.view(batch.shape)}
    out: dict[str, torch.Tensor] = {}
    schema = batch.pieces[0].schema
    for index, field in enumerate(schema):
        pieces = [piece.column(index) for piece in batch.pieces]
        if not columns.is_list(field.type):
            out[field.name] = _values(pieces, field.name, move)
            continue
        nulls = sum(p.null_count for p in pieces)
        if nulls:
            raise errors.InputError(f"{field.name}: expected no null lists, found {nulls}")
        values = _values([p.flatten() for p in pieces], field.name, move)
        offsets = _offsets(pieces, move)
        if lists == "padded":
            longest = _longest(pieces)
            out[field.name] = padded(values, offsets, longest, pad_value=pad_value, pad_to=pad_to)
        else:
            out[field.name] = values
            out[f"{field.name}_offsets"] = offsets
    return out
