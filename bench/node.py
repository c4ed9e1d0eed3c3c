"""`make bench-node`: one node, K ranks, one sidecar (issue 14), measured in one run.

    python -m bench.node [--size 256MiB] [--shards 16] [--ks 1,2,4,8,16] [--minio PATH]

1. A tokenized-text dataset is generated into a work directory on tmpfs (`file://`, or
   MinIO with `--minio`; `bench.node_dataset`).
2. Cold: an all-core decode ceiling (threads = usable cores, each reading a shard,
   sha256, decoding Parquet, writing Arrow IPC; `bench.node_ceiling`; best of two),
   then a fresh sidecar at its default settings serving the first epoch to the
   largest K ranks, timed from its /healthz answering to the last rank's end.
3. Warm, for each K: K rank processes (`bench.node_rank`) read an epoch per pass
   through the sidecar, and K more read the same plans from the decoded files directly
   ("raw"), alternating pass by pass on the same epochs. The first pass is each
   process's first epoch (it opens the dataset, and every shard costs a control round
   trip), the ratio the RESULT line reports; later passes are later epochs in the same
   processes.

Throughput is token bytes (4 per int32 token) over the wall time from a common start to
the last rank's end. Every pass is checked: together the ranks read every row once
(count and uid sum; every uid with `--verify-rows`) and every token (count and sum). A K
the machine cannot run (more ranks than usable cores: affinity capped by the cgroup CPU
quota) is `n/a`. This is a benchmark, not a test; the issue's targets (16 cores) are
k8_ratio >= 0.9, k16_ratio >= 0.85, cpu_ms_per_request <= 0.3, p99_control_ms <= 2 at
K=8, cold_ratio >= 0.8.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from shardcache_sidecar import launcher

import shardcache
from bench import (
    node_ceiling,
    node_dataset,
    node_probes,
    node_profile,
    node_ranks,
    node_report,
    node_slow,
    node_timeline,
    tree,
)
from shardcache import contract, plans, source
from shardcache.contract import protocol

GiB = 1 << 30
MiB = 1 << 20
MOUNT = "local"
#: Mean tokens per generated row (64 to 319), to size shards from --size.
TOKENS_PER_ROW = 191
#: Seconds for notifications that trail a pass (the client sends them off the read path)
#: to reach the sidecar before its CPU time and request count are read.
SETTLE_S = 0.05
#: Samples per second of `--profile-cold` (py-spy --gil): a cold epoch is seconds long.
COLD_PROFILE_RATE = 250


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMG]i?B?)?\s*", text, re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a size such as 6GiB or 256MiB, got {text!r}")
    unit = (m.group(2) or "").upper().rstrip("B").rstrip("I")
    return int(float(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[unit])


def parse_ks(text: str) -> list[int]:
    try:
        ks = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected K values such as 1,2,4, got {text!r}") from None
    if not ks or ks[0] < 1:
        raise argparse.ArgumentTypeError(f"K values must be >= 1, got {text!r}")
    return ks


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument(
        "--size",
        type=parse_size,
        default=256 * MiB,
        help="token bytes to generate (int32 tokens; default 256MiB)",
    )
    p.add_argument("--shards", type=int, default=16, help="Parquet shards (default 16)")
    p.add_argument(
        "--ks",
        type=parse_ks,
        default=[1, 2, 4, 8, 16],
        help="rank counts, comma-separated (default 1,2,4,8,16)",
    )
    p.add_argument(
        "--max-ranks",
        type=int,
        default=None,
        help="the most ranks to run at once (default: usable cores)",
    )
    p.add_argument(
        "--passes",
        type=int,
        default=3,
        help="epochs per K and mode: the first, then later ones (default 3)",
    )
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--no-shuffle", action="store_true", help="read in manifest order")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--fetch-concurrency",
        type=int,
        default=None,
        help="the sidecar's fetch concurrency (default: the sidecar's default)",
    )
    p.add_argument("--minio", type=Path, default=None, help="MinIO binary: serve from s3://")
    p.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="parent of the work directory (default: /dev/shm when it has room)",
    )
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument(
        "--logs",
        type=Path,
        default=None,
        help="copy the sidecar's and the ranks' logs here before cleaning up",
    )
    p.add_argument(
        "--verify-rows",
        action="store_true",
        help="check every uid of every pass, not only counts and sums (slow)",
    )
    p.add_argument("--json", type=Path, default=None, help="write the figures here too")
    p.add_argument(
        "--timeline",
        type=Path,
        default=None,
        help="write the cold epoch's slot occupancy and per-shard stage times here",
    )
    p.add_argument(
        "--profile-cold",
        type=Path,
        default=None,
        help="sample the cold epoch's sidecar with py-spy (--gil, from its start) into "
        "this file (collapsed stacks) and print a summary; perturbs the cold figures",
    )
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="sample the sidecar with py-spy during the warm passes into this "
        "file (collapsed stacks) and print a summary; inflates its CPU figures",
    )
    p.add_argument(
        "--account",
        action="store_true",
        help="turn on the sidecar's own account of slow requests and event-loop stalls "
        "(a 5 ms watchdog and a sampling thread, `service_times`) and print it per K; "
        "off by default: it costs the figures it explains (docs/benchmarks.md, session 7)",
    )
    args = p.parse_args(argv)
    if args.passes < 1 or args.shards < 1:
        p.error("--passes and --shards must be >= 1")
    return args  # fmt: skip


def choose_work_dir(parent: Path | None, size: int) -> Path:
    """tmpfs when it has room for the source, the disk tier, the memory tier and the
    ceiling's output (about 3.5 times the token bytes), else the temporary directory."""
    if parent is None:
        need = int(size * 3.5) + GiB
        shm = Path("/dev/shm")
        if shm.is_dir() and shutil.disk_usage(shm).free >= need:
            parent = shm
        else:
            parent = Path(tempfile.gettempdir())
            print(f"/dev/shm lacks {need / GiB:.1f} GiB free: working under {parent}", flush=True)
    # Short: the control socket's path must fit in 107 bytes.
    return Path(tempfile.mkdtemp(prefix="scbn-", dir=parent))


