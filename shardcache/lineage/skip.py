"""`shardcache skip`: rewind a run to a checkpoint and skip the batches after it.

The PaLM recipe for a loss spike (restart from a checkpoint about 100 steps before
the spike, skip a few hundred batches) as one command: it writes a skip request next
to checkpoint STEP in the object store (every rank's, for a ranked job) and sets aside
the checkpoints published after STEP, so the next restore picks STEP. The sidecar's
checkpoint agent applies the request when it restores the step: the trainer's data
state already carries the skip, recorded in its state dict like
`Dataset.skip_batches`. Nothing here talks to the cluster; restart the job's pods.

A set-aside checkpoint keeps its files and its manifest, renamed to
`checkpoint.discarded.json`, so it is no longer a checkpoint (restore, retention and
the rewound run's upload of the same step ignore it) but is still there to look at.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import time
from typing import Any

import pyarrow.fs as pafs

from shardcache import errors, states
from shardcache.checkpoint import layout
from shardcache.lineage import failures, published


@dataclasses.dataclass(frozen=True)
class Planned:
    """What `request` does under one rank's prefix."""

    prefix: str
    rank: int | None
    request: layout.SkipRequest
    #: The recorded skip as the agent will apply it (before the epoch-end cut).
    skip: states.Skip
    discard: tuple[int, ...]


def plan(
    fs: pafs.FileSystem,
    prefix: str,
    *,
    step: int,
    batches: int,
    batch_size: int | None,
    keep_later: bool,
    reason: str = "",
    now: float | None = None,
) -> list[Planned]:
    """Check the request against every rank's published checkpoints; write nothing.

    InputError when a rank has no checkpoint `step`, its data state cannot take the
    skip (no data state, no batch size known), or (with `keep_later`) a later
    checkpoint would be restored instead.
    """
    request = layout.SkipRequest(
        step=step,
        batches=batches,
        batch_size=batch_size,
        requested_at=time.time() if now is None else now,
        reason=reason,
    )
    out: list[Planned] = []
    for rank, rank_prefix in published.ranks(fs, prefix).items():
        found = {m.step: m for m in published.checkpoint_manifests(fs, rank_prefix)}
        where = f"{rank_prefix} (rank {rank})" if rank is not None else rank_prefix
        if step not in found:
            raise errors.InputError(
                f"{where}: checkpoint step {step} is not published (published steps: "
                f"{sorted(found) or 'none'}); rewind to one of those"
            )
        data_state = found[step].data_state
        if data_state is None:
            raise errors.InputError(
                f"{where}: checkpoint step {step} has no data state to skip in: it was "
                "committed without data_state=dataset.state_dict()"
            )
        state = states.parse(data_state, where=f"{where} step {step} data_state")
        _, skip = states.skip_batches(state, batches, batch_size=batch_size, rank_samples=None)
        assert skip is not None
        later = tuple(s for s in sorted(found) if s > step)
        if later and keep_later:
            raise errors.InputError(
                f"{where}: checkpoints {list(later)} are newer than step {step}; the restore "
                f"would take one of those: pin spec.checkpoint.restore to {step} or leave out "
                "--keep-later"
            )
        out.append(Planned(rank_prefix, rank, request, skip, later))
    return out


