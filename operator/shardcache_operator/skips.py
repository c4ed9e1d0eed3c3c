"""Skips the sidecars applied at restore (`shardcache skip`), reported in the status.

When a sidecar's checkpoint agent restores a step with a skip request, it writes
`step-…/skip-applied.json` next to it in the store (shardcache.checkpoint.layout). A
timer reads those records under `spec.checkpoint.uri` (every rank's prefix) and puts
the newest request in `status.lastSkip`, with an Event `SkipApplied` the first time
each request is seen applied. Reading is blocking I/O; `report` is pure.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow.fs as pafs

from shardcache import source
from shardcache.checkpoint import layout
from shardcache.lineage import published
from shardcache_operator import rfc3339

EVENT_REASON = "SkipApplied"


def read_applied(uri: str, storage_options: Mapping[str, str] | None) -> list[dict[str, Any]]:
    """Every applied-skip record under the checkpoint URI, with the rank prefix's rank
    (None for an unranked prefix) added when the record has none."""
    fs, prefix = source.filesystem(uri, storage_options=storage_options)
    records: list[dict[str, Any]] = []
    for rank, rank_prefix in published.rank_prefixes(fs, prefix.rstrip("/")).items():
        complete, _ = layout.list_steps(fs, rank_prefix)
        paths = [layout.skip_applied_path(rank_prefix, s) for s in complete]
        for info in fs.get_file_info(paths) if paths else []:
            if info.type != pafs.FileType.File:
                continue
            data = layout.read_json(fs, info.path)
            if isinstance(data, dict) and isinstance(data.get("step"), int):
                records.append({"rank": rank, **data})
    return records


def _time(seconds: object) -> str | None:
    if not isinstance(seconds, int | float) or seconds <= 0:
        return None
    return rfc3339.format(datetime.datetime.fromtimestamp(float(seconds), datetime.UTC))


def last_skip(records: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The newest request (by request time, then step) and where it was applied."""
    if not records:
        return None
    newest = max(records, key=lambda r: (r.get("requested_at") or 0, r["step"]))
    key = (newest["step"], newest.get("requested_at"))
    same = sorted(
        (r for r in records if (r["step"], r.get("requested_at")) == key),
        key=lambda r: (r.get("rank") is None, r.get("rank") or 0),
    )
    out: dict[str, Any] = {
        "step": newest["step"],
        "batches": int(newest.get("batches") or 0),
        "requestedAt": _time(newest.get("requested_at")),
        "appliedAt": _time(max(float(r.get("applied_at") or 0) for r in same)),
        "ranges": [
            {k: r[k] for k in ("rank", "epoch", "start", "stop") if r.get(k) is not None}
            for r in same
        ],
    }
    if newest.get("reason"):
        out["reason"] = str(newest["reason"])
    return {k: v for k, v in out.items() if v is not None}


def report(
    previous: Mapping[str, Any], records: Sequence[Mapping[str, Any]]
) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """(status patch, [(reason, message)] Events) for the records found now.

    An Event only when a request is first seen applied; later ranks or restarts applying
    the same request update the status quietly."""
    last = last_skip(records)
    before = previous.get("lastSkip")
    if last is None or last == before:
        return {}, []
    patch = {"lastSkip": last}
    if isinstance(before, Mapping) and (before.get("step"), before.get("requestedAt")) == (
        last["step"],
        last.get("requestedAt"),
    ):
        return patch, []
    ranges = "; ".join(
        (f"rank {r['rank']}: " if r.get("rank") is not None else "")
        + f"epoch {r['epoch']} positions [{r['start']}, {r['stop']})"
        for r in last["ranges"]
    )
    why = f" ({last['reason']})" if last.get("reason") else ""
    message = (
        f"checkpoint step {last['step']} was restored with a skip of {last['batches']} "
        f"batches{why}: {ranges}"
    )
    return patch, [(EVENT_REASON, message)]