def shard_layout(trainer_env: dict[str, str]) -> dict[str, Any]:
    """Where each shard's decoded file is, for the raw ranks: asked of the sidecar
    through the provider, as the inspector does. Every shard is resident by then and the
    memory limit holds them all, so the files stay where they are."""
    saved = dict(os.environ)
    os.environ.update(trainer_env)
    try:
        with shardcache.open() as ds:
            shards = ds.provider
            reader = shards.open_reader(ds.params, position=0)
            paths = []
            for shard in range(len(ds.manifest.shards)):
                lease = shards.acquire(reader, shard, epoch=0, position=0)
                paths.append(str(lease.path))
                lease.release()
            shards.close_reader(reader)
            return {
                "paths": paths,
                "shard_rows": list(ds.manifest.shard_rows),
                "digest": ds.manifest.digest,
            }
    finally:
        os.environ.clear()
        os.environ.update(saved)


def uids_by_pass(
    cold: node_ranks.Pass, results: list[node_report.KResult]
) -> dict[str, list[list[list[int]]]]:
    """{"cold": passes, "raw-K": passes, "sidecar-K": passes}; a pass is its ranks' uids."""
    out = {"cold": [[r["uids"] for r in cold.ranks]]}
    for result in results:
        for mode, passes in (("raw", result.raw), ("sidecar", result.sidecar)):
            out[f"{mode}-{result.k}"] = [[r["uids"] for r in p.ranks] for p in passes]
    return out


