"""`shardcache lineage`: which (epoch, step, rank) read the samples matching an
expression and which checkpoints include them, or what a checkpoint consumed."""

from __future__ import annotations

import argparse
import json
from typing import Any

from shardcache import errors
from shardcache.inspect import session
from shardcache.lineage import failures, published, queries


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "lineage",
        help="which steps, ranks and checkpoints saw samples (from the checkpoints' data states)",
        description=(
            "Rebuild a run's reads from the data states its checkpoints carry (skips "
            "included) and answer: with --where, which (epoch, step, rank) read the "
            "matching samples and which checkpoints come after that read; with "
            "--consumed STEP, what each rank read since the previous checkpoint, as "
            "sample-index ranges. Steps count the batches a rank was handed in the epoch, "
            "from 0, as `shardcache inspect --step` does."
        ),
    )
    p.add_argument("uri", nargs="?", help="the dataset URI the run read (file://, s3://, ...)")
    p.add_argument("--mount", help="the sidecar's DatasetMount instead of a URI (in a pod)")
    p.add_argument("--cache-dir", help="embedded cache directory (default ~/.cache/shardcache)")
    p.add_argument(
        "--checkpoint-uri",
        required=True,
        type=published.uri_argument,
        help="where the run published its checkpoints (spec.checkpoint.uri; the URI above "
        "the rank-<r> prefixes of a ranked job)",
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--where", metavar="EXPR", help="samples to follow, e.g. 'uid == 123'")
    what.add_argument(
        "--consumed",
        metavar="STEP",
        type=int,
        help="what checkpoint STEP consumed since the previous checkpoint, per rank",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        help="samples per step for generations whose data states record none (a recorded one wins)",
    )
    p.add_argument("--limit", type=int, default=100, help="with --where: most samples followed")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (errors.ShardcacheError, OSError) as exc:
        return failures.report("lineage", exc)


def _run(args: argparse.Namespace) -> int:
    if args.batch_size is not None and args.batch_size < 1:
        raise errors.InputError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.where is not None and args.limit < 1:
        raise errors.InputError(f"--limit must be >= 1, got {args.limit}")
    inspector = session.open_uri(args.uri, mount=args.mount, cache_dir=args.cache_dir)
    try:
        hist = published.history_of(inspector.manifest, args.checkpoint_uri)
        if args.consumed is not None:
            report = queries.consumed(hist, args.consumed)
            print(json.dumps(report, indent=2) if args.json else consumed_text(report))
            return 0
        indices, truncated = inspector.matching(args.where, limit=args.limit)
        found = queries.reads(hist, indices, batch_size=args.batch_size)
        data = queries.reads_json(hist, args.where, indices, truncated, found)
        print(json.dumps(data, indent=2) if args.json else reads_text(data))
        return 0 if indices else 1
    finally:
        inspector.close()


def _steps(steps: list[int]) -> str:
    if len(steps) > 6:
        return f"{', '.join(map(str, steps[:3]))}, … {steps[-1]} ({len(steps)} checkpoints)"
    return ", ".join(map(str, steps))


def _worlds(run: dict[str, Any]) -> str:
    gens = run["generations"]
    if len(gens) <= 1:
        return str(run["world_size"])
    return " -> ".join(
        f"{g['world_size']}" + (f" (from step {g['resumed_from']})" if g["resumed_from"] else "")
        for g in gens
    )


def _batch_sizes(run: dict[str, Any]) -> str:
    """Each generation's batch size in turn, as `_worlds` gives their world sizes: a
    resize may change it, and a read's step counts batches of its own generation's."""
    sizes = [g["batch_size"] for g in run["generations"]]
    if len(sizes) <= 1 or len(set(sizes)) == 1:
        sizes = [run["batch_size"]]
    # None: that generation's checkpoints record none (states saved outside batches(),
    # or ranks that disagreed at the resize).
    return " -> ".join("not recorded" if b is None else str(b) for b in sizes)


def reads_text(data: dict[str, Any]) -> str:
    run = data["run"]
    steps = [c["step"] for c in run["checkpoints"]]
    lines = [
        f"{data['matches']} sample(s) match {data['expression']!r}"
        + (" (more not shown)" if data["truncated"] else "")
        + f"; run: world size {_worlds(run)}, batch size {_batch_sizes(run)}, seed "
        f"{run['seed']}, checkpoints {_steps(steps) or 'none'}"
    ]
    for r in data["reads"]:
        head = f"  index {r['index']}: epoch {r['epoch']} rank {r['rank']}"
        if len(run["generations"]) > 1:
            # Rank numbers are per world size once the run was resumed at another.
            head += f" (world size {r['world_size']})"
        if r["pass_index"]:
            # The rank read the epoch again from its start (a second pass).
            head += f" pass {r['pass_index'] + 1}"
        at = f" step {r['step']} (row {r['slot']} of the batch)" if r["step"] is not None else ""
        if r["status"] == "read":
            since = (
                f"after checkpoint {r['after']}"
                if r["after"] is not None
                else "before any checkpoint"
            )
            lines.append(f"{head}{at}: read {since}; in checkpoints {_steps(r['checkpoints'])}")
        elif r["status"] == "skipped":
            s = r["skip"]
            lines.append(
                f"{head}: skipped, never read (positions {s['start']}-{s['stop'] - 1} of the epoch)"
            )
        else:
            lines.append(f"{head}{at}: planned after the rank's newest checkpoint; none has it yet")
    return "\n".join(lines)


def consumed_text(report: dict[str, Any]) -> str:
    complete = "" if report["complete"] else " (not published by every rank)"
    lines = [
        f"checkpoint {report['step']}{complete}: {report['samples']:,} samples since the previous one"
    ]
    for r in report["ranks"]:
        if not r["published"]:
            lines.append(f"  rank {r['rank']}: did not publish this step")
            continue
        prev = r["previous"] if r["previous"] is not None else "the start"
        lines.append(
            f"  rank {r['rank']}: {r['samples']:,} samples since {prev} (epoch "
            f"{r['from']['epoch']} position {r['from']['position']} to epoch "
            f"{r['to']['epoch']} position {r['to']['position']})"
        )
        for e in r["epochs"]:
            ranges = " ".join(f"[{lo}, {hi})" for lo, hi in e["ranges"])
            lines.append(f"    epoch {e['epoch']}: sample indices {ranges}")
        for s in r["skips"]:
            lines.append(f"    skipped: epoch {s['epoch']} positions [{s['start']}, {s['stop']})")
    return "\n".join(lines)
