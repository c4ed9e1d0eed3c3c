"""Shard formats: read a source shard's metadata, and decode it for the memory tier.

Every source format decodes to the same form (see README.md beside this file): an
uncompressed Arrow IPC *file* holding exactly one record batch, so the trainer can
memory-map it and slice any run of rows without a copy.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Protocol

import pyarrow as pa
import pyarrow.ipc as ipc

from shardcache import errors
from shardcache.formats import arrow, budgets, jsonl, parquet, schemas, utf8

#: Version of the decoded form; part of every memory-tier key, so a change never
#: serves a file written by an older version. 2: every string column holds valid
#: UTF-8 (checked at decode, `utf8`); 1 did not check, so its files are never served.
DECODE_VERSION = 2


class _Format(Protocol):
    EXTENSIONS: tuple[str, ...]

    def inspect(self, source: pa.NativeFile) -> tuple[int, pa.Schema]: ...

    def read(self, source: pa.NativeFile) -> pa.Table: ...


FORMATS: dict[str, _Format] = {"parquet": parquet, "arrow": arrow, "jsonl": jsonl}


def get(name: str) -> _Format:
    try:
        return FORMATS[name]
    except KeyError:
        raise errors.InputError(
            f"unsupported format {name!r}: expected one of {', '.join(sorted(FORMATS))}"
        ) from None


def infer(paths: list[str]) -> str:
    """The one format all paths' extensions name; an error names the odd ones out."""
    by_ext = {ext: name for name, fmt in FORMATS.items() for ext in fmt.EXTENSIONS}
    found: dict[str, list[str]] = {}
    unknown: list[str] = []
    for path in paths:
        name = by_ext.get(PurePosixPath(path).suffix.lower())
        if name is None:
            unknown.append(path)
        else:
            found.setdefault(name, []).append(path)
    if unknown:
        raise errors.InputError(
            f"cannot infer the format of {unknown[:3]} from the extension: expected one of "
            f"{sorted(by_ext)}; pass format= explicitly"
        )
    if len(found) > 1:
        examples = {name: files[0] for name, files in found.items()}
        raise errors.InputError(
            f"shards of more than one format under one prefix: {examples}; expected a single format"
        )
    return next(iter(found))


def fingerprint(schema: pa.Schema) -> str:
    """Identity of a schema's fields and types (metadata such as pandas' is ignored)."""
    return hashlib.sha256(schema.remove_metadata().serialize().to_pybytes()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class Decoded:
    """A shard decoded in memory, ready to be written to the memory tier."""

    batch: pa.RecordBatch
    #: Exact size in bytes of the IPC file `write` produces.
    size: int
    write: Callable[[str], None]


_IPC_OPTIONS = ipc.IpcWriteOptions(compression=None)


def decoded_size(name: str, source: pa.NativeFile, *, limit: int) -> int | None:
    """Bytes the shard will take decoded, without decoding it (a number over `limit` as
    soon as it is known to exceed it), or None when the format cannot say (JSON Lines:
    `decode` checks its budget while it decodes, a piece at a time).

    Called before `decode` so a small file that decodes to gigabytes (a decompression
    bomb, a dictionary expanding a million-fold) is refused without being decoded
    (issue 13, row 4; docs/security.md).
    """
    if name == "arrow":
        return arrow.decoded_size(source)
    if name == "parquet":
        return parquet.decoded_size(source, limit=limit)
    return None


def decode(
    name: str,
    source: pa.NativeFile,
    *,
    budget: budgets.Budget = budgets.UNBOUNDED,
    promoted: pa.Schema | None = None,
) -> Decoded:
    """Decode a whole shard into one uncompressed record batch and size its IPC file.

    `budget` bounds a decode whose size `decoded_size` could not tell in advance (JSON
    Lines), while it decodes: `budgets.OverBudget` stops it. Other formats are sized
    before they are decoded. Columns of type null named in `promoted` (the manifest's
    schema unification, `schemas.unify`) become all-null columns of the promoted type.
    A string that is not UTF-8 is an `errors.InputError` (`utf8`).
    """
    if name == "jsonl":
        table = jsonl.read(source, budget=budget)  # its text is checked as it is read
    else:
        table = get(name).read(source)
        utf8.check_table(table)
    table = schemas.promote(table, promoted)
    batch = _one_batch(table)

    def write(path: str) -> None:
        with ipc.new_file(path, batch.schema, options=_IPC_OPTIONS) as writer:
            writer.write_batch(batch)

    sink = pa.MockOutputStream()
    with ipc.new_file(sink, batch.schema, options=_IPC_OPTIONS) as writer:
        writer.write_batch(batch)
    return Decoded(batch=batch, size=sink.size(), write=write)


def _one_batch(table: pa.Table) -> pa.RecordBatch:
    table = table.combine_chunks()
    batches = table.to_batches()
    if not batches:
        return pa.RecordBatch.from_pylist([], schema=table.schema)
    if len(batches) == 1:
        return batches[0]
    return pa.concat_batches(batches)