def cold_timeline(
    work: Path, metrics_url: str, healthy: float, go: float, end: float
) -> tuple[float, str, dict[str, Any]]:
    """The cold epoch's start, slot occupancy report and figures, from the sidecar's log
    (`sidecar-<metrics port>.log`, `bench.node_timeline`).

    The epoch starts when /healthz answered (`healthy`, as the launcher's poll saw it,
    up to a poll interval late) or when the sidecar first asked for a shard, if that
    was earlier: a fetch before the poll saw /healthz is part of the epoch's work."""
    log = work / f"sidecar-{metrics_url.rsplit(':', 1)[1]}.log"
    time.sleep(SETTLE_S)  # the last lines reach the file
    found = node_timeline.read(log)
    if found.slots is None:
        return healthy, f"cold-epoch timeline: no fetch concurrency in {log.name}", {}
    start = min([healthy, *(s.times["t_queued"] for s in found.shards if "t_queued" in s.times)])
    # The log's clock is the wall clock (milliseconds); the timeline's is monotonic.
    ready = None if found.serving is None else found.serving - (time.time() - time.monotonic())
    report = node_timeline.report(found.shards, found.slots, start, end, go=go, serving=ready)
    return start, report, node_timeline.figures(found.shards, found.slots, start, end)


def timeline_table(figures: dict[str, Any]) -> str:
    """One row per shard of the cold epoch: seconds from /healthz answering to each
    stage (`bench.node_timeline.figures`)."""
    stages = ("t_queued", "t_slot", "t_fetched", "t_decode", "t_decoded", "t_inserted")
    rows = [
        "shard why        outcome    worker                "
        + " ".join(f"{s[2:]:>9}" for s in stages)
    ]
    for shard in sorted(figures.get("shards", []), key=lambda r: r.get("t_slot", 1e9)):
        cells = " ".join(f"{shard[s]:9.3f}" if s in shard else f"{'-':>9}" for s in stages)
        rows.append(
            f"{shard['shard']:5d} {shard['why']:<10} {shard['outcome']:<10} "
            f"{shard['thread']:<21} {cells}"
        )
    return "\n".join(rows) + "\n"


