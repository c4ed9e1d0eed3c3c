"""`make bench-peers`: every loader over the same samples, one run, one machine.

    python -m bench.peers.harness --size 1GiB [--loaders a,b] [--docs docs/benchmarks.md]

Generates (or reuses) the dataset, converts it with each peer's own writer, then runs
each loader in its own process (`bench.peers.runner`) after evicting that loader's
input files from the page cache and giving it fresh cache directories. Prints a table
and, as the last line, `RESULT vs_mosaic=… vs_litdata=… vs_pyarrow=…`. Exits 1 when a
loader delivered anything but every sample exactly once per epoch.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import tree
from bench.peers import convert, dataset, loaders, memory, report, runner

REPO = Path(__file__).resolve().parents[2]
SHM = Path("/dev/shm")
#: Seconds one loader may take for its three passes before it is stopped and FAILED.
RUNNER_TIMEOUT_S = 3600

#: What each loader reads, relative to the work directory (evicted before it runs).
INPUTS = {
    "shardcache-sidecar-sample": "parquet",
    "shardcache-sidecar": "parquet",
    "shardcache-sidecar-disk": "parquet",
    "shardcache-embedded-sample": "parquet",
    "shardcache-embedded": "parquet",
    "pyarrow": "parquet",
    "litdata": "litdata",
    "litdata-dataloader": "litdata",
    "mosaic": "mds",
    "mosaic-dataloader": "mds",
    "torch-mapstyle": "arrow",
    "in-memory-ceiling": "parquet",
}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMG]i?B?)?\s*", text, re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a size such as 1GiB or 4MiB, got {text!r}")
    unit = (m.group(2) or "").upper().rstrip("B").rstrip("I")
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[unit]
    return int(float(m.group(1)) * scale)


def prepare(root: Path, params: dataset.Params, names: list[str]) -> dict[str, Any]:
    spec = dataset.ensure(root, params)
    files = dataset.parquet_files(root, spec)
    key = json.dumps(spec["expected"], sort_keys=True)
    needed = {INPUTS[n] for n in names}
    writers = {"mds": convert.to_mds, "litdata": convert.to_litdata, "arrow": convert.to_arrow_ipc}
    spec["conversions"] = {}
    for fmt, write in writers.items():
        if fmt in needed:
            write(files, root / fmt, key)
            spec["conversions"][fmt] = {
                "seconds": convert.conversion_seconds(root / fmt),
                "bytes": memory.dir_bytes(root / fmt),
            }
    return spec


def run_one(
    name: str, root: Path, spec: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    scratch = root / "scratch" / name
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    if name in loaders.TIER_ON_DISK:
        # Medium Disk: the memory tier is a directory on a disk's filesystem. Not under
        # `scratch`: the control socket beside it must fit in 107 bytes.
        shm_scratch = Path(tempfile.mkdtemp(prefix=f"scb-{name}-", dir=args.disk_tier_dir))
    else:
        shm_scratch = Path(tempfile.mkdtemp(prefix=f"scb-peers-{name}-", dir=args.shm_dir))
    inputs = memory.files_under([root / INPUTS[name]])
    memory.evict(inputs)
    resident = memory.resident_bytes(inputs)
    out_json = scratch / "result.json"
    cmd = [
        sys.executable, "-m", "bench.peers.runner", name,
        "--root", str(root), "--scratch", str(scratch), "--shm-scratch", str(shm_scratch),
        "--batch-size", str(args.batch_size), "--workers", str(args.workers),
        "--seed", str(args.seed), "--samples", str(spec["expected"]["samples"]),
        "--out", str(out_json), "--warm-passes", str(args.warm_passes),
    ]  # fmt: skip
    if name in args.profile:
        cmd += ["--profile", str(root / f"profile-{name}.txt")]
    env = {**os.environ, "PYTHONPATH": tree.python_path(), "LITDATA_DISABLE_VERSION_CHECK": "1"}
    log = (scratch / "runner.log").open("wb")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    sampler = memory.PeakSampler(proc.pid, watch_dir=shm_scratch)
    try:
        try:
            proc.wait(timeout=RUNNER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    finally:
        sampler.stop()
        log.close()
        shutil.rmtree(shm_scratch, ignore_errors=True)
    raw: dict[str, Any]
    if out_json.exists():
        raw = json.loads(out_json.read_text())
    else:
        tail = (scratch / "runner.log").read_text(errors="replace")[-2000:]
        raw = {"loader": name, "error": f"runner exited {proc.returncode} without a result\n{tail}"}
    row = report.judge(raw, spec["expected"], loaders.FAMILY[name])
    row.update(
        peak_rss=raw.get("vm_hwm", 0),
        peak_pss=sampler.peak_pss,
        tier_bytes=sampler.peak_dir,
        resident_after_evict=resident,
        raw=raw,
    )
    if not args.keep_scratch:
        shutil.rmtree(scratch / "cache", ignore_errors=True)
        shutil.rmtree(scratch / "disk", ignore_errors=True)
        shutil.rmtree(scratch / "litdata-cache", ignore_errors=True)
    return row


def docs_section(rows: list[dict[str, Any]], spec: dict[str, Any], args: argparse.Namespace) -> str:
    p = spec["params"]
    e = spec["expected"]
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    conv = ", ".join(
        f"{fmt} {c['bytes'] / (1 << 30):.2f} GiB in {c['seconds']:.0f} s"
        for fmt, c in spec.get("conversions", {}).items()
    )
    settings = "\n".join(f"- **{r['loader']}**: {r['raw'].get('settings', 'n/a')}" for r in rows)
    resident = [r["resident_after_evict"] for r in rows if r["resident_after_evict"] is not None]
    evicted = (
        f"At most {max(resident):,} bytes of any loader's input files were in the page cache "
        "when its cold pass started (fincore)."
        if resident
        else "Page-cache residency was not checked (no fincore)."
    )
    failures = "\n".join(
        f"- FAILED {r['loader']}: {r['failure']}" for r in rows if r["status"] != "ok"
    )
    return f"""_Generated by `{args.command_line}` on {when} ({platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()})._

