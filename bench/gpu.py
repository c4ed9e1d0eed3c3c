"""`make bench-gpu`: tokens per second into GPU memory through the device prefetcher
(issue 16), beside the pinned host-to-device limit measured in the same run.

    python -m bench.gpu [--size 2GiB] [--shards 16] [--rows 16384] [--ranks 1,8]
                        [--depth 2] [--passes 2] [--json PATH]

1. A token dataset (a `tokens` list<int32> column, lists of 128-384 tokens) is written
   as Arrow IPC shards on tmpfs and decoded once into an embedded cache whose memory
   tier is on tmpfs too: what a trainer beside a sidecar maps.
2. The limit: a pinned host buffer copied to the device in chunks the size of a batch,
   on one stream (the best a loader can do over this link).
3. For each K in --ranks, K local rank processes (all on this machine's GPUs, by
   LOCAL_RANK modulo the device count) each read their share of an epoch of batches of
   --rows rows through `shardcache.torch.DevicePrefetcher`, values plus offsets landing
   in GPU memory. Pass 1 registers the mappings (a one-time cost per mapping, reported);
   later passes are the steady state: tokens/s is total tokens over the wall time from
   a common start to the last rank's end, after a device synchronize. K=1 is also run
   with registration off (every batch staged through a pinned buffer: one CPU copy, the
   hand-written loop's path) for comparison.

   The prefetcher copies windows of batches (`window_bytes`, one device slab per
   window); K=1 is run once more with the per-batch path (`window_bytes=0`, what the
   prefetcher did before windows), with torch's `copy_` per run (`torch-copies`), and
   over the dataset in manifest order (`ordered`: a window's pieces are neighbours in
   their shard, so about one copy a window instead of one a shuffle block) for
   comparison in the same run. The steady figure of a run is the median of passes
   2..N; each run also prints its copies a batch and its bytes copied over the bytes
   handed over (values and offsets).
4. The CPU side, timed in this process with no byte copies at all: CPU microseconds
   (this thread's) per batch for the reader alone, the window path and the per-batch path (its tensors on
   torch's `meta` device: every op dispatched, no data). A batch of B bytes fed at 0.8
   of a limit L leaves B / (0.8 L) of CPU time per batch; the budget is printed beside.

5. Sample mode (`shuffle="sample"`, windows of 65,536 rows), K=1: `sample-device` (each
   window's runs copied to the device once, every batch gathered there) against
   `sample-cpu-gather` (today's path: each batch gathered on the CPU, then copied), two
   passes each (the second is the steady one; `--sample-batches` cuts a pass to that
   many batches: the CPU gather takes seconds a GiB), left out once the run has used
   --sample-after seconds (150) so the prepared command stays under 3 minutes. They
   are extra lines; the RESULT line stays block mode's.

Before the timed runs, on CUDA, VERIFY checks every path it reports (windows, per-batch,
staged) against the plain path's host tensors (offsets, padded, packed): a path that
fails is reported and not timed (the main runs then use the per-batch path). The two
sample paths are verified everywhere (on the CPU through the same window path, host to
host) against the plain sample-mode path (offsets, padded), and timed only if they pass.

It ends with `RESULT gpu_feed_ratio=… tokens_per_s=… path=…`: steady-state K=1 token
bytes/s (the median of passes 2..N) over the limit, the K=1 tokens/s, and which copy path gave them. The issue's target is a ratio >= 0.8 for batches
of 16,384 rows or more, with no CPU copy of the token values (`staged_bytes=0`).
Without CUDA both are `n/a` and the CPU side is measured alone: collation to host
tensors (tokens/s) and, where torch can pin memory, nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc

UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "": 1}
#: The pinned host-to-device limit measured on the lent H100 (docs/adapters.md): the
#: CPU budget's reference where this machine has no GPU.
REFERENCE_LIMIT = 54.8e9


def parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+)\s*(KiB|MiB|GiB|)", text)
    if m is None:
        raise argparse.ArgumentTypeError(f"expected a size such as 512MiB, found {text!r}")
    return int(m.group(1)) * UNITS[m.group(2)]


def write_dataset(root: Path, size: int, shards: int) -> int:
    """Shards of token lists (deterministic), `size` token bytes in all; the row count."""
    import numpy as np

    root.mkdir(parents=True, exist_ok=True)
    per_shard_tokens = size // 4 // shards
    rows_total = 0
    rng = np.random.default_rng(0)
    schema = pa.schema([("tokens", pa.list_(pa.int32()))])
    for i in range(shards):
        lengths = rng.integers(128, 385, size=per_shard_tokens // 256 + 1, dtype=np.int32)
        cut = int(np.searchsorted(np.cumsum(lengths, dtype=np.int64), per_shard_tokens))
        lengths = lengths[: max(1, cut)]
        offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        values = (np.arange(int(offsets[-1]), dtype=np.int64) % 50_021).astype(np.int32)
        array = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
        with ipc.new_file(str(root / f"part-{i:05d}.arrow"), schema) as writer:
            writer.write_batch(pa.record_batch([array], schema=schema))
        rows_total += len(lengths)
    return rows_total


def open_options(
    work: Path, size: int, block_size: int = 4096, *, shuffle: str | bool = True
) -> dict[str, Any]:
    return {
        "cache_dir": str(work / "cache"),
        "memory_dir": str(work / "memory"),
        "memory_limit": 3 * size + (256 << 20),
        "disk_limit": 3 * size + (256 << 20),
        "shuffle": shuffle,
        "block_size": block_size,
    }


def token_dataset(
    args: argparse.Namespace,
    work: Path,
    rows: int,
    *,
    rank: int = 0,
    world: int = 1,
    shuffle: str | bool = True,
) -> Any:
    """The benchmark's dataset of `tokens` through `shardcache.torch`, one rank's share."""
    import shardcache.torch

    return shardcache.torch.IterableDataset(
        f"file://{args.source}",
        batch_size=rows,
        columns=["tokens"],
        rank=rank,
        world_size=world,
        **open_options(work, args.size, args.block_size, shuffle=shuffle),
    )


def pinned_limit(chunk: int, total: int) -> float | None:
    """Bytes/s of pinned host → device copies of `chunk` bytes; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    host = torch.empty(chunk, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(chunk, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # untyped in torch
    best = 0.0
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.cuda.stream(stream):
            for _ in range(max(1, total // chunk)):
                dev.copy_(host, non_blocking=True)
        stream.synchronize()
        best = max(best, max(1, total // chunk) * chunk / (time.perf_counter() - start))
    return best


#: The paths the bench times: DevicePrefetcher options (and `shuffle`, the dataset's).
PATHS: dict[str, dict[str, Any]] = {
    "windows": {},
    # The window path with torch's `copy_` per run instead of one runtime call.
    "torch-copies": {"raw_copies": False},
    "per-batch": {"window_bytes": 0},
    "staged": {"register": False},
    # The window path over the dataset in manifest order: a window's pieces are
    # neighbours in their shard, so it is about one copy per window instead of one per
    # shuffle block (4-5 a 16,384-row batch). What fewer, larger copies could give.
    "ordered": {"shuffle": False},
}


def prefetcher_options(options: dict[str, Any]) -> dict[str, Any]:
    """A path's DevicePrefetcher options (without the dataset's `shuffle`)."""
    return {key: value for key, value in options.items() if key != "shuffle"}


#: Sample-mode paths, K=1: DevicePrefetcher options.
SAMPLE_PATHS: dict[str, dict[str, Any]] = {
    "sample-device": {},
    "sample-cpu-gather": {"device_gather": False},
}


def verify_sample(args: argparse.Namespace, work: Path) -> tuple[dict[str, bool], list[str]]:
    """Each sample path's batches equal the plain sample-mode path's host tensors
    (offsets, padded), on CUDA or, without it, through the window path on the CPU."""

    import shardcache.torch

    passed: dict[str, bool] = {}
    lines: list[str] = []
    for path, options in SAMPLE_PATHS.items():
        checked = gathered = 0
        failure = ""
        try:
            for extra in ({}, {"lists": "padded"}):
                kw: dict[str, Any] = dict(
                    open_options(work, args.size, shuffle="sample"),
                    batch_size=args.row_sizes[0] // 4,
                    columns=["tokens"],
                    rank=0,
                    world_size=1,
                    **extra,
                )
                plain = shardcache.torch.IterableDataset(f"file://{args.source}", **kw)
                fast = shardcache.torch.IterableDataset(f"file://{args.source}", **kw)
                with shardcache.torch.DevicePrefetcher(fast, depth=3, **options) as prefetcher:
                    batches = (
                        iter(prefetcher)
                        if prefetcher.device.type == "cuda"
                        else prefetcher._windowed()
                    )
                    checked += _compare(batches, plain, extra)
                    stats = prefetcher.stats
                    gathered += stats.device_gathered
                    if stats.fallback:
                        raise AssertionError(f"fell back to the CPU gather: {stats.fallback}")
                    if options.get("device_gather", True) != bool(stats.device_gathered):
                        raise AssertionError(
                            f"{stats.device_gathered} batches gathered on the device"
                        )
                plain.close()
                fast.close()
        except Exception as exc:  # report, keep measuring the other paths
            failure = f"{type(exc).__name__}: {exc}"
        passed[path] = not failure
        if failure:
            lines.append(f"VERIFY FAILED {path}: {failure}")
        else:
            lines.append(
                f"VERIFY ok {path}: {checked} sample-mode batches equal the plain path's; "
                f"{gathered} gathered on the device"
            )
    return passed, lines


#: Batches each VERIFY compares per option set.
VERIFY_BATCHES = 41


def _compare(batches: Any, plain: Any, extra: dict[str, Any]) -> int:
    """Raise unless the first `VERIFY_BATCHES` of `batches` equal the plain path's
    (same keys in the same order, dtypes and values); how many were compared."""
    import torch

    checked = 0
    for i, (a, b) in enumerate(zip(batches, plain, strict=True)):
        if list(a.keys()) != list(b.keys()):
            raise AssertionError(f"{extra} batch {i}: keys {list(a)}")
        for key in b:
            if a[key].dtype != b[key].dtype or not torch.equal(a[key].cpu(), b[key]):
                raise AssertionError(f"{extra} batch {i} column {key}")
        checked += 1
        if checked == VERIFY_BATCHES:
            break
    return checked


def verify(args: argparse.Namespace, work: Path) -> tuple[dict[str, bool], list[str]]:
    """On CUDA: each path's device batches equal the plain path's host tensors
    (offsets, padded, packed). Which paths passed, and one report line per path."""

    import shardcache.torch

    passed: dict[str, bool] = {}
    lines: list[str] = []
    for path, options in PATHS.items():
        checked = 0
        failure = ""
        direct = staged = 0
        try:
            for extra in ({}, {"lists": "padded"}, {"pack": 2048}):
                kw: dict[str, Any] = dict(
                    open_options(work, args.size, shuffle=options.get("shuffle", True)),
                    batch_size=args.row_sizes[0] // 4,
                    columns=["tokens"],
                    rank=0,
                    world_size=1,
                    **extra,
                )
                plain = shardcache.torch.IterableDataset(f"file://{args.source}", **kw)
                fast = shardcache.torch.IterableDataset(f"file://{args.source}", **kw)
                with shardcache.torch.DevicePrefetcher(
                    fast, depth=3, **prefetcher_options(options)
                ) as prefetcher:
                    checked += _compare(prefetcher, plain, extra)
                    stats = prefetcher.stats
                    direct += stats.direct_bytes
                    staged += stats.staged_bytes
                    if stats.fallback:
                        raise AssertionError(f"fell back to the per-batch path: {stats.fallback}")
                plain.close()
                fast.close()
        except Exception as exc:  # report, keep measuring the other paths
            failure = f"{type(exc).__name__}: {exc}"
        passed[path] = not failure
        if failure:
            lines.append(f"VERIFY FAILED {path}: {failure}")
        else:
            lines.append(
                f"VERIFY ok {path}: {checked} batches equal on the device; "
                f"direct {direct >> 20} MiB, staged {staged >> 20} MiB"
            )
    return passed, lines


class _Registered:
    """A registrar that pins nothing and refuses nothing (the CPU-side probe's)."""

    def register(self, address: int, size: int) -> bool:
        return True

    def unregister(self, address: int) -> None:
        pass


def cpu_side(args: argparse.Namespace, work: Path, rows: int, batches: int = 48) -> dict[str, Any]:
    """Microseconds per batch the CPU spends with no byte copied (see the docstring)."""
    import torch

    import shardcache.torch
    from shardcache import columns
    from shardcache.torch import _host_memory, _tensors

    ds = token_dataset(args, work, rows)

    def meta_move(array: Any, dtype: Any) -> Any:
        raw = columns.as_bytes(array)
        host = torch.utils.dlpack.from_dlpack(raw) if len(raw) else torch.empty(0)
        return host.to("meta").view(dtype)

    def timed(ds: Any, epoch: int, batches_of: Any, *, fresh: bool = False) -> float:
        # CPU time of this thread, not wall time: on a shared machine the wall clock
        # counts other processes' turns too. `fresh`: a new epoch each time (sample
        # mode's window permutations are kept per epoch once made).
        best = float("inf")
        for repeat in range(3):  # the first maps the shards; the best of the others
            ds.set_epoch(100 * epoch + repeat if fresh else epoch)
            count, start = 0, time.thread_time()
            for _ in batches_of():
                count += 1
                if count == batches:
                    break
            best = min(best, (time.thread_time() - start) / max(1, count))
        return best * 1e6

    prefetcher = shardcache.torch.DevicePrefetcher(ds, device="cpu")
    # Every mapping "registered" (nothing is pinned: the registrar only says yes), so the
    # probe plans the runs as the device does, each a DMA from a mapping, merged only
    # inside one, and skips them as a copy-less device run would.
    registry = _host_memory.Registry(_Registered(), settle=lambda: None)
    ds.add_mapping_listener(registry)
    prefetcher._registered = registry
    out = {
        "rows": rows,
        "reader_us": timed(ds, 0, lambda: iter(ds.reader())),
        "per_batch_us": timed(
            ds, 1, lambda: (_tensors.collate(b, move=meta_move) for b in ds.reader())
        ),
        # The window path with no byte copies: plans, offsets, views, hand-over.
        "windows_us": timed(ds, 2, lambda: prefetcher._windowed(copy=False)),
    }
    stats = prefetcher.stats
    windows = max(1, stats.windows)
    out["batches_per_window"] = stats.batches / windows
    out["copies_per_batch"] = stats.runs / max(1, stats.batches)
    prefetcher.close()
    ds.close()
    if rows == args.row_sizes[0]:
        out.update(sample_cpu_side(args, work, rows, batches, timed))
    return out


def sample_cpu_side(
    args: argparse.Namespace, work: Path, rows: int, batches: int, timed: Any
) -> dict[str, Any]:
    """Sample mode's CPU per batch with no byte moved: the deferring reader alone, and
    the device-gather path with its torch ops on the `meta` device (dispatched, no data):
    where a sample-mode batch's time goes on the host."""
    import shardcache.torch
    from shardcache.torch import _host_memory

    ds = token_dataset(args, work, rows, shuffle="sample")
    prefetcher = shardcache.torch.DevicePrefetcher(ds, device="meta")
    registry = _host_memory.Registry(_Registered(), settle=lambda: None)
    ds.add_mapping_listener(registry)
    prefetcher._registered = registry
    out = {
        "sample_reader_us": timed(ds, 1, lambda: iter(ds.reader(defer_gather=True)), fresh=True),
        "sample_device_us": timed(ds, 2, lambda: prefetcher._windowed(), fresh=True),
        "sample_gathered": prefetcher.stats.device_gathered,
    }
    prefetcher.close()
    ds.close()
    return out


def rank_main(args: argparse.Namespace) -> None:
    """One local rank: passes over its share, each timed from a common start."""
    import torch

    import shardcache.torch

    shuffle = {"True": True, "False": False}.get(str(args.shuffle), args.shuffle)

    ds = token_dataset(
        args, Path(args.work), args.rows, rank=args.rank, world=args.world, shuffle=shuffle
    )
    ds.shardcache_dataset()  # opened (manifest, cache) before the timed passes
    device = "cpu" if not torch.cuda.is_available() else None
    prefetcher = shardcache.torch.DevicePrefetcher(
        ds,
        device=device,
        depth=args.depth,
        register=not args.no_register,
        window_bytes=args.window_bytes,
        raw_copies=not args.torch_copies,
        device_gather=not args.cpu_gather,
    )
    # Sample mode without CUDA: the window path host to host (what the device runs),
    # so the CPU run exercises the gather paths too; block mode keeps the plain path.
    windowed = shuffle == "sample" and prefetcher.device.type != "cuda"
    passes = []
    for epoch in range(args.passes):
        go = Path(args.work) / f"go-{args.tag}-{epoch}"
        ready = Path(args.work) / f"ready-{args.tag}-{epoch}-{args.rank}"
        ready.touch()
        while not go.exists():
            time.sleep(0.001)
        prefetcher.set_epoch(epoch)
        start = time.time()
        tokens = rows = count = 0
        for batch in prefetcher._windowed() if windowed else prefetcher:
            tokens += batch["tokens"].numel()
            rows += batch["tokens_offsets"].numel()
            count += 1
            if count == args.batches:
                break  # a pass cut short (--sample-batches): the rate of its batches
        if prefetcher.device.type == "cuda":
            torch.cuda.synchronize(prefetcher.device)
        # Bytes the training loop received: int32 tokens and int64 offsets.
        used = 4 * tokens + 8 * rows
        passes.append(
            {"start": start, "end": time.time(), "tokens": tokens, "used": used, "batches": count}
        )
    stats = prefetcher.stats
    prefetcher.close()
    ds.close()
    print(
        "RANK "
        + json.dumps(
            {
                "passes": passes,
                "direct_bytes": stats.direct_bytes,
                "staged_bytes": stats.staged_bytes,
                "offsets_bytes": stats.offsets_bytes,
                "registered": stats.registered,
                "refused": stats.refused,
                "windows": stats.windows,
                "runs": stats.runs,
                "per_batch": stats.per_batch,
                "device_gathered": stats.device_gathered,
                "gather_windows": stats.gather_windows,
                "cpu_gathered": stats.cpu_gathered,
                "fallback": stats.fallback,
                "device": str(prefetcher.device),
            }
        ),
        flush=True,
    )


def copy_counts(res: dict[str, Any]) -> str:
    """Copies per batch and bytes copied over bytes the training loop received, over
    all of a run's passes (`n/a` for the per-batch path, which counts no copies)."""
    batches = sum(p["batches"] for p in res["passes"])
    used = sum(p["used_bytes"] for p in res["passes"])
    copied = res["direct_bytes"] + res["staged_bytes"] + res["offsets_bytes"]
    # Values (runs), offsets (one a window), a gathered batch's indices (one each).
    copies = res["runs"] + res["windows"] + res["gather_windows"] + res["device_gathered"]
    per_batch = f"{copies / batches:.2f}" if res["runs"] and batches else "n/a"
    ratio = f"{copied / used:.3f}" if used and copied else "n/a"
    return f"copies a batch {per_batch} (values, offsets and indices); bytes copied / used {ratio}"


def run_ranks(
    args: argparse.Namespace, k: int, *, path: str, tag: str, rows: int, passes: int | None = None
) -> dict[str, Any]:
    passes = passes or args.passes
    options = PATHS[path] if path in PATHS else SAMPLE_PATHS[path]
    register = options.get("register", True)
    window_bytes = options.get("window_bytes", args.window_bytes)
    work = Path(args.work)
    procs = []
    for rank in range(k):
        env = dict(os.environ, LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(k))
        cmd = [sys.executable, "-m", "bench.gpu", "--rank-of", f"{rank}/{k}", "--tag", tag]
        cmd += ["--work", str(work), "--source", str(args.source), "--size", str(args.size)]
        cmd += [
            "--rows",
            str(rows),
            "--block-size",
            str(args.block_size),
            "--depth",
            str(args.depth),
            "--passes",
            str(passes),
            "--window-bytes",
            str(window_bytes),
        ]
        if not register:
            cmd.append("--no-register")
        if not options.get("raw_copies", True):
            cmd.append("--torch-copies")
        if path in SAMPLE_PATHS:
            cmd += ["--shuffle", "sample", "--batches", str(args.sample_batches)]
        elif "shuffle" in options:
            cmd += ["--shuffle", str(options["shuffle"])]
        if not options.get("device_gather", True):
            cmd.append("--cpu-gather")
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    for epoch in range(passes):
        deadline = time.time() + 600
        while len(list(work.glob(f"ready-{tag}-{epoch}-*"))) < k:
            if any(p.poll() not in (None, 0) for p in procs) or time.time() > deadline:
                raise SystemExit(f"bench-gpu: a rank process failed before pass {epoch}")
            time.sleep(0.005)
        (work / f"go-{tag}-{epoch}").touch()
    ranks = []
    for proc in procs:
        out, _ = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"bench-gpu: a rank process exited with {proc.returncode}")
        ranks += [json.loads(line[5:]) for line in out.splitlines() if line.startswith("RANK ")]
    result: dict[str, Any] = {
        "k": k,
        "path": path,
        "register": register,
        "rows": rows,
        "passes": [],
    }
    for epoch in range(passes):
        start = min(r["passes"][epoch]["start"] for r in ranks)
        end = max(r["passes"][epoch]["end"] for r in ranks)
        tokens = sum(r["passes"][epoch]["tokens"] for r in ranks)
        result["passes"].append(
            {
                "seconds": end - start,
                "tokens": tokens,
                "tokens_per_s": tokens / (end - start),
                "used_bytes": sum(r["passes"][epoch]["used"] for r in ranks),
                "batches": sum(r["passes"][epoch]["batches"] for r in ranks),
            }
        )
    steady = result["passes"][1:] or result["passes"]
    result["steady_tokens_per_s"] = statistics.median(p["tokens_per_s"] for p in steady)
    for key in (
        "direct_bytes",
        "staged_bytes",
        "offsets_bytes",
        "registered",
        "refused",
        "windows",
        "runs",
    ):
        result[key] = sum(r[key] for r in ranks)
    for key in ("per_batch", "device_gathered", "gather_windows", "cpu_gathered"):
        result[key] = sum(r[key] for r in ranks)
    result["fallback"] = sorted({r["fallback"] for r in ranks if r["fallback"]})
    result["device"] = ranks[0]["device"]
    return result


def check_room(where: Path, size: int) -> None:
    """Refuse, before writing anything, a dataset the work directory's filesystem cannot
    hold: the source, the disk tier and the memory tier are each a copy of it (tmpfs is
    shared memory: filling it would starve every other process on the machine)."""
    need = 3 * size + (256 << 20)
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    if free < need:
        raise SystemExit(
            f"bench-gpu: --size {size / 2**30:.1f} GiB needs about {need / 2**30:.1f} GiB free "
            f"under {where} (source, disk tier and memory tier), found {free / 2**30:.1f} GiB; "
            "pass a smaller --size (bench/gpu_device.sh is sized for the 125 GiB GPU machine)"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.gpu", description=__doc__.split("\n")[0])
    p.add_argument("--size", type=parse_size, default=parse_size("512MiB"))
    p.add_argument("--shards", type=int, default=16)
    p.add_argument(
        "--rows",
        default="16384",
        help="rows per batch; more values (e.g. 16384,65536) add K=1 runs at those sizes",
    )
    p.add_argument("--block-size", type=int, default=4096, help="shuffle block (rows)")
    p.add_argument("--ranks", default="1,8")
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--passes", type=int, default=2)
    p.add_argument(
        "--window-bytes",
        type=parse_size,
        default=None,
        help="values per copy window (default: the prefetcher's; 0: per-batch path)",
    )
    p.add_argument(
        "--sample-after",
        type=float,
        default=150.0,
        help="seconds into the run after which the sample-mode runs are left out (the "
        "prepared command must stay under 3 minutes and end with RESULT)",
    )
    p.add_argument(
        "--sample-batches",
        type=int,
        default=0,
        help="batches per rank in each sample-mode pass (0: the whole epoch); the CPU "
        "gather path takes seconds a GiB",
    )
    p.add_argument("--json", type=Path)
    p.add_argument("--root", type=Path, help="work directory (default: a new one on /dev/shm)")
    # Internal: one rank process.
    p.add_argument("--rank-of", help=argparse.SUPPRESS)
    p.add_argument("--tag", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--source", help=argparse.SUPPRESS)
    p.add_argument("--no-register", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--torch-copies", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--shuffle", default=True, help=argparse.SUPPRESS)
    p.add_argument("--cpu-gather", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--batches", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.window_bytes is None:
        from shardcache.torch import _prefetch

        args.window_bytes = _prefetch.WINDOW_BYTES
    if args.rank_of:
        args.rank, args.world = (int(x) for x in args.rank_of.split("/"))
        args.rows = int(args.rows)
        rank_main(args)
        return 0

    import torch

    args.row_sizes = [int(r) for r in str(args.rows).split(",") if r]
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    check_room(args.root or shm, args.size)
    work = args.root or Path(tempfile.mkdtemp(prefix="shardcache-bench-gpu-", dir=shm))
    args.work = str(work)
    args.source = work / "source"
    started = time.perf_counter()
    try:
        t0 = time.perf_counter()
        rows = write_dataset(args.source, args.size, args.shards)
        print(
            f"dataset: {args.size / 2**20:.0f} MiB of int32 tokens, {rows} rows, {args.shards} shards, "
            f"written in {time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        # Decode every shard into the memory tier once, outside the timed passes.
        import shardcache

        t0 = time.perf_counter()
        with shardcache.open(f"file://{args.source}", **open_options(work, args.size)) as warm:
            for _ in warm.batches(1 << 20, columns=["tokens"]):
                pass
        print(f"cache warmed in {time.perf_counter() - t0:.1f} s", flush=True)

        cuda = torch.cuda.is_available()
        batch_bytes = args.row_sizes[0] * 256 * 4
        limit = pinned_limit(batch_bytes, 4 << 30) if cuda else None
        gpu = torch.cuda.get_device_name(0) if cuda else "none"
        print(f"device: {gpu}; torch {torch.__version__}", flush=True)
        if limit is not None:
            print(
                f"pinned host-to-device limit: {limit / 1e9:.2f} GB/s ({batch_bytes >> 20} MiB copies)"
            )
        passed = {path: True for path in PATHS}
        if cuda:
            passed, lines = verify(args, work)
            for line in lines:
                print(line, flush=True)
        sample_passed, lines = verify_sample(args, work)
        for line in lines:
            print(line, flush=True)
        passed.update(sample_passed)
        reference = limit or REFERENCE_LIMIT
        cpu = []
        for rows in args.row_sizes:
            probe = cpu_side(args, work, rows)
            cpu.append(probe)
            budget = rows * 256 * 4 / (0.8 * reference) * 1e6
            print(
                f"CPU side (thread CPU time, no bytes copied), rows={rows}: reader {probe['reader_us']:.0f} us/batch, "
                f"windows {probe['windows_us']:.0f} us/batch ({probe['batches_per_window']:.1f} "
                f"batches a window, {probe['copies_per_batch']:.2f} copies a batch), per-batch "
                f"path {probe['per_batch_us']:.0f} us/batch; budget for 0.8 of "
                f"{reference / 1e9:.1f} GB/s: {budget:.0f} us/batch",
                flush=True,
            )
            if "sample_reader_us" in probe:
                print(
                    f"CPU side, sample mode (thread CPU time, no bytes moved), rows={rows}: "
                    f"reader (gather deferred) {probe['sample_reader_us']:.0f} us/batch, "
                    f"device-gather path (ops on the meta device) "
                    f"{probe['sample_device_us']:.0f} us/batch; a batch at the limit "
                    f"takes {rows * 256 * 4 / reference * 1e6:.0f} us",
                    flush=True,
                )
        main_path = "windows" if passed["windows"] else "per-batch"
        if not passed[main_path]:
            raise SystemExit("bench-gpu: no copy path verified; nothing to time")
        results = []
        ks = [int(k) for k in args.ranks.split(",") if k]
        first = args.row_sizes[0]
        runs = [(k, main_path, first) for k in ks]
        if cuda:
            runs += [
                (1, path, first)
                for path in ("ordered", "torch-copies", "per-batch", "staged")
                if passed[path]
            ]
            runs = [r for i, r in enumerate(runs) if r not in runs[:i]]
        runs += [(1, main_path, rows) for rows in args.row_sizes[1:]]
        # Sample mode, K=1, after the block-mode runs: extra lines, not the RESULT.
        runs += [(1, path, first) for path in SAMPLE_PATHS if passed[path]]
        for k, path, rows in runs:
            tag = f"k{k}-r{rows}-{path}"
            passes = None
            if path in SAMPLE_PATHS:
                used = time.perf_counter() - started
                if used > args.sample_after:
                    print(f"SAMPLE {path} not run: {used:.0f} s used (--sample-after)")
                    continue
                passes = min(2, args.passes)  # pass 1 registers; pass 2 is the steady one
            res = run_ranks(args, k, path=path, tag=tag, rows=rows, passes=passes)
            results.append(res)
            for i, ps in enumerate(res["passes"]):
                gbps = ps["tokens_per_s"] * 4 / 1e9
                ratio = f" ratio={gbps * 1e9 / limit:.2f}" if limit else ""
                print(
                    f"K={k} rows={rows} {path:9} pass {i + 1}: "
                    f"{ps['tokens_per_s'] / 1e9:.3f} Gtokens/s = {gbps:.2f} GB/s{ratio} "
                    f"({ps['seconds']:.2f} s)"
                )
            steady_gbps = res["steady_tokens_per_s"] * 4 / 1e9
            print(
                f"K={k} rows={rows} {path:9} steady ("
                + (
                    f"median of passes 2-{len(res['passes'])}"
                    if len(res["passes"]) > 2
                    else f"pass {len(res['passes'])}"
                )
                + "): "
                f"{res['steady_tokens_per_s'] / 1e9:.3f} Gtokens/s = {steady_gbps:.2f} GB/s"
                + (f" ratio={steady_gbps * 1e9 / limit:.2f}" if limit else "")
            )
            print("  " + copy_counts(res))
            print(
                f"  device {res['device']}: direct {res['direct_bytes'] >> 20} MiB, staged "
                f"{res['staged_bytes'] >> 20} MiB, registered {res['registered']} mappings, "
                f"refused {res['refused']}; {res['windows']} windows, {res['runs']} copies, "
                f"{res['per_batch']} batches per-batch"
                + (
                    f"; {res['device_gathered']} batches gathered on the device from "
                    f"{res['gather_windows']} window copies, {res['cpu_gathered']} on the CPU"
                    if path in SAMPLE_PATHS
                    else ""
                )
                + (f"; FELL BACK: {res['fallback']}" if res["fallback"] else ""),
                flush=True,
            )
        sample = {r["path"]: r["steady_tokens_per_s"] for r in results if r["path"] in SAMPLE_PATHS}
        if len(sample) == len(SAMPLE_PATHS):
            print(
                f"SAMPLE K=1 rows={first}: sample-device "
                f"{sample['sample-device'] / 1e9:.3f} Gtokens/s, sample-cpu-gather "
                f"{sample['sample-cpu-gather'] / 1e9:.3f} Gtokens/s "
                f"({sample['sample-device'] / sample['sample-cpu-gather']:.2f}x)"
                + ("" if cuda else " (no CUDA: both on the CPU)"),
                flush=True,
            )
        steady = next(
            r for r in results if r["k"] == 1 and r["path"] == main_path and r["rows"] == first
        )["steady_tokens_per_s"]
        if cuda and limit:
            ratio_s = f"{steady * 4 / limit:.2f}"
            tps = f"{steady:.4g}"
        else:
            ratio_s = tps = "n/a"
            print(
                f"no CUDA: CPU side only, collation to host tensors at "
                f"{steady / 1e9:.3f} Gtokens/s (K=1)"
            )
        if args.json:
            args.json.write_text(
                json.dumps(
                    {
                        "limit_bytes_per_s": limit,
                        "verified": passed,
                        "cpu_side": cpu,
                        "device": gpu,
                        "runs": results,
                        "rows": args.row_sizes,
                        "size": args.size,
                    },
                    indent=2,
                )
            )
        print(f"RESULT gpu_feed_ratio={ratio_s} tokens_per_s={tps} path={main_path}")
        return 0
    finally:
        if args.root is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