@dataclasses.dataclass
class Bench:
    """One run's settings and the sidecar under test."""

    args: argparse.Namespace
    work: Path
    rank_env: dict[str, str]
    rank_config: dict[str, Any]
    expected: node_ranks.Expected
    sidecar_pid: int = 0
    metrics_url: str = ""
    #: The sidecar's JSON log: its slow requests and loop stalls (`bench.node_slow`).
    sidecar_log: Path | None = None

    def warm(self, k: int, first_epoch: int) -> node_report.KResult:
        """K raw and K sidecar ranks, alternating pass by pass on the same epochs."""
        raw: list[node_ranks.Pass] = []
        through: list[node_ranks.Pass] = []
        cpu_s = loop_cpu_s = requests = 0.0
        windows: list[tuple[float, float]] = []
        env, config, verify = self.rank_env, self.rank_config, self.args.verify_rows
        with (
            node_ranks.started("raw", k, self.work, env, config) as raw_ranks,
            node_ranks.started("sidecar", k, self.work, env, config) as sidecar_ranks,
        ):
            for epoch in range(first_epoch, first_epoch + self.args.passes):
                raw.append(raw_ranks.run(epoch))
                self.expected.check(f"raw K={k} epoch {epoch}", raw[-1], verify_rows=verify)
                served = node_probes.control_requests(self._metrics(), protocol.PREFIX)
                cpu = node_probes.cpu_seconds(self.sidecar_pid)
                loop_cpu = node_probes.cpu_seconds(self.sidecar_pid, thread=self.sidecar_pid)
                started = time.monotonic()
                through.append(sidecar_ranks.run(epoch))
                time.sleep(SETTLE_S)
                cpu_s += node_probes.cpu_seconds(self.sidecar_pid) - cpu
                loop_cpu_s += (
                    node_probes.cpu_seconds(self.sidecar_pid, thread=self.sidecar_pid) - loop_cpu
                )
                windows.append((started, time.monotonic()))
                samples = self._metrics()
                requests += node_probes.control_requests(samples, protocol.PREFIX) - served
                self.expected.check(f"sidecar K={k} epoch {epoch}", through[-1], verify_rows=verify)
            memory_tier = node_probes.memory_tier_bytes(samples)
            sidecar_pss = node_probes.pss_bytes(self.sidecar_pid)
        slow = ""
        if not self.args.account:
            slow = "   the sidecar's own account of slow requests and stalls: off (--account)"
        elif self.sidecar_log is not None and self.sidecar_log.exists():
            slow = node_slow.report(node_slow.within(node_slow.read(self.sidecar_log), windows))
        return node_report.KResult(
            k,
            raw,
            through,
            cpu_s,
            requests,
            memory_tier,
            sidecar_pss,
            shard_epochs=self.args.shards * len(through),
            loop_cpu_s=loop_cpu_s,
            slow=slow,
        )

    def _metrics(self) -> dict[str, float]:
        return node_probes.metrics(self.metrics_url)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cores = node_probes.usable_cores()
    max_ranks = args.max_ranks or cores
    runnable = [k for k in args.ks if k <= max_ranks]
    if not runnable:
        raise SystemExit(f"no K in {args.ks} fits {max_ranks} usable cores")
    skipped = [k for k in args.ks if k > max_ranks]
    block = plans.DEFAULT_BLOCK_SIZE
    # Rows per shard: a multiple of the block size, the recommended layout.
    rows = max(block, args.size // 4 // TOKENS_PER_ROW // args.shards // block * block)
    print(
        f"bench-node: {cores} usable cores (affinity {len(os.sched_getaffinity(0))}, cgroup "
        f"quota {node_report.fmt(node_probes.cgroup_cpu_limit(), '.1f')}); K {runnable}"
        + (f", n/a for {skipped} (more ranks than cores)" if skipped else ""),
        flush=True,
    )
    work = choose_work_dir(args.workdir, args.size)
    try:
        with launcher.object_store(args.minio, work) as (root, storage_env):
            return run(args, work, root, storage_env, cores, rows, runnable, max_ranks)
    finally:
        if args.logs is not None:
            args.logs.mkdir(parents=True, exist_ok=True)
            for log in work.glob("*.log"):
                shutil.copy(log, args.logs / log.name)
        if args.keep:
            print(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def run(
    args: argparse.Namespace,
    work: Path,
    root: str,
    storage_env: dict[str, str],
    cores: int,
    rows: int,
    runnable: list[int],
    max_ranks: int,
) -> int:
    t = time.perf_counter()
    tokens = node_dataset.generate(root, storage_env, args.shards, rows, threads=cores)
    print(
        f"dataset: {args.shards} Parquet shards x {rows:,} rows, {tokens:,} tokens "
        f"({tokens * 4 / GiB:.2f} GiB of int32 tokens), generated in "
        f"{time.perf_counter() - t:.1f} s at {root}",
        flush=True,
    )
    fs, prefix = source.filesystem(root, storage_options=storage_env or None)
    sources = [f"{prefix}/{node_dataset.shard_name(i)}" for i in range(args.shards)]
    source_bytes = sum(fs.get_file_info(s).size or 0 for s in sources)
    # A ceiling is the best the machine did: best of two, as other work may interfere.
    ceiling = min(
        (node_ceiling.measure(fs, sources, work / "ceiling", cores) for _ in range(2)),
        key=lambda c: c.seconds,
    )
    total_rows = args.shards * rows
    if (ceiling.rows, ceiling.uid_sum, ceiling.tokens) != (
        total_rows,
        total_rows * (total_rows - 1) // 2,
        tokens,
    ):
        raise SystemExit("FAILED: the ceiling's decoded files do not hold the dataset")
    ceiling_gbps = tokens * 4 / ceiling.seconds / 1e9
    print(
        f"all-core decode ceiling ({cores} threads: read, sha256, Parquet decode, Arrow IPC "
        f"write; best of 2): {ceiling.seconds:.2f} s, {ceiling_gbps:.2f} GB/s, "
        f"{ceiling.cpu_seconds:.2f} s of CPU",
        flush=True,
    )

    trainer_env = {contract.ENV_RUN_DIR: str(work / "run"), contract.ENV_MOUNT: MOUNT}
    bench = Bench(
        args=args,
        work=work,
        rank_env={
            **os.environ,
            **trainer_env,
            "PYTHONPATH": tree.python_path(),
        },
        rank_config={
            "seed": args.seed,
            "shuffle": not args.no_shuffle,
            "block_size": plans.DEFAULT_BLOCK_SIZE,
            "batch_size": args.batch_size,
            "keep_uids": args.verify_rows,
            "layout": str(work / "layout.json"),
        },
        expected=node_ranks.Expected(ceiling.rows, ceiling.tokens, ceiling.token_sum),
    )
    k_cold = runnable[-1]
    sidecar_env = {
        contract.ENV_READY_SHARDS: "0",
        # The startup plan is rank 0's, as a pod of K ranks would declare it.
        contract.ENV_SEED: str(args.seed),
        contract.ENV_SHUFFLE: "false" if args.no_shuffle else "true",
        contract.ENV_WORLD_SIZE: str(k_cold),
        contract.ENV_RANK: "0",
        # One sidecar serves the node's K ranks: their epochs fill from its start-up.
        contract.ENV_LOCAL_RANKS: str(k_cold),
        # The per-shard timeline of the cold path (`bench.node_timeline`): DEBUG lines
        # of the `shardcache.node.timeline` logger, in JSON to be read back; with
        # --account, the sidecar's slow requests and loop stalls too (`node_slow`).
        contract.ENV_LOG_LEVEL: "INFO,shardcache.node.timeline=DEBUG"
        + (",shardcache_sidecar.slow=DEBUG" if args.account else ""),
        contract.ENV_LOG_FORMAT: "json",
    }
    if args.fetch_concurrency is not None:
        sidecar_env[contract.ENV_FETCH_CONCURRENCY] = str(args.fetch_concurrency)
    # The whole decoded dataset fits (tokens, list offsets, uids, slack): warm passes
    # never evict, and the raw ranks can read the files without leases.
    memory_limit = int((tokens * 4 + total_rows * 12) * 1.2) + 64 * MiB
    results: list[node_report.KResult] = []
    # The cold ranks start (interpreters, imports) before the sidecar does, so its
    # startup prefetch gets no head start while they import.
    cold_profile = contextlib.ExitStack()
    if args.profile_cold is not None:
        cold_profile.enter_context(
            node_profile.sampling_child(
                lambda: node_probes.find_child("shardcache sidecar"),
                args.profile_cold,
                rate=COLD_PROFILE_RATE,
            )
        )
    with (
        cold_profile,
        node_ranks.started("sidecar", k_cold, work, bench.rank_env, bench.rank_config) as cold,
    ):
        spawned = time.monotonic()
        with launcher.sidecar(
            root,
            storage_env,
            work,
            mount=MOUNT,
            memory_limit=memory_limit,
            disk_limit=source_bytes * 2 + GiB,
            wait_ready=False,
            extra_env=sidecar_env,
        ) as (env, metrics_url):
            serving = time.monotonic()
            bench.sidecar_pid = node_probes.find_child("shardcache sidecar")
            # The sidecar's CPU from here (its start-up, imports and all, is done) through
            # the cold epoch: fetches, decodes, inserts, resolving the manifest where
            # nothing is pinned, and the control requests. Where the load of a shared
            # machine makes the ratio below noise, this is the cold path's cost.
            serving_cpu = node_probes.cpu_seconds(bench.sidecar_pid)
            bench.metrics_url = metrics_url
            bench.sidecar_log = work / f"sidecar-{metrics_url.rsplit(':', 1)[1]}.log"
            if env != trainer_env:
                raise SystemExit(f"the launcher gives trainers {env}, expected {trainer_env}")
            go = serving + node_ranks.START_DELAY_S
            cold_pass = cold.run(0, go)
            cold.close()
            bench.expected.check("the cold epoch", cold_pass, verify_rows=args.verify_rows)
            cold_end = go + cold_pass.seconds
            cold_cpu = node_probes.cpu_seconds(bench.sidecar_pid) - serving_cpu
            cold_profile.close()
            start, report, timeline = cold_timeline(work, metrics_url, serving, go, cold_end)
            cold_seconds = cold_end - start
            cold_gbps = tokens * 4 / cold_seconds / 1e9
            print(
                f"cold epoch through the sidecar ({k_cold} ranks, fetch concurrency "
                f"{args.fetch_concurrency or 'default'}), from /healthz answering (or its first "
                f"fetch, {serving - start:.3f} s before the poll saw /healthz) to the last "
                f"rank's end: {cold_seconds:.2f} s, {cold_gbps:.2f} GB/s = "
                f"{cold_gbps / ceiling_gbps:.2f} of the ceiling",
                flush=True,
            )
            print(
                f"sidecar CPU from /healthz answering through the cold epoch: {cold_cpu:.2f} "
                f"s = {cold_cpu / ceiling.cpu_seconds:.2f} x the ceiling's",
                flush=True,
            )
            print(report, flush=True)
            if args.timeline is not None:
                args.timeline.write_text(report + "\n\n" + timeline_table(timeline))
            if args.profile_cold is not None and not args.profile_cold.exists():
                log = args.profile_cold.with_suffix(".log")
                why = log.read_text()[-2000:] if log.exists() else "py-spy never attached"
                print(f"cold-epoch profile: py-spy wrote nothing:\n{why}", flush=True)
            elif args.profile_cold is not None:
                share = node_profile.gil_share(
                    args.profile_cold, rate=COLD_PROFILE_RATE, seconds=cold_end - spawned
                )
                # Imports are done before /healthz answers: what is left is the cold path
                # and the control requests, over the cold epoch itself.
                working = node_profile.gil_share(
                    args.profile_cold,
                    rate=COLD_PROFILE_RATE,
                    seconds=cold_seconds,
                    skip=node_profile.IMPORTING,
                )
                print(
                    f"cold-epoch GIL: some sidecar thread held it {node_report.fmt(share, '.0%')} "
                    "of the time from its start to the last rank's end, and outside imports "
                    f"{node_report.fmt(working, '.0%')} of the cold epoch (py-spy --gil; the "
                    "figures above are inflated by the sampling)",
                    flush=True,
                )
                print(node_profile.summary(args.profile_cold), flush=True)
            (work / "layout.json").write_text(json.dumps(shard_layout(trainer_env)))
            evicted = node_probes.evictions(node_probes.metrics(bench.metrics_url))
            with (
                node_profile.sampling(bench.sidecar_pid, args.profile)
                if args.profile is not None
                else contextlib.nullcontext()
            ):
                for i, k in enumerate(runnable):
                    results.append(bench.warm(k, first_epoch=1 + i * args.passes))
                    print(node_report.k_block(results[-1]), flush=True)
            if args.profile is not None:
                print(node_profile.summary(args.profile))
            if node_probes.evictions(node_probes.metrics(bench.metrics_url)) != evicted:
                raise SystemExit(
                    "FAILED: shards were evicted during the warm passes, under the raw ranks"
                )

    print()
    print(node_report.summary(args.ks, results, max_ranks))
    cold_ratio = cold_gbps / ceiling_gbps
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "cores": cores,
                    "size": args.size,
                    "shards": args.shards,
                    "rows": total_rows,
                    "ceiling_gbps": ceiling_gbps,
                    "cold_gbps": cold_gbps,
                    "cold_ratio": cold_ratio,
                    "ceiling_cpu_s": ceiling.cpu_seconds,
                    "cold_sidecar_cpu_s": cold_cpu,
                    "cold_timeline": timeline,
                    "k": {str(r.k): r.figures() for r in results},
                    # Each pass's uids, rank by rank, for tests to check independently.
                    **({"uids": uids_by_pass(cold_pass, results)} if args.verify_rows else {}),
                },
                indent=2,
            )
        )
    print(node_report.result_line(results, cold_ratio))
    return 0


if __name__ == "__main__":
    sys.exit(main())
