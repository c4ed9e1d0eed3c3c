"""Measure one loader, in a process of its own: `python -m bench.peers.runner LOADER ...`.

Passes over the dataset, each tallied (`tallies.Tally`) as the loop receives it:

- cold: epoch 0 from a freshly created loader whose caches are empty and whose input
  files the harness evicted from the page cache; time to first batch counts from
  before the loader builds its dataset (a sidecar, like a native sidecar, is already
  running, and its start-up is reported apart);
- warm: epochs 1 to N (`--warm-passes`, default 3) with the same loader; the figure is
  the pass of median time (one pass of a fast loader is a fraction of a second on a
  shared machine, and single passes moved the RESULT ratios by a quarter between runs),
  and every pass must be exact;
- resume: epoch N+1 up to half its samples, save the loader's state, build a new loader
  instance from that state (what a restarted trainer does) and read to the end. The
  time to its first batch is the resume time; both halves together must again be
  exactly one epoch.

The result is one JSON file; the harness judges correctness against the dataset's
expected tally.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import resource
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.peers import loaders, tallies
from bench.peers.loaders import base


def consume(kind: base.Kind, item: Any, tally: tallies.Tally) -> int:
    """The loop body: hand one delivery to the tally; returns samples in it."""
    if kind == "arrow":
        tally.add_record_batch(item)
        return int(item.num_rows)
    if kind == "sample":
        tally.add_sample(int(item["uid"]), item["tokens"])
        return 1
    uids, values, offsets = item
    tally.add_arrays(uids, values, offsets)
    return len(uids)


def _drain(
    kind: base.Kind, items: Iterator[Any], started: float, limit: int | None = None
) -> tuple[tallies.Tally, float | None, float]:
    """Consume until exhausted (or `limit` samples); (tally, first-batch s, total s)."""
    tally = tallies.Tally()
    first: float | None = None
    seen = 0
    for item in items:
        if first is None:
            first = time.perf_counter() - started
        seen += consume(kind, item, tally)
        if limit is not None and seen >= limit:
            break
    tally.flush()
    return tally, first, time.perf_counter() - started


#: Test hook: drop the delivery with this index (0-based) from the cold pass, so the
#: smoke test can show that a lossy loader is reported FAILED.
ENV_DROP_DELIVERY = "BENCH_PEERS_DROP_DELIVERY"


def _dropping(items: Iterator[Any], index: int) -> Iterator[Any]:
    for i, item in enumerate(items):
        if i != index:
            yield item


def _pass(kind: base.Kind, items: Iterator[Any], started: float) -> dict[str, Any]:
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    tally, first, seconds = _drain(kind, items, started)
    return {
        "seconds": seconds,
        "ttfb_s": first,
        "tally": tally.summary(),
        # Page faults taken by the loop process during the pass (mapping costs show here).
        "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
    }


#: Warm passes by default: the median of three.
WARM_PASSES = 3
#: A loader whose warm passes together took less than this runs more of them (up to
#: `MAX_WARM_PASSES`) until they take this long: a median of three ~20 ms passes (the
#: in-memory ceiling) moved by half from one run to the next.
MIN_WARM_SECONDS = 0.5
MAX_WARM_PASSES = 15


def measure(
    name: str,
    setup: base.Setup,
    total_samples: int,
    profile: Path | None = None,
    warm_passes: int = WARM_PASSES,
) -> dict[str, Any]:
    started = time.perf_counter()
    loader = loaders.create(name, setup)
    out: dict[str, Any] = {
        "loader": name,
        "kind": loader.kind,
        "settings": loader.settings,
        "setup_s": time.perf_counter() - started,
    }
    try:
        start = time.perf_counter()
        cold = loader.epoch(0)
        if os.environ.get(ENV_DROP_DELIVERY):
            cold = _dropping(cold, int(os.environ[ENV_DROP_DELIVERY]))
        out["cold"] = _pass(loader.kind, cold, start)
        warm: list[dict[str, Any]] = []
        epoch = 0
        while len(warm) < warm_passes or (
            len(warm) < max(warm_passes, MAX_WARM_PASSES)
            and sum(p["seconds"] for p in warm) < MIN_WARM_SECONDS
        ):
            epoch += 1
            profiler = cProfile.Profile() if profile is not None and epoch == 1 else None
            if profiler is not None:
                profiler.enable()
            start = time.perf_counter()
            warm.append(_pass(loader.kind, loader.epoch(epoch), start))
            if profiler is not None and profile is not None:
                profiler.disable()
                _write_profile(profiler, profile)
        out["warm_passes"] = warm
        out["warm"] = median_pass(warm)
        out["resume"] = _resume(loader, total_samples, epoch=epoch + 1)
    finally:
        loader.close()
    out["vm_hwm"] = _vm_hwm()
    return out


def median_pass(passes: list[dict[str, Any]]) -> dict[str, Any]:
    """The pass of median time (the lower of the middle two for an even count)."""
    ordered = sorted(passes, key=lambda p: float(p["seconds"]))
    return ordered[(len(ordered) - 1) // 2]


def _vm_hwm() -> int:
    """This process's peak RSS in bytes (VmHWM). Unlike `ru_maxrss`, it starts afresh
    at exec, so the harness's own memory is not carried into the figure."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _write_profile(profiler: cProfile.Profile, path: Path) -> None:
    """The warm pass's hottest functions: where the loop's time goes."""
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(25)
    path.write_text(text.getvalue())


def _resume(loader: base.Loader, total_samples: int, epoch: int) -> dict[str, Any]:
    half = total_samples // 2
    items = loader.epoch(epoch)
    first_half, _, _ = _drain(loader.kind, items, time.perf_counter(), limit=half)
    state = loader.state(first_half.samples)
    if hasattr(items, "close"):
        items.close()
    if state is None:
        return {"supported": False}
    json.dumps(state, default=str)  # it has to be storable alongside a checkpoint
    start = time.perf_counter()
    rest, first, seconds = _drain(loader.kind, loader.resume(state), start)
    both = first_half.merged(rest)
    return {
        "supported": True,
        "saved_at": first_half.samples,
        "ttfb_s": first,
        "rest_seconds": seconds,
        "tally": both.summary(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("loader")
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--scratch", type=Path, required=True)
    p.add_argument("--shm-scratch", type=Path, required=True)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--samples", type=int, required=True, help="samples in one epoch")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--profile", type=Path, help="write a cProfile of the first warm pass here")
    p.add_argument(
        "--warm-passes",
        type=int,
        default=WARM_PASSES,
        help=f"warm epochs, more (up to {MAX_WARM_PASSES}) while they take under "
        f"{MIN_WARM_SECONDS} s together; the median counts",
    )
    args = p.parse_args(argv)
    if args.warm_passes < 1:
        p.error(f"--warm-passes: expected at least 1, found {args.warm_passes}")
    os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")
    setup = base.Setup(
        root=args.root,
        scratch=args.scratch,
        shm_scratch=args.shm_scratch,
        batch_size=args.batch_size,
        workers=args.workers,
        seed=args.seed,
    )
    try:
        result = measure(args.loader, setup, args.samples, args.profile, args.warm_passes)
    except BaseException as exc:
        result = {"loader": args.loader, "error": "".join(traceback.format_exception(exc))}
        args.out.write_text(json.dumps(result, indent=2))
        print(result["error"], file=sys.stderr)
        return 1
    args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