Dataset: {e["samples"]:,} samples, {e["tokens"]:,} tokens ({e["tokens"] * 4 / (1 << 30):.2f} GiB of int32 token ids) in {len(spec["files"])} Parquet files ({spec["parquet_bytes"] / (1 << 30):.2f} GiB, snappy, {p["row_group_rows"]} rows per row group); seed {p["seed"]}. Conversions: {conv or "none"}. Batch size {args.batch_size}, {args.workers} DataLoader workers; warm figures are each loader's median of {args.warm_passes} warm passes, or of more (up to {max(args.warm_passes, runner.MAX_WARM_PASSES)}) where they took under {runner.MIN_WARM_SECONDS} s together. {evicted}

{report.markdown_table(rows)}

`{report.result_line(rows)}`

{report.result_basis(rows)}

![tokens/s per loader, cold and warm](benchmarks-peers.png)

Settings used in this run:

{settings}
{failures}
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size", type=parse_size, default=parse_size("1GiB"), help="token bytes")
    p.add_argument("--file-size", type=parse_size, default=parse_size("64MiB"))
    p.add_argument(
        "--root", type=Path, default=Path(tempfile.gettempdir()) / "shardcache-bench-peers"
    )
    p.add_argument("--loaders", default="all", help="comma-separated, 'all' or 'torch-free'")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--docs", type=Path, help="rewrite the results section of this Markdown file")
    p.add_argument("--chart", type=Path, help="write the tokens/s bar chart (PNG) here")
    p.add_argument("--json", type=Path, help="write every measurement here")
    p.add_argument(
        "--shm-dir",
        type=Path,
        default=SHM,
        help="memory-backed directory for memory tiers (default /dev/shm; e.g. a huge=always "
        "tmpfs to see what a huge-page memory tier changes)",
    )
    p.add_argument(
        "--disk-tier-dir",
        type=Path,
        default=Path("/var/tmp"),
        help="directory on a disk filesystem for the memory tier of shardcache-sidecar-disk "
        "(cache.medium Disk)",
    )
    p.add_argument(
        "--warm-passes",
        type=int,
        default=runner.WARM_PASSES,
        help=f"warm epochs per loader; its warm figures are the median pass's (default "
        f"{runner.WARM_PASSES}; more, up to {runner.MAX_WARM_PASSES}, while they take under "
        f"{runner.MIN_WARM_SECONDS} s together)",
    )
    p.add_argument("--keep-scratch", action="store_true")
    p.add_argument("--prepare-only", action="store_true", help="generate and convert, then stop")
    p.add_argument(
        "--profile",
        type=lambda s: [n for n in s.split(",") if n],
        default=[],
        help="comma-separated loaders whose warm pass is profiled (ROOT/profile-NAME.txt); "
        "profiling slows that pass",
    )
    args = p.parse_args(argv)
    args.command_line = "python -m bench.peers.harness " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    if args.loaders == "all":
        names = list(loaders.REGISTRY)
    elif args.loaders == "torch-free":
        names = list(loaders.TORCH_FREE)
    else:
        names = [n.strip() for n in args.loaders.split(",") if n.strip()]
    unknown = [n for n in names if n not in loaders.REGISTRY]
    if unknown:
        p.error(f"unknown loader(s) {unknown}; known: {', '.join(loaders.REGISTRY)}")
    args.root.mkdir(parents=True, exist_ok=True)
    params = dataset.Params(size_bytes=args.size, seed=args.seed, file_bytes=args.file_size)
    print(f"preparing {args.size / (1 << 20):,.0f} MiB of tokens under {args.root} ...", flush=True)
    spec = prepare(args.root, params, names)
    if args.prepare_only:
        print(f"prepared: {spec['expected']['samples']:,} samples", flush=True)
        return 0
    rows = []
    for name in names:
        print(f"running {name} ...", flush=True)
        row = run_one(name, args.root, spec, args)
        print(
            f"  {row['status']}" + (f": {row['failure']}" if row["status"] != "ok" else ""),
            flush=True,
        )
        rows.append(row)
    if args.json:
        args.json.write_text(json.dumps({"spec": spec, "rows": rows}, indent=2, default=str))
    if args.chart:
        report.chart(
            rows,
            args.chart,
            f"{spec['expected']['tokens'] * 4 / (1 << 30):.2f} GiB of tokens, batch {args.batch_size}",
        )
    if args.docs:
        report.update_docs(args.docs, docs_section(rows, spec, args))
    print(report.text_table(rows))
    print(report.result_line(rows))
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