def apply(fs: pafs.FileSystem, planned: list[Planned]) -> None:
    """Set the later checkpoints aside, then write the requests. A skip request that is
    there before the later checkpoints are gone would be applied to nobody's restore,
    so the order makes a failure halfway safe to retry. Each write is retried as the
    reads are (`published.RETRY`): all of them can be repeated."""

    def read(path: str) -> object | None:
        return published.retried(
            lambda: layout.read_json(fs, path), what=f"reading {published.display(fs, path)}"
        )

    def write(path: str, data: dict[str, Any]) -> None:
        published.retried(
            lambda: layout.write_json(fs, path, data),
            what=f"writing {published.display(fs, path)}",
        )

    def delete(path: str) -> None:
        # A retry after a delete that went through but whose answer was lost finds
        # nothing there: done.
        def attempt() -> None:
            with contextlib.suppress(FileNotFoundError):
                fs.delete_file(path)

        published.retried(attempt, what=f"deleting {published.display(fs, path)}")

    for p in planned:
        for later in p.discard:
            manifest = read(layout.manifest_path(p.prefix, later))
            if manifest is None:
                continue
            assert isinstance(manifest, dict)
            write(layout.discarded_path(p.prefix, later), manifest)
            delete(layout.manifest_path(p.prefix, later))
        if p.discard:
            pointer = {"version": layout.LAYOUT_VERSION, "step": p.request.step}
            name = read(layout.manifest_path(p.prefix, p.request.step))
            if isinstance(name, dict) and "name" in name:
                pointer["name"] = name["name"]
            write(layout.pointer_path(p.prefix), pointer)
        write(layout.skip_request_path(p.prefix, p.request.step), p.request.to_json())


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "skip",
        help="rewind to a checkpoint and skip the next batches when it is restored",
        description=(
            "Write a skip request next to checkpoint STEP (every rank's) and set aside the "
            "checkpoints published after it. The sidecar's checkpoint agent restores STEP "
            "at the next pod start with the data state skipping the next K batches, and "
            "the trainer resumes after them; the skip is recorded in the data state."
        ),
    )
    p.add_argument(
        "--checkpoint-uri",
        required=True,
        type=published.uri_argument,
        help="where the run publishes checkpoints (s3://bucket/run, file:///dir)",
    )
    p.add_argument("--step", type=int, required=True, help="the checkpoint to restart from")
    p.add_argument("--batches", type=int, required=True, help="batches to skip after it")
    p.add_argument(
        "--batch-size",
        type=int,
        help="samples per batch, for data states saved before they recorded it",
    )
    p.add_argument("--reason", default="", help="a note kept with the request")
    p.add_argument(
        "--keep-later",
        action="store_true",
        help="refuse instead of setting aside checkpoints newer than STEP",
    )
    p.add_argument("--dry-run", action="store_true", help="say what would be done; write nothing")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        if args.step < 0:
            raise errors.InputError(f"--step must be >= 0, got {args.step}")
        fs, prefix = published.open_uri(args.checkpoint_uri)
        planned = plan(
            fs,
            prefix,
            step=args.step,
            batches=args.batches,
            batch_size=args.batch_size,
            keep_later=args.keep_later,
            reason=args.reason,
        )
        if not args.dry_run:
            apply(fs, planned)
    except (errors.ShardcacheError, OSError) as exc:
        return failures.report("skip", exc)
    data = report(planned, dry_run=args.dry_run)
    print(json.dumps(data, indent=2) if args.json else text(data))
    return 0


def report(planned: list[Planned], *, dry_run: bool) -> dict[str, Any]:
    return {
        "dry_run": dry_run,
        "step": planned[0].request.step,
        "batches": planned[0].request.batches,
        "ranks": [
            {
                "rank": p.rank,
                "prefix": p.prefix,
                "skip": p.skip.to_json(),
                "set_aside": list(p.discard),
            }
            for p in planned
        ],
    }


def text(data: dict[str, Any]) -> str:
    verb = "would be" if data["dry_run"] else "will be"
    lines = [
        f"checkpoint {data['step']} {verb} restored skipping the next {data['batches']} "
        "batches; restart the job's pods to apply it"
    ]
    for r in data["ranks"]:
        who = f"rank {r['rank']}" if r["rank"] is not None else r["prefix"]
        s = r["skip"]
        aside = f"; set aside later checkpoints {r['set_aside']}" if r["set_aside"] else ""
        # The stop is start + batches x batch size: the epoch's length is the dataset's,
        # which this command does not read; the agent cuts the range at the epoch's end
        # when it restores the step (`states.clamp`).
        lines.append(
            f"  {who}: epoch {s['epoch']} positions [{s['start']}, {s['stop']}) skipped, "
            f"those before the epoch's end{aside}"
        )
    return "\n".join(lines)
