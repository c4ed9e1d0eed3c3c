"""`Inspector`: the samples of a (rank, step, epoch), read from the cache, with provenance.

Rows come from a `ShardRows` source: shards through a `ShardProvider` (the embedded
cache, or the sidecar over its control socket), memory-mapped, never copied whole.
Every query is validated first, so a bad rank, step or column is an InputError that
says what was expected, and nothing is read.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import mmap
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

import pyarrow as pa
import pyarrow.ipc as ipc

from shardcache import datasets, errors, manifests, plans, provider
from shardcache.inspect import locate, predicate, render, stats
from shardcache.node import mapping


class ShardRows(Protocol):
    @property
    def manifest(self) -> manifests.Manifest: ...

    def read(self, shard: int) -> pa.RecordBatch:
        """Every row and column of manifest shard `shard`."""
        ...

    def close(self) -> None: ...


class ProviderRows:
    """Shards through a ShardProvider; keeps the last few memory-mapped."""

    def __init__(self, shards: provider.ShardProvider, *, owns: bool, keep: int = 8) -> None:
        self._provider = shards
        self._owns = owns
        self._keep = keep
        self._lock = threading.Lock()
        self._reader: str | None = None
        self._mapped: collections.OrderedDict[int, pa.RecordBatch] = collections.OrderedDict()

    @property
    def manifest(self) -> manifests.Manifest:
        return self._provider.manifest

    def read(self, shard: int) -> pa.RecordBatch:
        if not 0 <= shard < len(self.manifest.shards):
            raise errors.InputError(
                f"shard {shard} is out of range: the manifest has {len(self.manifest.shards)} shards"
            )
        with self._lock:
            cached = self._mapped.get(shard)
            if cached is not None:
                self._mapped.move_to_end(shard)
                return cached
            # The inspector reads at random and must not steer the prefetcher: its reader
            # sits at the end of its epoch, where nothing is upcoming to read ahead.
            end = self.manifest.total_rows
            if self._reader is None:
                self._reader = self._provider.open_reader(plans.PlanParams(), position=end)
            reader = self._reader
        lease = self._provider.acquire(reader, shard, epoch=0, position=end)
        try:
            # The mapping outlives the lease (see provider.ShardLease.release).
            batch = map_lazily(lease.path)
        finally:
            lease.release()
        with self._lock:
            self._mapped[shard] = batch
            while len(self._mapped) > self._keep:
                self._mapped.popitem(last=False)
        return batch

    def close(self) -> None:
        with self._lock:
            reader, self._reader = self._reader, None
            self._mapped.clear()
        if reader is not None:
            self._provider.close_reader(reader)
        if self._owns:
            self._provider.close()


def map_lazily(path: Path) -> pa.RecordBatch:
    """A decoded shard, memory-mapped with its pages read as they are touched.

    `datasets.read_shard` fills the whole mapping up front, right for a trainer that
    reads every row; the inspector reads a few rows and the first bytes of long cells,
    so that would cost a whole shard's pages (from disk, in the embedded cache) for a
    step of a few samples."""
    try:
        # Random reads: no readahead around each touched page (a step of 256 long
        # documents would otherwise read a few hundred KiB around each one). The mapping
        # keeps no descriptor (`mapping`).
        with open(path, "rb") as f:
            mapped = mapping.map_file(f.fileno(), getattr(mmap, "MADV_RANDOM", None))
        reader = ipc.open_file(mapped)
        if reader.num_record_batches == 1:
            return reader.get_batch(0)
    except (pa.ArrowException, OSError, ValueError):
        pass
    # Not the decoded form, or unreadable: the dataset's reader says why, or copes.
    return datasets.read_shard(path)


@dataclasses.dataclass(frozen=True)
class StepView:
    query: locate.Query
    #: Steps of the rank in the epoch, and its samples.
    steps: int
    rank_samples: int
    provenance: list[locate.Provenance]
    #: The selected columns of the step's samples, in batch order: zero-copy slices of
    #: the shards, one chunk per run of consecutive rows.
    table: pa.Table

    @functools.cached_property
    def batch(self) -> pa.RecordBatch:
        """The step as one record batch (a copy when it spans several slices)."""
        pieces = self.table.to_batches()
        if len(pieces) == 1:
            return pieces[0]
        if not pieces:
            return pa.RecordBatch.from_pylist([], schema=self.table.schema)
        return pa.concat_batches(pieces)


@dataclasses.dataclass(frozen=True)
class WhereResult:
    expression: str
    indices: list[int]
    sightings: list[locate.Sighting]
    #: True when more samples may match than are reported: past the limit, or rows
    #: left unscanned (`stopped`).
    truncated: bool
    #: Rows scanned, of the dataset's `rows`.
    scanned: int = 0
    rows: int = 0
    #: Why the scan stopped early: "limit" (enough matches), "budget" (the row budget
    #: of a served inspector), or None (every row was scanned).
    stopped: str | None = None


@dataclasses.dataclass(frozen=True)
class Scan:
    """The samples an expression matches, in manifest order, and how far it looked."""

    indices: list[int]
    scanned: int
    rows: int
    stopped: str | None

    @property
    def truncated(self) -> bool:
        return self.stopped is not None


def public_uri(uri: str) -> str:
    """The URI without user info or query string: credentials never leave."""
    parts = urlsplit(uri)
    if not parts.scheme:
        return uri
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


class Inspector:
    def __init__(self, rows: ShardRows) -> None:
        self.rows = rows
        self._schema: pa.Schema | None = None

    @property
    def manifest(self) -> manifests.Manifest:
        return self.rows.manifest

    @property
    def schema(self) -> pa.Schema:
        if self._schema is None:
            self._schema = self.rows.read(0).schema
        return self._schema

    def columns(self, wanted: Sequence[str] | None) -> list[str]:
        names = list(self.schema.names)
        if not wanted:
            return names
        missing = [c for c in wanted if c not in names]
        if missing:
            raise errors.InputError(f"unknown column(s) {missing}: the dataset has {names}")
        # A column named twice is shown once (Arrow's select refuses duplicates).
        return list(dict.fromkeys(wanted))

    def steps(self, query: locate.Query) -> int:
        return locate.step_count(self.manifest.shard_rows, query)

    def check_run(self, query: locate.Query, run: locate.States) -> None:
        """Refuse states saved under another dataset or plan than `query`'s: their
        positions would pick the wrong rows."""
        for rank, state in sorted(run.items()):
            differ = locate.state_mismatches(self.manifest.digest, query, state)
            if differ:
                raise errors.StateMismatchError(
                    f"the data state of rank {rank} is of another dataset or plan "
                    f"({'; '.join(differ)})"
                )

    def step(
        self,
        query: locate.Query,
        columns: Sequence[str] | None = None,
        *,
        run: locate.States | None = None,
    ) -> StepView:
        """The samples of a step along the rank's stream as the run's data states
        (`run`, by rank) recorded it: its segments after an elastic resume, its skips
        passed over as the dataset does, so step N is the N-th batch it was handed."""
        run = run or {}
        self.check_run(query, run)
        names = self.columns(columns)
        m = self.manifest
        prov = locate.step_rows(m.shard_rows, m.digest, query, run)
        pieces: list[pa.RecordBatch] = []
        i = 0
        while i < len(prov):
            # Consecutive rows of one shard are one zero-copy slice.
            j = i + 1
            while (
                j < len(prov)
                and prov[j].shard == prov[i].shard
                and prov[j].row == prov[j - 1].row + 1
            ):
                j += 1
            pieces.append(self.rows.read(prov[i].shard).select(names).slice(prov[i].row, j - i))
            i = j
        # A table of the slices, not one concatenated batch: a copy of a step of long
        # documents would cost the documents' size.
        return StepView(
            query=query,
            steps=locate.step_count(m.shard_rows, query, run),
            rank_samples=locate.rank_samples(m.shard_rows, query, run),
            provenance=prov,
            table=pa.Table.from_batches(pieces),
        )

    def where(
        self,
        expression: str,
        query: locate.Query,
        *,
        epochs: int = 1,
        limit: int = 100,
        run: locate.States | None = None,
        max_rows: int | None = None,
    ) -> WhereResult:
        """Samples matching `expression`, and at which (epoch, rank, step) each is seen in
        `epochs` epochs from `query.epoch` at `query`'s world size and batch size; with
        the run's data states (`run`, by rank), along the streams they recorded, and a
        sample its rank skipped is marked so.

        `max_rows` bounds the rows scanned (a served inspector's cost per request); past
        it the result is truncated and says so (`stopped` "budget", `scanned` rows)."""
        if epochs < 1:
            raise errors.InputError(f"epochs must be >= 1, got {epochs}")
        run = run or {}
        self.check_run(query, run)
        scan = self.scan(expression, limit=limit, max_rows=max_rows)
        indices = scan.indices
        m = self.manifest
        found: list[locate.Sighting] = []
        for epoch in range(query.epoch, query.epoch + epochs):
            found += locate.sightings(
                m.shard_rows, m.digest, query.replace(epoch=epoch), indices, run
            )
        found.sort(key=lambda s: (s.index, s.epoch))
        return WhereResult(
            expression, indices, found, scan.truncated, scan.scanned, scan.rows, scan.stopped
        )

    def matching(
        self, expression: str, *, limit: int = 100, max_rows: int | None = None
    ) -> tuple[list[int], bool]:
        """Dataset-wide indices of the first `limit` samples matching `expression`, in
        manifest order (scanning at most `max_rows` rows), and whether more may match."""
        scan = self.scan(expression, limit=limit, max_rows=max_rows)
        return scan.indices, scan.truncated

    def scan(self, expression: str, *, limit: int = 100, max_rows: int | None = None) -> Scan:
        """The first `limit` samples matching `expression` in manifest order, scanning
        at most `max_rows` rows (a shard larger than what is left is scanned in part)."""
        if limit < 1:
            # 0 would report "none match, more not shown"; a negative one, no limit.
            raise errors.InputError(f"limit must be >= 1, got {limit}")
        pred = predicate.parse(expression)
        predicate.check(pred, self.schema)
        m = self.manifest
        offsets = plans.shard_offsets(m.shard_rows)
        total = m.total_rows
        indices: list[int] = []
        scanned = 0
        for shard in range(len(m.shards)):
            rows = m.shard_rows[shard]
            if rows == 0:
                continue
            if max_rows is not None and scanned >= max_rows:
                return Scan(indices, scanned, total, "budget")
            take = rows if max_rows is None else min(rows, max_rows - scanned)
            batch = self.rows.read(shard).select(pred.columns).slice(0, take)
            for row in predicate.matching_rows(pred, batch):
                if len(indices) == limit:
                    return Scan(indices, scanned + row, total, "limit")
                indices.append(offsets[shard] + row)
            scanned += take
            if take < rows:
                return Scan(indices, scanned, total, "budget")
        return Scan(indices, scanned, total, None)

    def cell(self, shard: int, row: int, column: str) -> Any:
        return self.scalar(shard, row, column).as_py()

    def scalar(self, shard: int, row: int, column: str) -> pa.Scalar:
        """One cell as an Arrow scalar, in place: its size can be checked before it is
        copied (`as_buffer`, `as_py`)."""
        self.columns([column])
        batch = self.rows.read(shard)
        if not 0 <= row < batch.num_rows:
            raise errors.InputError(
                f"row {row} is out of range: shard {shard} has {batch.num_rows} rows"
            )
        return batch.column(column)[row]

    def stats(self, *, max_rows: int = 100_000, max_bytes: int | None = None) -> dict[str, Any]:
        """Column statistics over the first `max_rows` rows in manifest order, and no
        further shard once those read hold `max_bytes` (decoded): a row bound alone
        read 100,000 rows whatever their width (gigabytes of images, each shard fetched
        into the cache for a page of lengths). The first shard is always read."""
        batches: list[pa.RecordBatch] = []
        seen = held = 0
        for shard in range(len(self.manifest.shards)):
            if seen >= max_rows or (max_bytes is not None and batches and held >= max_bytes):
                break
            batch = self.rows.read(shard)
            batch = batch.slice(0, max_rows - seen)
            batches.append(batch)
            seen += batch.num_rows
            held += batch.nbytes
        table = pa.Table.from_batches(batches, schema=self.schema)
        result = stats.column_stats(table)
        result["dataset_rows"] = self.manifest.total_rows
        return result

    def close(self) -> None:
        self.rows.close()


# --- output forms ---------------------------------------------------------------


def dataset_json(manifest: manifests.Manifest) -> dict[str, Any]:
    return {
        "root": public_uri(manifest.root),
        "format": manifest.format,
        "digest": manifest.digest,
        "shards": len(manifest.shards),
        "rows": manifest.total_rows,
    }


def step_json(
    view: StepView,
    manifest: manifests.Manifest,
    *,
    options: render.RenderOptions = render.FULL,
    decode: render.Decode | None = None,
    decode_columns: Sequence[str] = (),
) -> dict[str, Any]:
    """The machine-readable form of a step: what `--json` prints and the web API serves.

    Columns render through Arrow (`render.render_column`): only what is shown becomes
    Python."""
    columns = view.table.schema.names
    types = [view.table.schema.field(c).type for c in columns]
    rendered = []
    for c in columns:
        dec = decode if (not decode_columns or c in decode_columns) else None
        try:
            rendered.append(render.render_column(view.table.column(c), options=options, decode=dec))
        except errors.InputError as exc:
            raise errors.InputError(f"column {c!r}: {exc}") from exc
    samples = []
    for i, p in enumerate(view.provenance):
        cells = {c: col[i] for c, col in zip(columns, rendered, strict=True)}
        samples.append(
            {
                "provenance": {
                    "shard": manifest.shards[p.shard].path,
                    "shard_index": p.shard,
                    "row": p.row,
                    "index": p.index,
                    "position": p.position,
                },
                "values": cells,
            }
        )
    return {
        "dataset": dataset_json(manifest),
        "query": dataclasses.asdict(view.query),
        "steps": view.steps,
        "rank_samples": view.rank_samples,
        "columns": [{"name": c, "type": str(t)} for c, t in zip(columns, types, strict=True)],
        "samples": samples,
    }


def _mode(query: dict[str, Any]) -> str:
    if not query["shuffle"]:
        return "off"
    if query.get("granularity") == plans.SAMPLE:
        return f"sample (window {query['window']:,})"
    return "block"


#: `batch_size_from` of a step or lookup whose batch size nobody gave (the default).
BATCH_SIZE_ASSUMED = "assumed"


def assumed_batch_size_note(batch_size: int) -> str:
    """Says that a step's batch size was assumed, not the run's: step N is batch N of
    it, other samples at another size."""
    return (
        f"note: batch size {batch_size} is assumed (the default): give the run's with "
        "--batch-size, or its saved data state with --data-state (or its checkpoints "
        "with --checkpoint-uri); step N is batch N of that size"
    )


def step_text(data: dict[str, Any]) -> str:
    """The terminal form of `step_json`'s output; says so when its batch size was
    assumed (`data["batch_size_from"]`, set by the command)."""
    q = data["query"]
    d = data["dataset"]
    samples = data["samples"]
    first = samples[0]["provenance"]["position"] if samples else 0
    lines = [
        f"dataset {d['root']}  {d['digest'][:19]}…  {d['shards']} shards, {d['rows']:,} samples",
        f"epoch {q['epoch']} · rank {q['rank']}/{q['world_size']} · step {q['step']} of "
        f"{data['steps']} · batch size {q['batch_size']} · seed {q['seed']} · "
        f"shuffle {_mode(q)} · samples {first}-{first + len(samples) - 1} "
        f"of {data['rank_samples']:,} for this rank",
    ]
    if data.get("batch_size_from") == BATCH_SIZE_ASSUMED:
        lines.append(assumed_batch_size_note(q["batch_size"]))
    width = max([len(render.safe(c["name"])) for c in data["columns"]] + [5])
    indent = " " * (width + 6)
    for slot, sample in enumerate(samples):
        p = sample["provenance"]
        lines.append("")
        lines.append(f"[{slot}] index {p['index']} · shard {p['shard']} row {p['row']}")
        for name, cell in sample["values"].items():
            body = render.cell_text(cell, indent=indent)
            lines.append(f"    {render.safe(name).ljust(width)}  {body[0]}")
            lines.extend(body[1:])
    # Names, paths and values come from the data: nothing in them may steer the terminal.
    return "\n".join(render.safe(line) for line in lines)


def where_json(result: WhereResult) -> dict[str, Any]:
    return {
        "expression": result.expression,
        "matches": len(result.indices),
        "truncated": result.truncated,
        "stopped": result.stopped,
        "scanned_rows": result.scanned,
        "dataset_rows": result.rows,
        "sightings": [dataclasses.asdict(s) for s in result.sightings],
    }


def scan_note(data: dict[str, Any]) -> str:
    """What a lookup that stopped early leaves unsaid, in words ("" when it did not)."""
    if data.get("stopped") == "budget":
        return (
            f"searched the first {data['scanned_rows']:,} of {data['dataset_rows']:,} rows "
            "(the lookup's budget): later rows were not searched"
        )
    if data.get("stopped") == "limit" or data["truncated"]:
        return "more not shown"
    return ""


def where_text(data: dict[str, Any], query: locate.Query) -> str:
    note = scan_note(data)
    head = (
        f"{data['matches']} sample(s) match {data['expression']!r}"
        + (f" ({note})" if note else "")
        + f"; world size {query.world_size}, batch size {query.batch_size}, seed {query.seed}"
    )
    lines = [head]
    if data.get("batch_size_from") == BATCH_SIZE_ASSUMED:
        lines.append(assumed_batch_size_note(query.batch_size))
    for s in data["sightings"]:
        if s.get("before_resize"):
            lines.append(
                f"  index {s['index']}: epoch {s['epoch']}: consumed before the elastic resume, "
                "by a rank of the earlier world size (shardcache lineage says which)"
            )
            continue
        if s.get("skipped"):
            lines.append(
                f"  index {s['index']}: epoch {s['epoch']} rank {s['rank']}: skipped, never read"
            )
            continue
        lines.append(
            f"  index {s['index']}: epoch {s['epoch']} rank {s['rank']} step {s['step']} "
            f"(row {s['slot']} of the batch)"
        )
    return "\n".join(render.safe(line) for line in lines)


def open_uri(
    uri: str | None,
    *,
    mount: str | None = None,
    cache_dir: str | None = None,
) -> Inspector:
    """An inspector over `uri` through the embedded cache under `cache_dir`, or, with no
    URI, over the sidecar's mount `mount` (in a pod)."""
    import shardcache

    if uri is None and mount is None:
        raise errors.InputError("expected a dataset URI or --mount NAME, found neither")
    if uri is not None and mount is not None:
        raise errors.InputError(
            f"expected a dataset URI or --mount NAME, found both ({uri!r}, {mount!r})"
        )
    # The inspector reads shards at random, not along one rank's stream: it takes the
    # dataset's shard provider and leaves its iterator alone. Rank 0 of 1 is said
    # outright, so a launcher's $RANK/$WORLD_SIZE (open()'s defaults) play no part.
    ds = shardcache.open(uri, cache_dir=cache_dir, mount=mount, rank=0, world_size=1)
    return Inspector(ProviderRows(ds.provider, owns=True))
